"""The structured workload on SmolLM2-135M-Instruct, batch 1: plain constrained decoding (k = 0, the
vLLM / llama.cpp way, no forced drafts) against forced drafts alone and forced drafts + n-gram lookup,
greedy and T=1 (seeded), interleaved; then the mask's cost per token against a plain step.

    python docs/structured-bench.py [EVERY] > docs/structured-bench.json
"""
import json
import statistics
import sys
import time

import numpy as np
import torch

from specdec import api
from specdec.bench.structured import run, tasks
from specdec.decoding.constraint import Constraint, compile_constraint, masked
from specdec.decoding.guided import GrammarDrafts

target = api.load()
workload = tasks()[::int(sys.argv[1]) if len(sys.argv) > 1 else 1]  # every EVERY-th task
configs = {"plain constrained (k=0)": lambda: (None, None),
           "forced drafts k=6": lambda: (GrammarDrafts(), 6),
           "forced + ngram k=6": lambda: (api.load_drafter(target, "ngram"), 6)}
results = {}
for temperature in (0.0, 1.0):
    totals = {name: [] for name in configs}
    for task in workload:  # interleaved: every configuration on one task, then the next task
        for name, make in configs.items():
            proposer, k = make()
            totals[name].append(run(target, [task], proposer=proposer, k=k, temperature=temperature))
    for name, parts in totals.items():
        tokens, seconds = sum(p["tokens"] for p in parts), sum(p["seconds"] for p in parts)
        proposed = [p for p in parts if p["alpha"] is not None]
        results[f"{name}, T={temperature:g}"] = {
            "tasks": len(parts), "validity": sum(p["valid"] for p in parts) / len(parts), "tokens": tokens,
            "seconds": seconds, "tokens_per_s": tokens / seconds,
            "forced_share": sum(p["forced_share"] * p["tokens"] for p in parts) / tokens,
            "steps": sum(p["steps"] for p in parts),
            "alpha_mean_over_tasks": statistics.mean(p["alpha"] for p in proposed) if proposed else None}
        print(name, temperature, results[f"{name}, T={temperature:g}"], file=sys.stderr)
    base = results[f"plain constrained (k=0), T={temperature:g}"]["tokens_per_s"]
    for name in configs:
        results[f"{name}, T={temperature:g}"]["speedup"] = results[f"{name}, T={temperature:g}"]["tokens_per_s"] / base

# the mask: compute + unpack + masked_fill per token, against one plain step of the target
vocab = target.model.config.vocab_size
compiled = compile_constraint(Constraint.json_schema(workload[0].schema), target.tokenizer, vocab)
ids = target.tokenizer.encode('{"name":"Ada Lovelace","age":36,"city":"London"}')
mask_s, step_s = [], []
logits = torch.randn(1, vocab)
with torch.inference_mode():
    cache = target.model.new_cache(1, 256)
    target.model(torch.tensor([ids[:1]]), cache=cache)
    for t in ids:
        m = compiled.matcher() if t == ids[0] else m
        t0 = time.perf_counter()
        bits = np.zeros((1, m.words), dtype=np.int32)
        m.mask_into(bits[0])
        masked(logits, bits)
        mask_s.append(time.perf_counter() - t0)
        m.advance([t])
        t0 = time.perf_counter()
        target.model(torch.tensor([[t]]), cache=cache)
        step_s.append(time.perf_counter() - t0)
mask, step = statistics.median(mask_s), statistics.median(step_s)
results["mask_per_token_ms"] = mask * 1e3
results["plain_step_ms"] = step * 1e3
results["mask_share_of_step"] = mask / step
print(json.dumps(results, indent=1))
