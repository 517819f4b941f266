"""Writes specdec/lm/chat_answers.json, the chat part of the text a GGUF draft's vocabulary is counted
from (lm/local_counts): requests of specdec's own making, none of them among the chat benchmark's
prompts (bench/workloads.CHAT_PROMPTS), and a model's greedy answers to them (plain decoding as
stored, batched, each answer cut at its end of turn).

    specdec pair install qwen2.5-coder-0.5b
    python benchmarks/pair_chat_answers.py qwen2.5-coder-0.5b [--new-tokens 128] [--out FILE]
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from specdec import api
from specdec.bench.workloads import CHAT_PROMPTS
from specdec.decoding.engine import speculative_generate
from specdec.decoding.sampling import SamplingConfig
from specdec.decoding.stopping import StopRule
from specdec.lm import local_counts

PROMPTS = (
    "How do I keep houseplants alive in a dark apartment?",
    "What is the difference between a simile and a metaphor?",
    "Explain how a credit score works.",
    "Write a short birthday message for my grandmother.",
    "Why does bread go stale?",
    "What are the planets of the solar system, in order?",
    "How can I stop procrastinating on a big project?",
    "Describe how a steam engine works.",
    "What is a good way to learn a new language as an adult?",
    "Write a limerick about a forgetful robot.",
    "What is the difference between an array and a linked list?",
    "How do I write a good cover letter?",
    "Why do cats purr?",
    "Explain the difference between RAM and storage.",
    "Give me a packing list for a beach holiday.",
    "What causes earthquakes?",
    "How do I make pancakes from scratch?",
    "What is the meaning of the idiom 'break the ice'?",
    "Explain what a database index is.",
    "Suggest three books for someone who loved The Hobbit.",
    "How does a microwave oven heat food?",
    "What were the main causes of the First World War?",
    "Write an apology message to a friend for missing their party.",
    "What is the greenhouse effect?",
    "How do I sort a dictionary by value in Python?",
    "What are some tips for running my first marathon?",
    "Explain the difference between a process and a thread.",
    "Why is the ocean salty?",
    "How can I be more productive when working from home?",
    "Describe the life cycle of a butterfly.",
    "What is the difference between HTTP and HTTPS?",
    "Write a short story opening set in a lighthouse.",
    "How do airplanes stay in the air?",
    "What should I consider when adopting a dog?",
    "Explain what version control is and why teams use it.",
    "What is the difference between a crocodile and an alligator?",
    "How do I deal with stress before an exam?",
    "What is a prime number? Give some examples.",
    "How does compound interest work?",
    "Give me a weekly meal plan for a vegetarian.",
)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--out", default=str(local_counts.CHAT), help="where the answers go (default: the file "
                   "lm/local_counts reads)")
    args = p.parse_args()
    if set(PROMPTS) & set(CHAT_PROMPTS):
        raise SystemExit("a request here is one of the chat benchmark's prompts: counting its answer would favour it")
    target = api.load(args.model, quantize="gguf")
    prompts = api.encode_prompts(target, list(PROMPTS), args.new_tokens, chat=True)
    t0 = time.time()
    rows, _ = speculative_generate(target.model, None, prompts, StopRule(args.new_tokens), SamplingConfig(), 0)
    ends = set(target.model.config.eos_ids)
    answers = []
    for row in rows:
        tokens = row.tokens[:next((i for i, t in enumerate(row.tokens) if t in ends), len(row.tokens))]
        answers.append(target.tokenizer.tok.decode(tokens, skip_special_tokens=True).strip())
    out = Path(args.out)
    out.write_text(json.dumps({
        "made_by": f"python benchmarks/pair_chat_answers.py {args.model} --new-tokens {args.new_tokens}",
        "model": args.model, "prompts": list(PROMPTS), "answers": answers}, indent=1, ensure_ascii=False) + "\n",
        encoding="utf-8")
    print(f"{len(answers)} answers in {time.time() - t0:.0f} s -> {out}")


if __name__ == "__main__":
    main()
