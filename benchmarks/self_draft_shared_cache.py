"""How often SmolLM2's self-draft agrees with its target when it attends to the target's own keys and
values of the text so far, against its own (docs/quantized.md, "What a draft token costs").

When this was measured the self-draft kept a KV cache of its own: it prefills every prompt itself (77 ms for 125
tokens on the 2-core Intel Xeon, 0.65 of the target's prefill) and catches up after a plain stretch.
Its layers have the target's shapes, so it could instead read the target's cache, which holds every
committed token but the newest, and write only the keys and values of the tokens it feeds (the
newest and its drafts) in the slots the verification then overwrites. This measures what that would
do to agreement, teacher-forced on the target's own seeded T=1 answers to the first PROMPTS HumanEval
and chat prompts: for each answer position, the self-draft's distribution q from its own cache (one
forward over prompt + answer) and from the target's (the target's cache rolled back to the
position, the newest token fed by the draft; positions taken from the last to the first, so the
slot a draft forward writes is never read again), against the target's p. Prints rejection
sampling's acceptance E[sum min(p, q)] and greedy agreement (argmax q = argmax p) for both; the
last line is one JSON object.

    python benchmarks/self_draft_shared_cache.py [--prompts 8] [--max-new-tokens 128] [--model PATH]
"""
from __future__ import annotations

import argparse
import json

import torch

from specdec import api
from specdec.bench.workloads import chat_prompts, humaneval_prompts
from specdec.proposers import SelfDraftProposer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--model", help="the target (default: SmolLM2's bf16 conversion, the form these figures "
                        "were measured on)")
    args = parser.parse_args()
    target = api.load(args.model) if args.model else api.load(quantize="bf16")
    draft = SelfDraftProposer(target.model).model
    report = {}
    workloads = [("humaneval", humaneval_prompts(args.prompts), False)]
    if target.tokenizer.has_chat_template:  # the chat prompts need one (a plain checkpoint: code only)
        workloads.append(("chat", chat_prompts(args.prompts), True))
    for workload, prompts, chat in workloads:
        sums = {"own": [0.0, 0], "shared": [0.0, 0]}
        positions = 0
        for i, prompt in enumerate(prompts):
            given = dict(messages=[{"role": "user", "content": prompt}]) if chat else dict(prompts=[prompt])
            answer = api.generate(target, max_new_tokens=args.max_new_tokens, temperature=1.0, seed=i, **given)
            prompt_ids = api.encode_prompts(target, [prompt], args.max_new_tokens, chat)[0]
            ids = torch.tensor(prompt_ids + answer.tokens[0])[None]
            start, n = len(prompt_ids) - 1, ids.shape[1]  # the positions predicting the answer: start .. n-2
            with torch.inference_mode():
                cache = target.model.new_cache(1, n)
                p = torch.log_softmax(target.model(ids, cache=cache).logits[0].float(), -1)
                q = {"own": torch.log_softmax(draft(ids, cache=draft.new_cache(1, n)).logits[0].float(), -1),
                     "shared": torch.empty_like(p)}
                for j in range(n - 2, start - 1, -1):
                    cache.rollback([j])
                    q["shared"][j] = torch.log_softmax(draft(ids[:, j:j + 1], cache=cache).logits[0, -1].float(), -1)
            scored = slice(start, n - 1)
            for name, qs in q.items():
                sums[name][0] += torch.minimum(p[scored].exp(), qs[scored].exp()).sum().item()
                sums[name][1] += (p[scored].argmax(-1) == qs[scored].argmax(-1)).sum().item()
            positions += n - 1 - start
        print(workload, f"{positions} positions;", " | ".join(
            f"{name} cache: rejection {r / positions:.4f} greedy {g / positions:.4f}" for name, (r, g) in sums.items()),
            flush=True)
        report[workload] = {name: {"rejection": r / positions, "greedy": g / positions, "positions": positions}
                            for name, (r, g) in sums.items()}
    print(json.dumps(report))


if __name__ == "__main__":
    main()
