"""Plain decoding against `-k auto` with each drafter on one bench cell, in CPU seconds of this process
(docs/methods/auto.md, "What it costs"): on a machine other processes keep busy, CPU time of one
thread moves less than wall time. Interleaved (plain, each drafter, plain, ...), after one warm-up
run each; the median of the per-repeat ratios plain / auto, and each part of the engine's work:
making it (`__init__`: the target's cache, the proposer's start, the controller), prefill and joining
(`regroup`), the plain steps, the proposer hearing a stretch (`end_plain`), the controller's weighing; and the
verify forwards of drafting steps with the tokens they carried (min-max over the repeats).

    python benchmarks/auto_cost_breakdown.py chat 0 8 8 5 suffix,eagle,self   # workload T batch prompts repeats drafters
        [--model PATH] [--max-new-tokens 64]

The last line is one JSON object: per configuration, the median CPU seconds of the whole and of each
part, and the ratios plain / it.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict

import torch

import specdec.decoding.engine as engine
from specdec.api import encode_prompts
from specdec.bench.runner import Bench, Cell, Config, Plan
from specdec.bench.workloads import workload
from specdec.decoding.sampling import SamplingConfig
from specdec.decoding.stopping import StopRule

PARTS: dict[str, float] = defaultdict(float)
FORWARDS: dict[str, int] = defaultdict(int)  # the verify forwards of drafting steps, and the tokens they carried
COUNTS = ("verify forwards", "tokens")


def timed(owner, name: str) -> None:
    fn = getattr(owner, name)

    def wrapper(*args, **kwargs):
        start = time.process_time()
        try:
            return fn(*args, **kwargs)
        finally:
            PARTS[name] += time.process_time() - start
    setattr(owner, name, wrapper)


def counted_verify(verify_forward):
    def wrapper(self, window, *args, **kwargs):
        FORWARDS["verify forwards"] += 1
        FORWARDS["tokens"] += window.numel()
        return verify_forward(self, window, *args, **kwargs)
    return wrapper


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("workload")
    p.add_argument("temperature", type=float)
    p.add_argument("batch", type=int)
    p.add_argument("prompts", type=int)
    p.add_argument("repeats", type=int)
    p.add_argument("drafters", help="comma-separated")
    p.add_argument("--model", help="the target (default: the default target)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    args = p.parse_args()
    name, temperature, batch, n, repeats = args.workload, args.temperature, args.batch, args.prompts, args.repeats
    methods, new = tuple(args.drafters.split(",")), args.max_new_tokens
    torch.set_num_threads(1)
    for part in ("__init__", "regroup", "plain_step", "end_plain", "choose"):
        timed(engine.Engine, part)
    engine.Engine.verify_forward = counted_verify(engine.Engine.verify_forward)
    bench = Bench(Plan((Cell(name, temperature, batch, (), n),), methods=methods, max_new_tokens=new, moe=None),
                  args.model)
    wl = workload(name, n)
    prompts = encode_prompts(bench.target, wl.prompts, new, chat=wl.chat)
    batches = [prompts[i:i + batch] for i in range(0, len(prompts), batch)]
    sampling, rule = SamplingConfig(temperature, seed=0), StopRule(new)
    configs = [Config("plain")] + [Config(m, "auto") for m in methods]
    results = {c.label: defaultdict(list) for c in configs}
    for round in range(repeats + 1):  # the first round warms up
        for cfg in configs:
            bench.forget(cfg)
            PARTS.clear()
            FORWARDS.clear()
            start = time.process_time()
            for rows in batches:
                if cfg.method == "plain":  # the bench's own plain decoding
                    engine.plain_generate(bench.target.model, rows, rule, sampling, sampling.generator(bench.device))
                else:
                    bench.decode(cfg, rows, sampling, rule)
            if round:
                results[cfg.label]["total"].append(time.process_time() - start)
                for part, seconds in PARTS.items():
                    results[cfg.label][part].append(seconds)
                for kind in COUNTS:
                    results[cfg.label][kind].append(FORWARDS[kind])
    print(f"{name}, T={temperature:g}, batch {batch}, {n} prompts, {new} new tokens, {repeats} repeats, 1 thread, "
          "CPU ms (medians)")
    for cfg in configs:
        got = results[cfg.label]
        ratios = [p / a for p, a in zip(results["plain"]["total"], got["total"])]
        parts = " ".join(f"{part} {statistics.median(v) * 1e3:.1f}" for part, v in got.items()
                         if part not in ("total", *COUNTS))
        parts += "".join(f"  {kind} {min(got[kind])}-{max(got[kind])}" for kind in COUNTS)
        print(f"{cfg.label:14s} {statistics.median(got['total']) * 1e3:8.1f}  plain/this {statistics.median(ratios):.3f} "
              f"({min(ratios):.3f}-{max(ratios):.3f})  {parts}")
    print(json.dumps({cfg.label: {"plain/this": statistics.median(x / y for x, y in zip(results["plain"]["total"],
                                                                                     results[cfg.label]["total"])),
                                  **{part: statistics.median(v) for part, v in results[cfg.label].items()}}
                      for cfg in configs}))


if __name__ == "__main__":
    main()
