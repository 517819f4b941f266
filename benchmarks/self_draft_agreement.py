"""How often SmolLM2's self-draft agrees with its target, position by position on the same texts,
under both rules of acceptance at temperature 1 (docs/quantized.md, "Its unembedding's
activations"):

- rejection sampling (no seed) accepts a draft token with probability sum_v min(p_v, q_v);
- seeded sampling (Gumbel-max, the noise fixed by (seed, position)) accepts it when
  argmax(log q + g) = argmax(log p + g), estimated here over NOISE draws of g per position.

p is the target's distribution, q the draft's. The texts are the target's own seeded answers (T=1,
MAX_NEW tokens) to the first PROMPTS HumanEval prompts and chat prompts; every draft variant is
read at the very same positions (teacher forcing: one forward over prompt + answer), so their
differences are paired. Variants: the self-draft's Q8_0 unembedding multiplying int8 activations
(`coarse`), the same with fine activations (`fine`, the default) and the target's own bf16
unembedding (`bf16`), all over the same Q4_1 layers. Prints one line per workload, then one JSON
object.

    python benchmarks/self_draft_agreement.py [--prompts 8] [--max-new-tokens 128] [--model PATH]
"""
from __future__ import annotations

import argparse
import json

import torch

from specdec import api
from specdec.bench.workloads import chat_prompts, humaneval_prompts
from specdec.proposers import SelfDraftProposer

CHUNK = 16
VARIANTS = {"coarse": dict(fine_head=False), "fine": dict(fine_head=True), "bf16": dict(head_format="bf16")}


def log_probs(model, ids: torch.Tensor, start: int) -> torch.Tensor:
    """(n, V) log-probabilities at T=1 predicting ids[start + 1:] from each prefix."""
    return torch.log_softmax(model(ids[None]).logits[0, start:-1].float(), -1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--noise", type=int, default=256, help="Gumbel draws per position (in chunks of 16)")
    parser.add_argument("--model", help="the target (default: SmolLM2's bf16 conversion, the form these figures "
                        "were measured on)")
    args = parser.parse_args()
    target = api.load(args.model) if args.model else api.load(quantize="bf16")
    drafts = {name: SelfDraftProposer(target.model, **options).model for name, options in VARIANTS.items()}
    noise_generator = torch.Generator().manual_seed(0)
    report = {}
    workloads = [("humaneval", humaneval_prompts(args.prompts), False)]
    if target.tokenizer.has_chat_template:  # the chat prompts need one (a plain checkpoint: code only)
        workloads.append(("chat", chat_prompts(args.prompts), True))
    for workload, prompts, chat in workloads:
        sums = {name: {"rejection": 0.0, "seeded": 0.0} for name in drafts}
        positions = 0
        for i, prompt in enumerate(prompts):
            given = dict(messages=[{"role": "user", "content": prompt}]) if chat else dict(prompts=[prompt])
            answer = api.generate(target, max_new_tokens=args.max_new_tokens, temperature=1.0, seed=i, **given)
            prompt_ids = api.encode_prompts(target, [prompt], args.max_new_tokens, chat)[0]
            ids = torch.tensor(prompt_ids + answer.tokens[0])
            with torch.inference_mode():
                p = log_probs(target.model, ids, len(prompt_ids) - 1)
                qs = {name: log_probs(draft, ids, len(prompt_ids) - 1) for name, draft in drafts.items()}
                for name, q in qs.items():
                    sums[name]["rejection"] += torch.minimum(p.exp(), q.exp()).sum().item()
                for _ in range(args.noise // CHUNK):  # CHUNK draws of the noise at a time: (CHUNK, n, V) floats
                    g = -torch.log(-torch.log(torch.rand(CHUNK, *p.shape, generator=noise_generator).clamp_min(1e-12)))
                    target_tokens = (p + g).argmax(-1)
                    for name, q in qs.items():
                        agree = ((q + g).argmax(-1) == target_tokens).double().sum().item()
                        sums[name]["seeded"] += agree / (args.noise // CHUNK * CHUNK)
            positions += p.shape[0]
        report[workload] = {name: {rule: value / positions for rule, value in rules.items()} | {"positions": positions}
                            for name, rules in sums.items()}
        print(workload, " | ".join(f"{name}: rejection {r['rejection']:.4f} seeded {r['seeded']:.4f}"
                                   for name, r in report[workload].items()), f"({positions} positions)", flush=True)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
