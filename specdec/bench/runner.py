"""`specdec bench`: plain decoding, every speculative method and transformers' peers on the same
target weights, workloads, batch sizes and sampling settings, interleaved in one run, with the cost
model's prediction beside each measurement; writes bench.json (schema "specdec-bench/1", its fields
in docs/guide/bench.md) and the report. What cannot be determined is "unknown" or null, never guessed.
"""
from __future__ import annotations

import dataclasses
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from ..api import encode_prompts, load
from ..decoding.adaptive import AUTO_TREE, merge_summaries
from ..decoding.calibration import measure_verify_curve
from ..decoding.costmodel import predicted_speedup, speedup_limit
from ..decoding.engine import plain_generate, speculative_generate
from ..decoding.metrics import SpecMetrics
from ..decoding.sampling import SamplingConfig
from ..decoding.stopping import StopRule
from ..decoding.syncs import count_host_syncs
from ..decoding.verify import greedy_accept, rejection_sample
from ..errors import SpecdecError
from ..lm.checkpoint import shown_path, shown_text
from ..proposers import DRAFTERS, DraftModelOptions, NgramOptions, VocabOptions
from ..proposers.drafters import DraftCheckpoint
from .conditions import UNKNOWN, hardware, model_info, roofline, software, spread
from .noise import implausible_verify_points, result_noise
from .peers import PEER_DTYPE, PEERS, Peers
from .plain import measured_read_bandwidth
from .verify_cost import MoESpec, moe_vs_dense
from .workloads import WORKLOADS, workload

SCHEMA = "specdec-bench/1"
SPEC_METHODS = tuple(DRAFTERS)  # the drafters a plan compares: every entry of the registry
# MTP heads draft over the 4096 most frequent token ids (proposers/mtp.py): a quarter of the unembedding
# cost per head for about the same acceptance (measured: docs/methods/mtp.md)
MTP_DRAFT_VOCAB = 4096
DRAFT_VOCAB = 4096  # the draft model's too, where it was saved with its token counts
# the EAGLE head drafts over the 2048 most frequent of its 4096 ids (half the unembedding per draft): greedy τ
# is unchanged, at temperature 1 the head's mass outside the 2048 ids is lost (measured: docs/methods/eagle.md)
EAGLE_DRAFT_VOCAB = 2048
BENCH_OPTIONS = {"draft-model": DraftModelOptions(DRAFT_VOCAB, counted_only=True),
                 "hybrid": DraftModelOptions(DRAFT_VOCAB, counted_only=True),
                 "parallel": VocabOptions(DRAFT_VOCAB, counted_only=True),
                 "ngram": NgramOptions(ngram_max=3, ngram_min=1),
                 "mtp": VocabOptions(MTP_DRAFT_VOCAB, counted_only=True),
                 "eagle": VocabOptions(EAGLE_DRAFT_VOCAB, counted_only=True),
                 "eagle-hybrid": VocabOptions(EAGLE_DRAFT_VOCAB, counted_only=True)}  # the others: their defaults
CURVE_EXTRA_TOKENS = 16  # the batch-1 verify curve also reaches this many tokens (for the plot)
SEED_AGREEMENT = 3.0     # seeded and unseeded α agree within this many standard errors of their difference


@dataclass(frozen=True)
class Cell:
    workload: str
    temperature: float
    batch_size: int
    ks: tuple[int, ...]
    prompts: int
    peer_k: int | None = None  # k of transformers' assisted / prompt-lookup peers; None: no peers
    auto: bool = True          # also run each method with k="auto" (adaptive.py)
    trees: tuple[tuple[int, ...], ...] = ()  # static tree shapes (widths per depth) run by each method

    @property
    def label(self) -> str:
        return f"{self.workload}, temperature {self.temperature:g}, batch {self.batch_size}"


@dataclass(frozen=True)
class Plan:
    cells: tuple[Cell, ...]
    methods: tuple[str, ...] = SPEC_METHODS
    repeats: int = 3
    max_new_tokens: int = 128
    seed: int = 0
    moe: MoESpec | None = field(default_factory=MoESpec)


