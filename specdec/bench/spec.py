"""Speculative decoding vs plain decoding and the transformers peers, in one run.

Every configuration (method, k) decodes the same HumanEval prompts with the same target weights;
repeats are interleaved (repeat r runs every configuration before repeat r + 1 starts), and the
median of the repeats is reported with min and max. Greedy runs also check losslessness: each
method's tokens against plain decoding's, printed per method, mismatches never hidden.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from ..api import encode_prompts, load, load_draft_model
from ..decode import plain_generate
from ..engine import speculative_generate
from ..proposers import build_proposer
from ..sampling import SamplingConfig
from ..stopping import StopRule
from .conditions import hardware, model_info, software
from .plain import spread
from .workloads import humaneval_prompts


@dataclass
class Config:
    method: str            # plain | draft-model | ngram | hf-generate | hf-assisted | hf-prompt-lookup
    k: int = 0
    tokens_per_s: list[float] = field(default_factory=list)
    counters: dict = field(default_factory=dict)
    outputs: list[list[int]] = field(default_factory=list)

    @property
    def label(self) -> str:
        return self.method if self.k == 0 else f"{self.method} k={self.k}"


@torch.inference_mode()
def bench_spec(target_path=None, draft_path=None, n_prompts: int = 20, repeats: int = 3, max_new_tokens: int = 128,
               ks: tuple[int, ...] = (1, 2, 4, 8), methods: tuple[str, ...] = ("draft-model", "ngram"),
               peers: bool = True, temperature: float = 0.0, batch_size: int = 1, seed: int = 0,
               dtype: torch.dtype | None = None) -> dict:
    target = load(target_path, dtype=dtype)
    draft = load_draft_model(target, draft_path)
    if dtype is not None:
        draft.model.to(dtype)
    sampling = SamplingConfig(temperature, seed=seed)
    rule = StopRule(max_new_tokens)  # EOS ignored: every configuration emits exactly max_new_tokens
    prompts = encode_prompts(target, humaneval_prompts(n_prompts), max_new_tokens)
    batches = [prompts[i:i + batch_size] for i in range(0, len(prompts), batch_size)]
    proposers = {"draft-model": build_proposer("draft-model", model=draft.model),
                 "ngram": build_proposer("ngram", max_n=3, min_n=1)}
    configs = [Config("plain")] + [Config(m, k) for m in methods for k in ks]
    hf = hf_draft = None
    if peers and batch_size == 1:
        import transformers
        weights_dtype = target.model.lm_head.weight.dtype
        hf = transformers.AutoModelForCausalLM.from_pretrained(target.path, dtype=weights_dtype).eval()
        hf_draft = transformers.AutoModelForCausalLM.from_pretrained(draft.path, dtype=weights_dtype).eval()
        for m in (hf, hf_draft):
            m.generation_config.eos_token_id = None
            m.generation_config.pad_token_id = 0
        configs += [Config("hf-generate"), Config("hf-assisted", max(ks)), Config("hf-prompt-lookup", max(ks))]

    def run(cfg: Config, batch: list[list[int]]) -> tuple[list[list[int]], dict]:
        gen = sampling.generator()
        if cfg.method == "plain":
            rows, _ = plain_generate(target.model, batch, rule, sampling, gen)
            return [r.tokens for r in rows], {}
        if cfg.method.startswith("hf-"):
            ids = torch.tensor(batch)
            kw = dict(max_new_tokens=max_new_tokens, do_sample=temperature > 0)
            if temperature > 0:
                kw["temperature"] = temperature
                torch.manual_seed(seed)
            if cfg.method == "hf-assisted":
                kw.update(assistant_model=hf_draft, num_assistant_tokens=cfg.k,
                          num_assistant_tokens_schedule="constant")
            elif cfg.method == "hf-prompt-lookup":
                kw.update(prompt_lookup_num_tokens=cfg.k)
            return [hf.generate(ids, **kw)[0, len(batch[0]):].tolist()], {}
        rows, metrics = speculative_generate(target.model, proposers[cfg.method], batch, rule, sampling, cfg.k, gen)
        return [r.tokens for r in rows], metrics.to_dict()

    for cfg in configs:  # warm-up, not timed
        run(cfg, batches[0])
    with tqdm(total=repeats * len(configs) * len(batches), desc="speculative bench", unit="gen") as bar:
        for _ in range(repeats):
            for cfg in configs:
                t0, produced, outputs, totals = time.perf_counter(), 0, [], {}
                for batch in batches:
                    toks, counters = run(cfg, batch)
                    outputs += toks
                    produced += sum(map(len, toks))
                    for key in ("steps", "proposed", "accepted", "emitted", "draft_seconds", "verify_seconds"):
                        totals[key] = totals.get(key, 0) + counters.get(key, 0)
                    for key in ("accepted_per_position", "reached_per_position"):
                        if key in counters:
                            totals[key] = [a + b for a, b in zip(totals.get(key, [0] * cfg.k), counters[key])]
                    bar.update(1)
                cfg.tokens_per_s.append(produced / (time.perf_counter() - t0))
                cfg.counters, cfg.outputs = totals, outputs
    plain = configs[0]
    base = spread(plain.tokens_per_s)["median"]
    results = []
    for cfg in configs:
        c = cfg.counters
        speed = spread(cfg.tokens_per_s)
        same = sum(a == b for a, b in zip(cfg.outputs, plain.outputs))
        results.append({
            "method": cfg.method, "k": cfg.k, "tokens_per_s": speed, "speedup_vs_plain": speed["median"] / base,
            "acceptance_rate": c["accepted"] / c["proposed"] if c.get("proposed") else None,
            "mean_acceptance_length": c["emitted"] / c["steps"] if c.get("steps") else None,
            "acceptance_per_position": [a / r if r else None for a, r in
                                        zip(c.get("accepted_per_position", []), c.get("reached_per_position", []))],
            "draft_seconds": c.get("draft_seconds"), "verify_seconds": c.get("verify_seconds"),
            "identical_to_plain": f"{same}/{len(plain.outputs)}" if temperature == 0 else "n/a (sampling)",
        })
    return {"results": results, "conditions": {
        "target": model_info(target.model, target.path), "draft": model_info(draft.model, draft.path),
        "workload": {"dataset": "HumanEval", "prompts": len(prompts), "prompt_tokens": [len(p) for p in prompts],
                     "max_new_tokens": max_new_tokens, "eos": "ignored (exactly max_new_tokens per prompt)"},
        "sampling": {"temperature": temperature, "top_k": None, "top_p": None, "seed": seed},
        "batch_size": batch_size, "repeats": repeats, "ngram": {"max_n": 3, "min_n": 1},
        "hardware": hardware(), "software": software(),
        "baseline": "specdec plain decoding, same target weights and dtype, same run",
    }}


def format_spec(r: dict) -> str:
    c = r["conditions"]
    lines = ["| method | k | tokens/s median (min-max) | speedup vs plain | α | τ | identical to plain |",
             "|---|---|---|---|---|---|---|"]
    for x in r["results"]:
        t = x["tokens_per_s"]
        alpha = f"{x['acceptance_rate']:.2f}" if x["acceptance_rate"] is not None else "-"
        tau = f"{x['mean_acceptance_length']:.2f}" if x["mean_acceptance_length"] is not None else "-"
        lines.append(f"| {x['method']} | {x['k'] or '-'} | {t['median']:.1f} ({t['min']:.1f}-{t['max']:.1f}) | "
                     f"{x['speedup_vs_plain']:.2f}x | {alpha} | {tau} | {x['identical_to_plain']} |")
    lines.append(
        f"\nconditions: target {c['target']['name']} ({c['target']['parameters'] / 1e6:.1f}M, {c['target']['dtype']}, "
        f"sha256 {c['target']['checkpoint_sha256'][:12]}), draft {c['draft']['name']} "
        f"({c['draft']['parameters'] / 1e6:.1f}M), HumanEval {c['workload']['prompts']} prompts, "
        f"{c['workload']['max_new_tokens']} new tokens, temperature {c['sampling']['temperature']}, "
        f"batch {c['batch_size']}, {c['repeats']} interleaved repeats, {c['hardware']['cpu']} "
        f"({c['hardware']['cores']} cores, {c['hardware']['threads']} threads), torch {c['software']['torch']}, "
        f"transformers {c['software']['transformers']}, specdec {c['software']['git']}")
    return "\n".join(lines)


def save(r: dict, path: str | Path) -> None:
    import json
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(r, indent=1))
