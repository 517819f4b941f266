"""Validity over the whole structured workload (54 tasks, bench/structured.py) on
SmolLM2-135M-Instruct, batch 1: plain constrained decoding and forced drafts + n-gram lookup,
greedy and T=1 (seed 0); an output counts when it ended with EOS and validates against its schema.

    python docs/structured-validity.py > docs/structured-validity.json
"""
import json
import sys

from specdec import api
from specdec.bench.structured import run, tasks

target = api.load()
workload = tasks()
out = {}
for temperature in (0.0, 1.0):
    for name, (proposer, k) in {"plain constrained": (None, None),
                                "forced + ngram k=6": (api.load_drafter(target, "ngram"), 6)}.items():
        r = run(target, workload, proposer=proposer, k=k, temperature=temperature)
        out[f"{name}, T={temperature:g}"] = {key: r[key] for key in ("tasks", "valid", "validity", "hit_length",
                                                                      "forced_share", "alpha")}
        print(name, temperature, out[f"{name}, T={temperature:g}"], file=sys.stderr, flush=True)
print(json.dumps(out, indent=1))