def quick_plan() -> Plan:
    """The evidence in as few generations as keep it (~100 of 48 tokens; `make run`): plain decoding,
    every drafter that fits at k = 3 and transformers' `generate` and prompt lookup on the same
    HumanEval prompts, greedy (so every output is checked against plain decoding's); the loss side
    (random characters, where drafts are rarely accepted) and sampling (temperature 1); 3 repeats
    each. The k sweep, k=auto, trees, batch sizes and the MoE check are the full plan's."""
    return Plan((Cell("humaneval", 0.0, 1, (3,), 2, peer_k=3, auto=False),
                 Cell("random-chars", 0.0, 1, (3,), 1, auto=False),
                 Cell("stdlib-tests", 1.0, 1, (3,), 1, auto=False)), max_new_tokens=48, moe=None)


def full_plan() -> Plan:
    """The whole plan: the k sweep with trees against the chains
    that verify as many tokens, k=auto in every cell, three workloads, temperature 0 and 1, and
    batch 1, 4 and 16 on the same 16 prompts; 96 new tokens per prompt."""
    return Plan((Cell("humaneval", 0.0, 1, (1, 2, 4, 7), 6, peer_k=4, trees=((2, 2), (3, 2, 2))),
                 Cell("stdlib-tests", 0.0, 1, (2, 4), 4, peer_k=4),
                 Cell("random-chars", 0.0, 1, (2, 4), 4),
                 Cell("humaneval", 1.0, 1, (2, 4), 5, peer_k=4, trees=((2, 2),)),
                 Cell("random-chars", 1.0, 1, (2,), 4),
                 *(Cell("humaneval", 0.0, b, (2,), 16) for b in (1, 4, 16))), max_new_tokens=96)


def grid_plan(workloads: list[str], ks: list[int], temperatures: list[float], batch_sizes: list[int],
              prompts: int, peers: bool) -> Plan:
    """Every combination of the given workloads, temperatures and batch sizes, each sweeping ks."""
    return Plan(tuple(Cell(w, t, b, tuple(ks), prompts, peer_k=max(ks) if peers and b == 1 else None)
                      for w in workloads for t in temperatures for b in batch_sizes))


def check_plan(plan: Plan) -> None:
    """Refuse a plan that cannot run, before any model is loaded."""
    for m in plan.methods:
        if m not in SPEC_METHODS:
            raise SpecdecError(f"unknown method {m!r}; known: {', '.join(SPEC_METHODS)}")
    if plan.repeats < 1 or plan.max_new_tokens < 1:
        raise SpecdecError(f"repeats and max_new_tokens must be >= 1, got {plan.repeats} and {plan.max_new_tokens}")
    for cell in plan.cells:
        if cell.workload not in WORKLOADS:
            raise SpecdecError(f"unknown workload {cell.workload!r}; known: {', '.join(WORKLOADS)}")
        if cell.batch_size < 1:
            raise SpecdecError(f"batch size must be >= 1, got {cell.batch_size}")
        if cell.prompts < cell.batch_size:
            raise SpecdecError(f"batch size {cell.batch_size} needs at least as many prompts, got {cell.prompts}: "
                               "raise --prompts")
        if cell.temperature < 0:
            raise SpecdecError(f"temperature must be >= 0, got {cell.temperature}")
        if not (cell.ks or cell.auto) or min(cell.ks, default=1) < 1:
            raise SpecdecError(f"draft lengths k must be >= 1 (or none, with k=auto), got {list(cell.ks)}")


def check_mtp_ks(plan: Plan, depth: int) -> None:
    """MTP runs at the plan's k <= depth (its heads draft one token each); a cell with none is refused."""
    for cell in plan.cells:
        if cell.ks and min(cell.ks) > depth:
            raise SpecdecError(f"the MTP heads draft at most {depth} tokens per step, but the ks {list(cell.ks)} "
                               f"are all larger: include a k <= {depth} or drop mtp from --methods")


@dataclass
class Config:
    """One configuration of a cell and what its repeats measured."""
    method: str                 # plain | draft-model | ngram | mtp | hf-generate | hf-assisted | hf-prompt-lookup
    k: int | str = 0            # drafts per step, or "auto"
    widths: tuple[int, ...] | None = None  # a tree's widths per depth (None: a chain)
    dynamic: bool = False                  # the draft model's dynamic trees instead of its static ones
    tokens_per_s: list[float] = field(default_factory=list)
    metrics: list[SpecMetrics] = field(default_factory=list)  # per repeat, summed over batches
    outputs: list[list[int]] = field(default_factory=list)     # the last repeat's tokens per prompt
    host_syncs: dict | None = None  # per step of a counted, untimed generation (syncs.py); None: a peer

    @property
    def label(self) -> str:
        if self.widths:
            return f"{self.method} {'dynamic' if self.dynamic else 'tree'}={','.join(map(str, self.widths))}"
        return self.method if self.k == 0 else f"{self.method} k={self.k}"

    @property
    def window(self) -> int:
        """The most tokens per row one verification carries."""
        if self.k == "auto":
            return 1 + sum(AUTO_TREE)
        return 1 + (sum(self.widths) if self.widths else self.k)


