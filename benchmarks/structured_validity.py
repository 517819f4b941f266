"""Validity over the whole structured workload (54 tasks, bench/structured.py) on
SmolLM2-135M-Instruct: plain constrained decoding and forced drafts + n-gram lookup through
api.generate (batch 1), and the same workload through a real `specdec serve` (forced drafts +
n-gram lookup, k = 6; OpenAI's response_format json_schema on /v1/chat/completions, 4 requests at
once), greedy and T=1 (seed 0); an output counts when it ended with EOS ("stop") and validates
against its schema.

    python benchmarks/structured_validity.py > docs/evidence/structured-validity.json
"""
import json
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx

from specdec import api
from specdec.bench.serve import start_server
from specdec.bench.structured import run, tasks, valid_json

target = api.load(quantize="bf16")  # the bf16 conversion: the form these figures were measured on
workload = tasks()
out = {}
for temperature in (0.0, 1.0):
    for name, (proposer, k) in {"plain constrained": (None, None),
                                "forced + ngram k=6": (api.load_drafter(target, "ngram"), 6)}.items():
        r = run(target, workload, proposer=proposer, k=k, temperature=temperature)
        out[f"{name}, T={temperature:g}"] = {key: r[key] for key in ("tasks", "valid", "validity", "hit_length",
                                                                      "forced_share", "alpha")}
        print(name, temperature, out[f"{name}, T={temperature:g}"], file=sys.stderr, flush=True)

proc, url = start_server(["--draft", "ngram", "-k", "6", "--max-batch", "4"])


def ask(task, temperature: float) -> dict:
    body = {"messages": [{"role": "user", "content": task.prompt}], "max_tokens": 96, "temperature": temperature,
            "seed": 0, "response_format": {"type": "json_schema", "json_schema": {"name": task.kind,
                                                                                   "schema": task.schema}}}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=600)
    r.raise_for_status()
    return r.json()["choices"][0]


try:
    for temperature in (0.0, 1.0):
        with ThreadPoolExecutor(4) as pool:
            choices = list(pool.map(ask, workload, [temperature] * len(workload)))
        valid = sum(c["finish_reason"] == "stop" and valid_json(c["message"]["content"], t.schema)
                    for c, t in zip(choices, workload))
        out[f"server, forced + ngram k=6, 4 at once, T={temperature:g}"] = {
            "tasks": len(workload), "valid": valid, "validity": valid / len(workload),
            "hit_length": sum(c["finish_reason"] == "length" for c in choices)}
        print("server", temperature, valid, file=sys.stderr, flush=True)
finally:
    proc.terminate()
    proc.wait(60)
print(json.dumps(out, indent=1))
