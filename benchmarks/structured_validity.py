"""Validity over the whole structured workload (54 tasks, bench/structured.py) on
SmolLM2-135M-Instruct: plain constrained decoding and forced drafts + n-gram lookup through
api.generate (batch 1), and the same workload through a real `specdec serve` (forced drafts +
n-gram lookup, k = 6; OpenAI's response_format json_schema on /v1/chat/completions, 4 requests at
once; /v1/completions with the prompt as text for a model without a chat template), greedy and T=1
(seed 0); an output counts when it ended with EOS ("stop") and validates against its schema.

    python benchmarks/structured_validity.py > docs/evidence/structured-validity.json
    python benchmarks/structured_validity.py --model PATH --tasks 6 --max-tokens 32   (another target, fewer tasks)
"""
from __future__ import annotations

import argparse
import json
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx

from specdec import api
from specdec.bench.serve import start_server
from specdec.bench.structured import run, tasks, valid_json


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="the target (default: SmolLM2's bf16 conversion, the form these figures were "
                   "measured on)")
    p.add_argument("--tasks", type=int, help="the first N tasks of the workload (default: all 54)")
    p.add_argument("--max-tokens", type=int, default=96)
    args = p.parse_args()
    target = api.load(args.model) if args.model else api.load(quantize="bf16")
    workload = tasks()[:args.tasks]
    chat = target.tokenizer.has_chat_template
    out = {}
    for temperature in (0.0, 1.0):
        for name, (proposer, k) in {"plain constrained": (None, None),
                                    "forced + ngram k=6": (api.load_drafter(target, "ngram"), 6)}.items():
            r = run(target, workload, args.max_tokens, proposer=proposer, k=k, temperature=temperature, chat=chat)
            out[f"{name}, T={temperature:g}"] = {key: r[key] for key in ("tasks", "valid", "validity", "hit_length",
                                                                          "forced_share", "alpha")}
            print(name, temperature, out[f"{name}, T={temperature:g}"], file=sys.stderr, flush=True)

    proc, url = start_server(["--model", str(target.path), *([] if args.model else ["--quantize", "bf16"]),
                              "--draft", "ngram", "-k", "6", "--max-batch", "4"])

    def ask(task, temperature: float) -> dict:
        body = {"max_tokens": args.max_tokens, "temperature": temperature, "seed": 0,
                "response_format": {"type": "json_schema", "json_schema": {"name": task.kind, "schema": task.schema}}}
        if chat:
            body["messages"] = [{"role": "user", "content": task.prompt}]
        else:
            body["prompt"] = task.prompt + "\n"
        r = httpx.post(url + ("/v1/chat/completions" if chat else "/v1/completions"), json=body, timeout=600)
        r.raise_for_status()
        choice = r.json()["choices"][0]
        return {"finish_reason": choice["finish_reason"], "text": choice["message"]["content"] if chat else choice["text"]}

    try:
        for temperature in (0.0, 1.0):
            with ThreadPoolExecutor(4) as pool:
                choices = list(pool.map(ask, workload, [temperature] * len(workload)))
            valid = sum(c["finish_reason"] == "stop" and valid_json(c["text"], t.schema)
                        for c, t in zip(choices, workload))
            out[f"server, forced + ngram k=6, 4 at once, T={temperature:g}"] = {
                "tasks": len(workload), "valid": valid, "validity": valid / len(workload),
                "hit_length": sum(c["finish_reason"] == "length" for c in choices)}
            print("server", temperature, valid, file=sys.stderr, flush=True)
    finally:
        proc.terminate()
        proc.wait(60)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
