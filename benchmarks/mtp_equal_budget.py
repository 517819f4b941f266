"""Equal-budget MTP experiment: one small Llama trained on a slice of the standard library three
times from the same seed, on the same batches for the same steps: next-token only, next-token +
parallel heads (Gloeckle et al.), next-token + sequential modules (DeepSeek-V3). Reports each
run's next-token validation loss, the heads' acceptance as drafts through the engine (greedy and
sampled, alpha_i and tau), and the training step time and peak memory of each objective and of
the naive vs memory-saving loss order.

    nice -n 10 .venv/bin/python benchmarks/mtp_equal_budget.py --out runs/mtp-experiment

writes docs/evidence/mtp-experiment.json and docs/evidence/mtp-experiment.png (the runs go to --out and resume);
with --shipped, measures the shipped heads instead (docs/evidence/mtp-target-heads.json). Smaller
runs: --steps, --batch-size, --eval-windows, --test-windows, --corpus, --prompts, --max-new-tokens, --step-time
small|one, --evidence DIR (where the JSON and the plot go).
Memory is the peak resident set size (VmHWM, reset just before the first step) of a fresh
subprocess running 3 optimizer steps, minus its resident size before the first step.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import sysconfig
import time
from dataclasses import asdict
from pathlib import Path

import torch

from specdec.bench.conditions import hardware, software
from specdec.bench.workloads import humaneval_prompts
from specdec.decoding.engine import speculative_generate
from specdec.decoding.sampling import SamplingConfig
from specdec.decoding.stopping import StopRule
from specdec.lm.arch import Arch
from specdec.lm.checkpoint import load_model, read_meta
from specdec.lm.tokenizer import EOS_ID, Tokenizer
from specdec.proposers import DraftModelProposer, MTPProposer
from specdec.heads.mtp import load_mtp
from specdec.train.config import TrainConfig
from specdec.train.loop import build, train
from specdec.train.losses import mtp_backward, next_token_loss
from specdec.train.objectives import MTP
from specdec.train.presets import PRESETS

ROOT = Path(__file__).resolve().parents[1]
EVIDENCE = ROOT / "docs" / "evidence"
STDLIB = Path(sysconfig.get_paths()["stdlib"])
CORPUS = [str(STDLIB / name) for name in ("json", "email", "logging", "asyncio", "collections", "importlib",
                                          "concurrent", "http", "xml")]
MODEL = Arch(vocab_size=2048, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256)
DEPTH = 2
COMMON = dict(model=MODEL, corpus=CORPUS, seq_len=128, batch_size=16, micro_batch=16, steps=300, lr=3e-3,
              warmup=30, eval_every=50, eval_windows=64, save_every=50, seed=0)
RUNS = {
    "next-token": {},
    # Gloeckle et al.: the plain sum of the n = depth + 1 cross-entropies
    "mtp-parallel": dict(objective=MTP(kind="parallel", depth=DEPTH)),
    # DeepSeek-V3: lambda / depth per module, lambda 0.3 then 0.1
    "mtp-sequential": dict(objective=MTP(kind="sequential", depth=DEPTH, lam=0.3 / DEPTH, lam_late=0.1 / DEPTH,
                                         lam_switch=0.7)),
}
PROMPTS, MAX_NEW = 8, 64


def run_config(out: Path, name: str) -> TrainConfig:
    tokenizer = out / "next-token" / "work" / "tokenizer.json"  # every run shares the first run's tokenizer
    return TrainConfig(out=str(out / name), tokenizer=str(tokenizer) if name != "next-token" else None,
                       **COMMON, **RUNS[name])


class GreedyDrafts:
    """The heads drafting their argmax whatever the temperature (as vLLM drafts MTP): still
    lossless (one-hot draft_probs), shown only to compare acceptance with sampled drafts."""

    def __init__(self, inner):
        self.inner, self.name, self.vocab_size = inner, inner.name + "-greedy-drafts", inner.vocab_size

    def __getattr__(self, name):  # what the engine asks of a proposer beyond the protocol: the inner one's
        return getattr(self.inner, name)

    def start(self, max_len, k, capacity, nodes=None):
        return self.inner.start(max_len, k, capacity, nodes)

    def join(self, state, prompts, prompt_hidden, samplings):
        self.inner.join(state, prompts, prompt_hidden, [SamplingConfig()] * len(prompts))

    def leave(self, state, keep):
        self.inner.leave(state, keep)

    def propose(self, state, limits, widths, draws):
        return self.inner.propose(state, limits, widths, draws)

    def observe(self, state, outcome):
        self.inner.observe(state, outcome)


def acceptance(out: Path, name: str) -> dict:
    model_dir = out / name / "model"
    target = load_model(model_dir, dtype=torch.float32)
    heads = load_mtp(out / name / "heads", model_dir, dtype=torch.float32)
    tok = Tokenizer.load(model_dir)
    context = MODEL.max_position_embeddings - MAX_NEW
    prompts = [([EOS_ID] + tok.encode(p))[-context:] for p in humaneval_prompts(PROMPTS)]
    result = {"prompts": f"HumanEval 0..{PROMPTS - 1}, last {context} tokens", "max_new_tokens": MAX_NEW,
              "batch_size": len(prompts)}
    for label, sampling, wrap in (("greedy", SamplingConfig(), None),
                                  ("T=1, drafts sampled from the heads", SamplingConfig(1.0), None),
                                  ("T=1, greedy drafts", SamplingConfig(1.0), GreedyDrafts)):
        for k in range(1, DEPTH + 1):
            proposer = MTPProposer(heads=heads, target=target)
            _, m = speculative_generate(target, wrap(proposer) if wrap else proposer, prompts, StopRule(MAX_NEW),
                                        sampling, k, torch.Generator().manual_seed(k))
            result[f"{label}, k={k}"] = {"alpha": m.acceptance_rate, "alpha_i": m.acceptance_per_position,
                                         "tau": m.mean_acceptance_length, "steps": m.row_steps, "emitted": m.emitted}
    return result


# ---- step time and peak memory, each in a fresh process ----

MEASURE = {
    # name: (train config overrides, memory-saving order)
    "next-token": ({}, True),
    "mtp-parallel, naive order": (RUNS["mtp-parallel"], False),
    "mtp-parallel, memory-saving order": (RUNS["mtp-parallel"], True),
    "mtp-sequential, naive order": (RUNS["mtp-sequential"], False),
    "mtp-sequential, memory-saving order": (RUNS["mtp-sequential"], True),
}
# the shipped heads' setting: the target's size, frozen trunk, 3 sequential modules
TARGET_SIZE = dict(model=PRESETS["target"]["model"], seq_len=512, batch_size=8, micro_batch=8)
MEASURE_TARGET = {
    "target size, frozen trunk, mtp-sequential depth 3, naive order": False,
    "target size, frozen trunk, mtp-sequential depth 3, memory-saving order": True,
}


def measure(name: str) -> dict:
    """One process: build, then 3 optimizer steps on random windows; time the last two."""
    if name in MEASURE:
        overrides, saving = MEASURE[name]
        if "objective" in overrides:
            overrides = {**overrides, "objective": dataclasses.replace(overrides["objective"], memory_saving=saving)}
        cfg = TrainConfig(out="unused", **{**COMMON, **overrides})
        train_trunk = True
    else:
        cfg = TrainConfig(out="unused", **TARGET_SIZE,
                          objective=MTP(kind="sequential", depth=3, memory_saving=MEASURE_TARGET[name]))
        train_trunk = False
    model, heads = build(cfg)
    model.requires_grad_(train_trunk)
    params = [p for p in [*model.parameters(), *(heads.parameters() if heads else ())] if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, cfg.model.vocab_size, (cfg.batch_size, cfg.seq_len + 1), generator=g) for _ in range(3)]
    Path("/proc/self/clear_refs").write_text("5")  # peak RSS := current RSS (ru_maxrss keeps the parent's)
    before = _status_mb("VmRSS")
    times = []
    for batch in batches:
        t0 = time.perf_counter()
        if heads is None:
            next_token_loss(model, batch).backward()
        else:
            mtp_backward(model, heads, batch, cfg.loss_weights().at(0, cfg.steps), 1.0, train_trunk,
                         cfg.mtp_memory_saving)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    peak = _status_mb("VmHWM")
    return {"step_seconds": sum(times[1:]) / 2, "peak_rss_mb": peak, "step_peak_mb": peak - before,
            "tokens_per_step": cfg.batch_size * cfg.seq_len, "trainable_parameters": sum(p.numel() for p in params)}


def _status_mb(field: str) -> float:
    """A memory figure of this process from /proc/self/status (VmRSS: now, VmHWM: peak), in MB."""
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(field + ":"))
    return int(line.split()[1]) / 1024


def measure_all(names) -> dict:
    out = {}
    for name in names:
        proc = subprocess.run([sys.executable, __file__, "--measure", name, "--batch-size", str(COMMON["batch_size"])],
                              capture_output=True, text=True, check=True)
        out[name] = json.loads(proc.stdout.strip().splitlines()[-1])
        print(name, out[name], flush=True)
    return out


def plot(out: Path, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name in RUNS:
        history = read_meta(out / name / "model")["history"]
        s, l = zip(*history["valid"])
        axes[0].plot(s, l, marker="o", label=name)
        for j, per_head in enumerate(zip(*[h for _, h in history.get("valid_heads", [])])):
            axes[1].plot(s, per_head, marker=".", label=f"{name}, head {j + 1} (t+{j + 2})")
    axes[0].set(xlabel="step", ylabel="next-token validation loss (nats)", title="same model, tokens and steps")
    axes[1].set(xlabel="step", ylabel="validation loss (nats)", title="MTP heads")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def shipped() -> dict:
    """The shipped heads (models/target-mtp) on the shipped target, as stored (bf16): training
    summary and acceptance on HumanEval prompts, next to the shipped draft model's."""
    models = ROOT / "models"
    target = load_model(models / "target")
    heads = load_mtp(models / "target-mtp", models / "target")
    tok = Tokenizer.load(models / "target")
    prompts = [[EOS_ID] + tok.encode(p) for p in humaneval_prompts(PROMPTS)]
    meta = json.loads((models / "target-mtp" / "heads.json").read_text())
    result = {
        "recipe": "specdec train --preset target-mtp --out runs/target-mtp (then copy runs/target-mtp/heads "
                  "to models/target-mtp)",
        "settings": meta["recipe"], "kind": meta["kind"], "depth": meta["depth"],
        "head_parameters": meta["parameters"], "target_sha256": meta["target_sha256"],
        "tokens_seen": meta["tokens_seen"], "training_seconds_wall": meta["training_seconds"],
        "valid_next_token_loss_of_the_target": meta["final_valid_loss"],
        "valid_head_losses": meta["final_valid_head_losses"], "test_head_losses": meta["test_head_losses"],
        "acceptance": {"prompts": f"HumanEval 0..{PROMPTS - 1}", "max_new_tokens": MAX_NEW,
                       "batch_size": len(prompts), "dtype": "bfloat16"},
    }
    draft = DraftModelProposer(model=load_model(models / "draft"))
    mtp = MTPProposer(heads=heads, target=target)
    for label, proposer, sampling, k in [("mtp greedy", mtp, SamplingConfig(), 1), ("mtp greedy", mtp, SamplingConfig(), 2),
                                         ("mtp greedy", mtp, SamplingConfig(), 3),
                                         ("mtp T=1, sampled drafts", mtp, SamplingConfig(1.0), 3),
                                         ("mtp T=1, greedy drafts", GreedyDrafts(mtp), SamplingConfig(1.0), 3),
                                         ("draft model greedy", draft, SamplingConfig(), 3)]:
        _, m = speculative_generate(target, proposer, prompts, StopRule(MAX_NEW), sampling, k,
                                    torch.Generator().manual_seed(0))
        result["acceptance"][f"{label}, k={k}"] = {
            "alpha": m.acceptance_rate, "alpha_i": m.acceptance_per_position, "tau": m.mean_acceptance_length,
            "draft_seconds_per_forward": m.draft_seconds / m.steps,
            "verify_seconds_per_forward": m.verify_seconds / m.steps}
        print(label, k, result["acceptance"][f"{label}, k={k}"], flush=True)
    return result


