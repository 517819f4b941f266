"""Acceptance of seeded sampling (Gumbel-max with noise fixed by (seed, position): the target's
token at each position is fixed by the seed, so a draft is accepted when it equals it) against
rejection sampling (no seed), on the same prompts at temperature 1 (docs/serving.md).

The shipped target with the shipped draft model, and with n-gram lookup; k = 4; the first
PROMPTS HumanEval prompts, MAX_NEW tokens each, one prompt at a time; seeded runs use seeds
0..PROMPTS-1, unseeded ones draw from fresh random generators. Prints α (accepted /
proposed) and τ (emitted tokens / steps) per proposer and rule; the last line is one JSON object.

    python benchmarks/seeded_acceptance.py [--model models/target] [--draft-model models/draft] [--prompts 20]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from specdec import api
from specdec.bench.workloads import humaneval_prompt
from specdec.proposers import DraftModelProposer, NgramProposer

ROOT = Path(__file__).resolve().parents[1]


def run(target, proposer, prompts, seeded: bool, max_new: int) -> dict:
    proposed = accepted = emitted = steps = 0
    for i, prompt in enumerate(prompts):
        result = api.generate(target, prompt, max_new_tokens=max_new, temperature=1.0, proposer=proposer(), k=4,
                              seed=i if seeded else None)
        s = result.stats
        proposed, accepted, steps = proposed + s["proposed"], accepted + s["accepted"], steps + s["steps"]
        emitted += s["new_tokens"]
    return {"alpha": accepted / proposed, "tau": emitted / steps, "proposed": proposed, "steps": steps}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=20)
    p.add_argument("--max-new", type=int, default=64)
    p.add_argument("--model", default=str(ROOT / "models" / "target"), help="the target (default: the shipped 22M one)")
    p.add_argument("--draft-model", help="its draft model (default: the one shipped for it)")
    args = p.parse_args()
    target = api.load(args.model)
    draft = api.load_draft_model(target, args.draft_model)
    proposers = {"draft-model": lambda: DraftModelProposer(model=draft.model),
                 "ngram": lambda: NgramProposer()}
    prompts = [humaneval_prompt(i) for i in range(args.prompts)]
    result = {}
    for name, proposer in proposers.items():
        for rule, seeded in (("rejection sampling (no seed)", False), ("Gumbel-max (seed)", True)):
            r = run(target, proposer, prompts, seeded, args.max_new)
            result[f"{name}, {rule}"] = r
            print(f"{name:>11}, {rule:<28}: alpha {r['alpha']:.3f}, tau {r['tau']:.2f} "
                  f"({r['proposed']} drafts, {r['steps']} steps)")
    print(json.dumps({"results": result, "conditions": {
        "target": str(target.path), "draft": str(draft.path), "k": 4, "temperature": 1.0,
        "prompts": f"HumanEval 0..{args.prompts - 1}", "max_new_tokens": args.max_new, "batch": 1}}))


if __name__ == "__main__":
    main()
