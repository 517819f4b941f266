"""Time to first token with a shared prefix: a ~1,000-token preamble prefilled once, then reused.

One `specdec serve` (its flags after `--`). Rounds of: a request whose prompt is a fresh preamble
(Python standard library source, a different stretch each round: nothing cached) and a question,
then `--repeats` requests with the same preamble and other questions. Each request streams one
token (max_tokens 1), so its time is its time to first token: the prefill. Prints each round's first
and repeat times and the JSON summary: the medians and their ratio (repeat / first).

    python benchmarks/serve_shared_prefix.py -- --model qwen2.5-coder-1.5b --quantize gguf
"""
from __future__ import annotations

import argparse
import inspect
import json
import statistics
import sys
import time

import httpx

from serve_head_to_head import model_and_rest, specdec_server, split_at_dashes

QUESTIONS = ["# What does the function above return for an empty input?\n",
             "# Write a test for the class above.\n",
             "# Explain the first function in one sentence.\n",
             "# Which exceptions can the code above raise?\n",
             "# Rewrite the last function with type hints.\n"]


def preambles(tokens: int, rounds: int) -> list[str]:
    """`rounds` stretches of standard library source of about `tokens` tokens each (4 characters a token)."""
    import difflib
    import textwrap
    source = inspect.getsource(difflib) + inspect.getsource(textwrap)
    size = 4 * tokens
    return [source[i * size:(i + 1) * size] for i in range(rounds)]


def first_token_seconds(url: str, prompt: str) -> tuple[float, int]:
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0}
    start = time.perf_counter()
    r = httpx.post(url + "/v1/completions", json=body, timeout=600)
    r.raise_for_status()
    return time.perf_counter() - start, r.json()["usage"]["prompt_tokens"]


def main(argv: list[str] | None = None) -> None:
    ours, server_args = split_at_dashes(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=1000, help="the preamble's length, about (default 1000)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3, help="requests reusing each round's preamble")
    args = p.parse_args(ours)
    model, extra = model_and_rest(server_args)
    server = specdec_server("specdec", model, extra, 4, None)
    if not server.wait():
        raise SystemExit(f"the server did not start: {server.error}")
    firsts, repeats, lengths = [], [], []
    try:
        first_token_seconds(server.url, "def warm_up():")
        for r, preamble in enumerate(preambles(args.tokens, args.rounds)):
            seconds, n = first_token_seconds(server.url, preamble + QUESTIONS[0])
            firsts.append(seconds)
            lengths.append(n)
            again = [first_token_seconds(server.url, preamble + q)[0] for q in QUESTIONS[1:args.repeats + 1]]
            repeats += again
            print(f"round {r}: {n} prompt tokens, first {seconds:.3f} s, repeats "
                  + ", ".join(f"{s:.3f}" for s in again), file=sys.stderr, flush=True)
    finally:
        server.stop()
    first, repeat = statistics.median(firsts), statistics.median(repeats)
    print(json.dumps({"prompt_tokens": lengths, "first_s": firsts, "repeat_s": repeats, "first_median_s": first,
                      "repeat_median_s": repeat, "repeat_over_first": repeat / first, "server_args": server_args}))


if __name__ == "__main__":
    main()