class Bench:
    """The loaded models and proposers, shared by every cell of a run. With skip_misfits, a
    drafter that does not fit the target (missing, another tokenizer, trained for another target)
    is left out of the plan, with the reason in `skipped`; otherwise it is refused."""

    def __init__(self, plan: Plan, target_path=None, paths: dict | None = None, dtype: torch.dtype | None = None,
                 peer_dtype: torch.dtype = PEER_DTYPE, device: str | torch.device | None = None,
                 skip_misfits: bool = False):
        self.target = load(target_path, dtype=dtype, device=device)
        self.device = self.target.admitted.device
        paths = paths or {}
        misfits = {name: DRAFTERS[name].misfit(self.target, paths.get(name)) for name in plan.methods} \
            if skip_misfits else {}
        self.skipped = {name: reason for name, reason in misfits.items() if reason is not None}
        self.plan = dataclasses.replace(plan, methods=tuple(m for m in plan.methods if m not in self.skipped))
        self.networks, self.proposers = {}, {}
        self.method_info = {"plain": {"name": "plain autoregressive decoding"}}
        for name in self.plan.methods:
            self.add(name, DRAFTERS[name].folder(paths.get(name), self.target))
        if "mtp" in self.networks:
            check_mtp_ks(self.plan, self.networks["mtp"].depth)
        self.draft = self.networks.get("draft-model")  # transformers' assisted generation drafts with it too
        self.peers = (Peers(self.target.path, self.draft and self.draft.path, peer_dtype, self.device)
                      if any(c.peer_k for c in plan.cells) else None)
        if self.peers is not None:
            self.method_info.update(self.peers.info())

    def add(self, name: str, folder: Path | None) -> None:
        """The drafter `name` read from `folder` for the target, as its proposer (a draft model also
        with dynamic trees), with what the conditions say about it."""
        drafter = DRAFTERS[name]
        options = drafter.checked(BENCH_OPTIONS.get(name))
        network = self.networks[name] = drafter.network(self.target, folder)
        proposer = self.proposers[name] = drafter.proposer(network, self.target, options)
        if name == "draft-model":
            self.dynamic_draft = drafter.proposer(network, self.target, dataclasses.replace(options, dynamic_tree=True))
        info = {"name": name, **drafter.describe(network, proposer, options)}
        if isinstance(network, DraftCheckpoint):
            info.update(draft=model_info(network.model, folder), **training_budget(network.meta))
        elif folder is not None:
            info.update(path=shown_path(folder), **training_budget(heads_meta(folder)))
        if name == "suffix":
            info["shared_trie"] = "the generations of one repeat of a cell (never a prompt's own earlier output)"
        self.method_info[name] = info

    def configs(self, cell: Cell) -> list[Config]:
        configs = [Config("plain")]
        for method in self.plan.methods:
            depth = self.proposers[method].max_depth  # MTP heads and a block head draft a bounded block
            configs += [Config(method, k) for k in cell.ks if depth is None or k <= depth]
            configs += [Config(method, len(w), w) for w in cell.trees if depth is None or len(w) <= depth]
            configs += [Config(method, len(w), w, dynamic=True) for w in cell.trees if method == "draft-model"]
            configs += [Config(method, "auto")] if cell.auto else []
        if cell.peer_k and cell.batch_size == 1:
            configs += [Config(p, 0 if p == "hf-generate" else cell.peer_k) for p in self.peers.methods]
        return configs

    def forget(self, cfg: Config) -> None:
        """A fresh shared trie for each repeat of a configuration (suffix lookup's, the hybrid's:
        `forget`): it learns from the other prompts' outputs, as a server's would, never from the
        same prompt's earlier repeat (which would be memorising the answer)."""
        proposer = self.proposers.get(cfg.method)
        if hasattr(proposer, "forget"):
            proposer.forget()

    def decode(self, cfg: Config, batch: list[list[int]], sampling: SamplingConfig,
               rule: StopRule) -> tuple[list[list[int]], SpecMetrics | None]:
        generator = sampling.generator(self.device)
        if cfg.method == "plain":
            rows, _ = plain_generate(self.target.model, batch, rule, sampling, generator)
            return [r.tokens for r in rows], None
        if cfg.method in PEERS:
            return self.peers.generate(cfg.method, cfg.k, batch, rule.max_new_tokens, sampling), None
        proposer = self.dynamic_draft if cfg.dynamic else self.proposers[cfg.method]
        rows, metrics = speculative_generate(self.target.model, proposer, batch, rule, sampling, cfg.k, generator,
                                             widths=cfg.widths)
        return [r.tokens for r in rows], metrics