def main() -> None:
    global PROMPTS, MAX_NEW, EVIDENCE, CORPUS  # the smaller runs' options replace the experiment's settings
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", default="runs/mtp-experiment")
    p.add_argument("--measure", help=argparse.SUPPRESS)
    p.add_argument("--shipped", action="store_true",
                   help="only measure the shipped heads (docs/evidence/mtp-target-heads.json)")
    p.add_argument("--steps", type=int, default=COMMON["steps"], help="optimizer steps of each run")
    p.add_argument("--batch-size", type=int, default=COMMON["batch_size"], help="windows per step")
    p.add_argument("--eval-windows", type=int, default=COMMON["eval_windows"], help="validation windows")
    p.add_argument("--test-windows", type=int, default=TrainConfig.test_windows, help="held-out test windows")
    p.add_argument("--corpus", nargs="+", help="files or folders to train on (default: CORPUS, in the stdlib)")
    p.add_argument("--prompts", type=int, default=PROMPTS, help="HumanEval prompts the heads draft on")
    p.add_argument("--max-new-tokens", type=int, default=MAX_NEW)
    p.add_argument("--step-time", choices=["all", "small", "one"], default="all", help="the step time and memory "
                   "measurements: all, those of the experiment's model size only, or its next-token one only")
    p.add_argument("--evidence", default=str(EVIDENCE), help="where the JSON and the plot are written")
    args = p.parse_args()
    PROMPTS, MAX_NEW, EVIDENCE = args.prompts, args.max_new_tokens, Path(args.evidence)
    CORPUS = args.corpus or CORPUS
    COMMON.update(corpus=CORPUS, steps=args.steps, eval_every=min(COMMON["eval_every"], args.steps),
                  save_every=min(COMMON["save_every"], args.steps),
                  warmup=min(COMMON["warmup"], max(1, args.steps // 2)), batch_size=args.batch_size,
                  micro_batch=args.batch_size, eval_windows=args.eval_windows, test_windows=args.test_windows)
    EVIDENCE.mkdir(parents=True, exist_ok=True)
    if args.measure:
        print(json.dumps(measure(args.measure)))
        return
    if args.shipped:
        result = {**shipped(), "hardware": hardware(), "software": software(),
                  "command": ".venv/bin/python benchmarks/mtp_equal_budget.py --shipped"}
        (EVIDENCE / "mtp-target-heads.json").write_text(json.dumps(result, indent=1) + "\n")
        return
    out = Path(args.out)
    runs = {}
    for name in RUNS:
        cfg = run_config(out, name)
        model_dir = train(cfg) or sys.exit("interrupted")
        meta = read_meta(model_dir)
        runs[name] = {"config": {k: v for k, v in asdict(cfg).items() if k != "corpus"},
                      "parameters": meta["parameters"], "tokens_seen": meta["tokens_seen"],
                      "training_seconds": meta["training_seconds"],
                      "valid_next_token_loss": meta["final_valid_loss"],
                      "valid_next_token_curve": meta["history"]["valid"]}
        if name != "next-token":
            heads_meta = json.loads((out / name / "heads" / "heads.json").read_text())
            runs[name]["head_parameters"] = heads_meta["parameters"]
            runs[name]["valid_head_losses"] = heads_meta["final_valid_head_losses"]
            runs[name]["acceptance"] = acceptance(out, name)
        print(name, {k: v for k, v in runs[name].items() if k not in ("config", "valid_next_token_curve")},
              flush=True)
    result = {
        "command": f"nice -n 10 .venv/bin/python benchmarks/mtp_equal_budget.py --out {args.out}",
        "corpus": {"sources": [str(Path(c).relative_to(STDLIB)) if Path(c).is_relative_to(STDLIB) else c
                               for c in CORPUS], "root": "the standard library",
                   "tokens": read_meta(out / "next-token" / "model")["corpus"]["tokens"]},
        "runs": runs,
        "step_time_and_memory": {**measure_all(list(MEASURE)[:1] if args.step_time == "one" else MEASURE),
                                 **(measure_all(MEASURE_TARGET) if args.step_time == "all" else {})},
        "hardware": hardware(), "software": software(),
        "notes": "training_seconds include periodic validation and checkpoints, on a 2-core machine shared "
                 "with other jobs; step_seconds come from isolated subprocesses (random tokens).",
    }
    (EVIDENCE / "mtp-experiment.json").write_text(json.dumps(result, indent=1) + "\n")
    plot(out, EVIDENCE / "mtp-experiment.png")
    print(json.dumps({name: r["valid_next_token_loss"] for name, r in runs.items()}))


if __name__ == "__main__":
    main()
