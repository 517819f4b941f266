"""The Qwen2.5-Coder pair against transformers' assisted generation, in one run: transformers'
`generate` and its assisted generation (`assistant_model=` the 0.5B, up to --draft-max drafts per
step, constant schedule) on the pair's bf16 conversions, beside specdec plain and specdec's hybrid
(suffix lookup on matches of 5 tokens or more, else the 0.5B under `-k auto`, draft vocabulary and
stopping rule as benchmarks/vs_llamacpp_native.py's) on the Q4_K_M files as stored.

    specdec pair install
    python benchmarks/pair_vs_transformers.py [--prompts 3] [--new-tokens 128] [--rounds 1] [--draft-max 5]
        [--target qwen2.5-coder-1.5b] [--draft qwen2.5-coder-0.5b] [--out FILE]

HumanEval prompts, greedy, exactly --new-tokens tokens each (EOS ignored on both sides); decoders
interleaved prompt by prompt; tokens/s of the whole request (prefill included, the same on both
sides). transformers runs in bfloat16 (its fastest setting on this CPU, bench/peers.py), so its
outputs are checked against its own `generate`, specdec's against specdec plain. Writes
docs/evidence/pair-transformers.json (or --out).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from specdec import api
from specdec.bench.conditions import hardware, software
from specdec.bench.peers import PEER_DTYPE, Peers
from specdec.bench.workloads import humaneval_prompts
from specdec.decoding.engine import speculative_generate
from specdec.decoding.sampling import SamplingConfig
from specdec.decoding.stopping import StopRule
from specdec.proposers.drafters import DraftModelOptions

EVIDENCE = Path(__file__).resolve().parents[1] / "docs" / "evidence"
TARGET, DRAFT = "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompts", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--draft-max", type=int, default=5)
    p.add_argument("--target", default=TARGET, help="a .gguf file or a packaged model's name")
    p.add_argument("--draft", default=DRAFT, help="its draft, the same")
    p.add_argument("--out", default=str(EVIDENCE / "pair-transformers.json"))
    args = p.parse_args()
    greedy, n = SamplingConfig(), args.new_tokens
    target = api.load(args.target, quantize="gguf")
    hybrid = api.load_drafter(target, "hybrid", args.draft, DraftModelOptions(draft_vocab="auto", stop_below=0.3))
    peers = Peers(api.checkpoint_folder(args.target), api.checkpoint_folder(args.draft), PEER_DTYPE,
                  torch.device("cpu"))
    prompts = [target.tokenizer.encode(t) for t in humaneval_prompts(args.prompts)]

    def ours(proposer, k):
        def run(prompt, new_tokens):
            if hasattr(proposer, "forget"):
                proposer.forget()  # each request looks up its own text only
            rows, m = speculative_generate(target.model, proposer, [prompt], StopRule(new_tokens), greedy, k)
            return rows[0].tokens, (m.accepted, m.proposed)
        return run

    def theirs(method):
        return lambda prompt, new_tokens: (peers.generate(method, args.draft_max, [prompt], new_tokens, greedy)[0],
                                           None)

    decoders = {"specdec plain": ours(None, 0), "specdec hybrid auto": ours(hybrid, "auto"),
                "transformers generate": theirs("hf-generate"),
                f"transformers assisted (k={args.draft_max})": theirs("hf-assisted")}
    for run in decoders.values():  # warm-up: the kernels, -k auto's verify curve, transformers' first call
        run(prompts[0], 8)
    seconds = {name: [0.0] * args.rounds for name in decoders}
    outputs, drafts = {}, {}
    for r in range(args.rounds):
        for i, prompt in enumerate(prompts):
            for name, run in decoders.items():
                t0 = time.perf_counter()
                tokens, counts = run(prompt, n)
                seconds[name][r] += time.perf_counter() - t0
                outputs[name, i] = tokens
                if counts:
                    drafts[name] = [a + b for a, b in zip(drafts.get(name, (0, 0)), counts)]
            print(f"round {r + 1} prompt {i}: " + ", ".join(f"{name} {s[r]:.1f} s" for name, s in seconds.items()),
                  flush=True)
    speed = {name: statistics.median(len(prompts) * n / s for s in v) for name, v in seconds.items()}
    same = {name: all(outputs[name, i] == outputs[("specdec plain" if name.startswith("specdec") else
                                                     "transformers generate"), i] for i in range(len(prompts)))
            for name in decoders}
    figures = {"conditions": {"hardware": hardware(), "software": software(), "threads": torch.get_num_threads(),
                              "new tokens": n, "prompts": len(prompts), "rounds": args.rounds,
                              "transformers dtype": str(PEER_DTYPE), "specdec weights": "Q4_K_M as stored"},
               "humaneval tokens_per_s": speed,
               "vs transformers generate": {k: v / speed["transformers generate"] for k, v in speed.items()},
               "specdec acceptance": drafts, "identical to its own plain decoding": same}
    out = Path(args.out)
    out.write_text(json.dumps(figures, indent=1))
    print(json.dumps(figures["humaneval tokens_per_s"], indent=1))
    print(json.dumps(figures["vs transformers generate"], indent=1), same)
    print(f"written: {out}")


if __name__ == "__main__":
    main()