def run_bench(plan: Plan, target_path=None, paths: dict | None = None, dtype: torch.dtype | None = None,
              progress: bool = True, command: list[str] | None = None, peer_dtype: torch.dtype = PEER_DTYPE,
              device: str | torch.device | None = None, skip_misfits: bool = False) -> dict:
    """Run the plan on `device` (default the CPU), each drafter read from paths[its name] (default:
    the shipped one); with skip_misfits, the drafters that do not fit the target are left out, one
    line each saying why (and under "skipped"). `command` (the argv that asked for it) is recorded
    with the result."""
    started = time.perf_counter()
    check_plan(plan)
    with torch.inference_mode():
        bench = Bench(plan, target_path, paths, dtype, peer_dtype, device, skip_misfits)
        for name, reason in bench.skipped.items():
            bar_note(progress, f"skipped {name}: {reason}")
        plan = bench.plan
        cells = [(cell, bench.configs(cell)) for cell in plan.cells]
        total = sum(len(cfgs) * plan.repeats * -(-cell.prompts // cell.batch_size) for cell, cfgs in cells)
        run_conditions = {
            "target": model_info(bench.target.model, bench.target.path),
            # the networks the drafters read, by drafter (DRAFTERS[name].condition says them)
            "drafters": {name: info for name, info in bench.method_info.items() if name in DRAFTERS},
            "hardware": hardware(bench.device), "backend": bench.target.admitted.abilities.backend,
            # the CPU's roofs (its kernels' FMA peak, its memory bandwidth) where the models run on it
            "roofline": roofline(measured_read_bandwidth() / 1e9) if bench.device.type == "cpu" else "not measured: "
                        "the models run on the GPU (see hardware.device_used)",
            "software": software(), "repeats": plan.repeats,
            "baseline": "specdec plain decoding of the same target weights and dtype, same prompts, batch "
                        "and sampling settings, same run (repeats interleaved)",
        }
        with tqdm(total=total, desc="specdec bench", unit="gen", disable=not progress, file=sys.stderr) as bar:
            out_cells = [run_cell(bench, cell, cfgs, run_conditions, bar) for cell, cfgs in cells]
        moe = None
        if plan.moe is not None:
            bar_note(progress, "MoE vs dense verify cost")
            moe = moe_vs_dense(plan.moe, [1, 2, 3, 4, 5, 8, 16], device=bench.device)
    return {"schema": SCHEMA, "command": command or UNKNOWN, "plan": dataclasses.asdict(plan),
            "skipped": {name: shown_text(reason) for name, reason in bench.skipped.items()},
            "seconds": time.perf_counter() - started,
            "conditions": run_conditions, "cells": out_cells, "moe": moe, "batch_effect": batch_effect(out_cells)}


def heads_meta(path) -> dict:
    """A heads folder's heads.json (MTP or EAGLE), {} where it cannot be read."""
    try:
        return json.loads((Path(path) / "heads.json").read_text())
    except (OSError, ValueError):
        return {}


def training_budget(meta: dict) -> dict:
    """What a drafter cost to train, from its metadata: training tokens and seconds ("unknown"
    where not recorded), for the equal-budget comparison of drafters."""
    return {"training_tokens": meta.get("tokens_seen", UNKNOWN), "training_seconds": meta.get("training_seconds", UNKNOWN)}


def bar_note(progress: bool, text: str) -> None:
    if progress:
        print(f"specdec bench: {text}", file=sys.stderr)


def warm_up_and_count_syncs(bench: Bench, cell: Cell, configs: list[Config], batch: list[list[int]],
                            sampling: SamplingConfig, rule: StopRule, bar) -> float:
    """One untimed generation of `batch` by every configuration (the warm-up), then, for specdec's
    own, one more whose host syncs are counted (cfg.host_syncs); returns the warm-up's seconds, what
    one repeat of a batch costs."""
    seconds = 0.0
    for cfg in configs:
        bar.set_description(f"warm-up: {cell.label}, {cfg.label}")
        t0 = time.perf_counter()
        bench.decode(cfg, batch, sampling, rule)
        seconds += time.perf_counter() - t0
        if cfg.method not in PEERS:
            bench.forget(cfg)
            with count_host_syncs() as syncs:
                _, m = bench.decode(cfg, batch, sampling, rule)
            cfg.host_syncs = syncs.per(m.steps if m is not None else bench.plan.max_new_tokens)
    return seconds


def run_cell(bench: Bench, cell: Cell, configs: list[Config], run_conditions: dict, bar) -> dict:
    plan = bench.plan
    wl = workload(cell.workload, cell.prompts)
    prompts = encode_prompts(bench.target, wl.prompts, plan.max_new_tokens, chat=wl.chat)
    batches = [prompts[i:i + cell.batch_size] for i in range(0, len(prompts), cell.batch_size)]
    sampling = SamplingConfig(cell.temperature, seed=plan.seed)
    rule = StopRule(plan.max_new_tokens)  # EOS ignored: every configuration emits exactly max_new_tokens
    warm_up = warm_up_and_count_syncs(bench, cell, configs, batches[0], sampling, rule, bar)
    if not bar.disable:  # the expected time, measured on this machine
        bar.write(f"specdec bench: {cell.label}: about {warm_up * plan.repeats * len(batches):.0f} s more here (its "
                  f"warm-up, {warm_up:.1f} s, x {plan.repeats} repeats x {len(batches)} batches)", file=sys.stderr)
    for _ in range(plan.repeats):
        for cfg in configs:
            bar.set_description(f"{cell.label}, {cfg.label}")
            bench.forget(cfg)
            t0, produced, outputs, metrics = time.perf_counter(), 0, [], []
            for batch in batches:
                tokens, m = bench.decode(cfg, batch, sampling, rule)
                outputs += tokens
                produced += sum(map(len, tokens))
                metrics += [m] if m is not None else []
                bar.update(1)
            cfg.tokens_per_s.append(produced / (time.perf_counter() - t0))
            cfg.outputs = outputs
            if metrics:
                summed = sum(metrics[1:], metrics[0])
                summed.adaptive = merge_summaries([m.adaptive for m in metrics])
                cfg.metrics.append(summed)
    unseeded = unseeded_acceptance(bench, configs, batches, cell.temperature, rule) if cell.temperature > 0 else {}
    window = max(cfg.window for cfg in configs if cfg.method not in PEERS)
    curve_tokens = sorted(set(range(1, window + 1)) | ({CURVE_EXTRA_TOKENS} if cell.batch_size == 1 else set()))
    bar.set_description(f"verify-cost curve, batch {cell.batch_size}")
    # at the cell's typical context: its median prompt plus half the new tokens (attention grows with it)
    context = int(statistics.median(map(len, prompts))) + plan.max_new_tokens // 2
    curve = measure_verify_curve(bench.target.admitted, curve_tokens, cell.batch_size, context_tokens=context)
    implausible = implausible_verify_points(curve.seconds)
    workload_info = {"name": wl.name, "description": wl.description, "prompts": len(prompts),
                     "prompt_tokens": spread([len(p) for p in prompts]), "max_new_tokens": plan.max_new_tokens,
                     "eos": "ignored (exactly max_new_tokens per prompt)"}
    sampling_info = {"temperature": cell.temperature, "top_k": None, "top_p": None, "seed": plan.seed}
    cell_conditions = {"workload": workload_info, "sampling": sampling_info, "batch_size": cell.batch_size}
    plain = configs[0]
    hf_generate = next((c for c in configs if c.method == "hf-generate"), None)
    results = []
    for cfg in configs:
        # transformers' speculative peers must reproduce transformers' own plain decoding
        reference = hf_generate if cfg.method in PEERS and cfg is not hf_generate else plain
        method = {**bench.method_info[cfg.method], **({"k": cfg.k} if cfg.k else {}),
                  **({"tree_widths": list(cfg.widths), "tree": "dynamic" if cfg.dynamic else "static"}
                     if cfg.widths else {})}
        speedup = spread([a / b for a, b in zip(cfg.tokens_per_s, plain.tokens_per_s)])
        rule = acceptance_rule(cfg.method, cell.temperature)
        prediction = acceptance_and_prediction(cfg, curve, cell.batch_size, speedup["median"])
        results.append({
            "method": cfg.method, "k": cfg.k, "widths": list(cfg.widths) if cfg.widths else None,
            "tree": ("dynamic" if cfg.dynamic else "static") if cfg.widths else None,
            "label": cfg.label, "acceptance": rule, "host_syncs_per_step": cfg.host_syncs,
            "adaptive": cfg.metrics[-1].adaptive if cfg.metrics else None,
            "lossless_method": rule["lossless"],
            "tokens_per_s": spread(cfg.tokens_per_s), "speedup": speedup, **prediction,
            "noise": result_noise(spread(cfg.tokens_per_s), speedup, bool(implausible),
                                  prediction["predicted_speedup"] is not None),
            "lossless": lossless(cfg, reference, cell.temperature),
            "unseeded_acceptance": unseeded.get(cfg.label),
            "conditions": {**{k: run_conditions[k] for k in ("target", "hardware", "software", "repeats", "baseline")},
                           "method": method, **cell_conditions},
        })
    return {**cell_conditions, "ks": list(cell.ks),
            "verify_curve": {"batch_size": cell.batch_size, "context_tokens": context, "tokens": curve_tokens,
                             "seconds": [curve.seconds[n] for n in curve_tokens],
                             "implausible": [[n, ratio] for n, ratio in implausible]},
            "noisy": bool(implausible) or any(r["noise"] for r in results),
            "results": results}


def unseeded_acceptance(bench: Bench, configs: list[Config], batches: list[list[list[int]]], temperature: float,
                        rule: StopRule) -> dict[str, dict]:
    """By label, for each method's first fixed-k chain: α of one untimed generation of the cell's
    prompts without a seed (rejection sampling, drafts drawn from a generator) beside its seeded
    repeats' α (drafts drawn with the verifier's Gumbel noise, sampling.Draws): the two must agree
    (docs/design.md, "Randomness"). The standard error treats every proposed draft as an independent
    trial (drafts of one step are not quite: it is a little small)."""
    out, seen = {}, set()
    for cfg in configs:
        if cfg.method in PEERS or cfg.method == "plain" or cfg.k == "auto" or cfg.widths or cfg.method in seen:
            continue
        seen.add(cfg.method)
        bench.forget(cfg)
        generator = SamplingConfig(temperature, seed=bench.plan.seed).generator(bench.device)  # reproducible
        proposed = accepted = 0
        for batch in batches:
            _, m = speculative_generate(bench.target.model, bench.proposers[cfg.method], batch, rule,
                                        SamplingConfig(temperature), cfg.k, generator)
            proposed, accepted = proposed + m.proposed, accepted + m.accepted
        out[cfg.label] = acceptance_agreement(cfg.metrics[-1].accepted, cfg.metrics[-1].proposed, accepted, proposed)
    return out


def acceptance_agreement(seeded_accepted: int, seeded_proposed: int, accepted: int, proposed: int) -> dict:
    """The unseeded α against the seeded one: their difference, its standard error (pooled
    binomial) and whether it is within SEED_AGREEMENT of them."""
    if not proposed or not seeded_proposed:
        return {"acceptance_rate": None, "proposed": proposed, "accepted": accepted, "difference": None,
                "standard_error": None, "agree": None}
    pooled = (seeded_accepted + accepted) / (seeded_proposed + proposed)
    error = (pooled * (1 - pooled) * (1 / seeded_proposed + 1 / proposed)) ** 0.5
    difference = seeded_accepted / seeded_proposed - accepted / proposed
    return {"acceptance_rate": accepted / proposed, "proposed": proposed, "accepted": accepted,
            "difference": difference, "standard_error": error, "agree": abs(difference) <= SEED_AGREEMENT * error}


LOSSLESS_RULES = (greedy_accept, rejection_sample)  # verify.py: the rules of docs/design.md's "The lossless contract"


def acceptance_rule(method: str, temperature: float) -> dict:
    """How a configuration accepts drafts, and whether that rule is lossless: specdec's engine
    uses verify.greedy_accept when greedy and verify.rejection_sample when sampling."""
    if method in ("plain", "hf-generate"):
        return {"rule": "none: no drafts, the target decodes alone", "lossless": True}
    if method in PEERS:
        return {"rule": "transformers' candidate verification (its greedy match or speculative sampling, "
                        "lossless as transformers documents it)", "lossless": True}
    rule = greedy_accept if temperature == 0 else rejection_sample
    return {"rule": f"specdec.decoding.verify.{rule.__name__}", "lossless": rule in LOSSLESS_RULES}


def acceptance_and_prediction(cfg: Config, curve, batch_size: int, measured: float) -> dict:
    """α, α_i, τ, c of the last repeat (the counters are the same every repeat: same prompts and
    seed), the per-step seconds (medians over repeats) and the cost model's prediction, its error
    against the measured median speedup, S_limit and efficiency."""
    if not cfg.metrics:
        return dict.fromkeys(("acceptance_rate", "acceptance_per_position", "mean_acceptance_length",
                              "draft_cost_ratio", "seconds_per_step", "counters", "predicted_speedup",
                              "prediction_error", "speedup_limit", "efficiency"))
    last = cfg.metrics[-1]
    last.target_token_seconds = curve.at(1)
    per_step = {part: statistics.median(sum(getattr(m, f"{name}_seconds") for name in names) / m.steps
                                        for m in cfg.metrics)
                for part, names in (("draft", ["draft"]), ("verify", ["verify"]),
                                    # the bookkeeping beyond the forwards (the curve costs the forward alone)
                                    ("other", ["acceptance", "commit", "metrics", "other"]))}
    # the speedup is measured on whole generations: their prefill (target and proposer start) counts
    prefill = statistics.median(m.prefill_seconds / m.emitted for m in cfg.metrics)
    predicted = predicted_speedup(last.acceptance_per_position, per_step["draft"], curve, per_step["other"],
                                  batch_size, last.proposal_rate_per_position, last.proposed / last.row_steps,
                                  prefill)
    limit = speedup_limit(last.mean_acceptance_length, 0, curve, last.proposed / last.row_steps)
    return {"acceptance_rate": last.acceptance_rate, "acceptance_per_position": last.acceptance_per_position,
            "mean_acceptance_length": last.mean_acceptance_length, "draft_cost_ratio": last.draft_cost_ratio,
            "seconds_per_step": per_step, "counters": last.to_dict(), "predicted_speedup": predicted,
            "prediction_error": predicted / measured - 1, "speedup_limit": limit, "efficiency": measured / limit}


def lossless(cfg: Config, reference: Config, temperature: float) -> dict:
    if temperature > 0:
        return {"checked": False, "reason": "sampling: lossless in distribution, not token by token (tested "
                                            "statistically in tests/decoding/test_engine_sampling.py)"}
    mismatches = [{"prompt": i, "first_difference": first_difference(a, b)}
                  for i, (a, b) in enumerate(zip(cfg.outputs, reference.outputs)) if a != b]
    return {"checked": True, "reference": reference.label, "prompts": len(reference.outputs),
            "identical": len(reference.outputs) - len(mismatches), "mismatches": mismatches}


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def batch_effect(cells: list[dict]) -> list[dict]:
    """For every (workload and its prompts, temperature, method configuration) measured at several
    batch sizes: the median speedup per batch size and the smallest batch size at which it is
    below 1 (null: it pays at every batch size measured)."""
    groups: dict[tuple, dict[int, float]] = {}
    for cell in cells:
        w = cell["workload"]
        for r in cell["results"]:
            if r["method"] in SPEC_METHODS:
                key = (w["name"], w["prompts"], cell["sampling"]["temperature"], r["method"], r["k"], r["label"])
                groups.setdefault(key, {})[cell["batch_size"]] = r["speedup"]["median"]
    return [{"workload": w, "prompts": n, "temperature": t, "method": m, "k": k, "label": label,
             "speedup_by_batch": dict(sorted(by_b.items())),
             "stops_paying_at": next((b for b in sorted(by_b) if by_b[b] < 1), None)}
            for (w, n, t, m, k, label), by_b in groups.items() if len(by_b) > 1]
