"""A draft model cut from SmolLM2-135M-Instruct itself (its embedding, its first LAYERS decoder layers,
its final norm and its tied unembedding), distilled to the target's distribution, against the EAGLE-3
head at the same training budget (docs/methods/eagle.md, "The drafter the cost model picks").

Data: the token pool of a long-run folder (its shards: the target's own greedy and T=0.8 answers to
the prompt pool), windows drawn as the long run draws them. Loss: KL(target || draft) over the whole
vocabulary, per position (train/losses.distill_kl), the target in bf16 where the CPU multiplies bf16
in hardware. Evaluation, at each point of --points (tokens trained on) and before training: the long
run's held-out answers (its heldout/ folder), every group of train/longrun.EVAL_KINDS, cut into the
same 257-token windows: greedy α_1 (the draft's argmax is the fp32 target's) and, at T=1,
sum_v min(p_v, q_v), the figures the EAGLE head's learning curve reports as α_1. Then the cut is
saved as a checkpoint folder and decoded against plain decoding and the shipped EAGLE-3 head
(k=1, 2, 3; 8 HumanEval and 8 chat prompts, 128 new tokens, greedy; interleaved rounds).

    python benchmarks/cut_draft_vs_eagle.py --run runs/gpu-pool --out runs/cut-draft   (from the repository root)

--model names another target (a checkpoint folder with an EAGLE head shipped for it, such as the 22M
target; default: SmolLM2), decoded as loaded instead of SmolLM2's bf16 conversion.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from specdec import api
from specdec.bench.workloads import chat_prompts, humaneval_prompts
from specdec.lm.arch import Arch
from specdec.lm.checkpoint import TOKENIZER, load_model, save_model
from specdec.lm.device import native_bf16
from specdec.lm.model import LlamaForCausalLM, place
from specdec.lm.tokenizer import Tokenizer
from specdec.train.longrun import Pool, heldout_windows, windows
from specdec.train.losses import distill_kl, teacher_targets


def cut(target: LlamaForCausalLM, layers: int) -> LlamaForCausalLM:
    """A model of the target's architecture with its first `layers` decoder layers, trainable, in fp32."""
    arch = Arch.from_dict({**target.config.to_dict(), "num_hidden_layers": layers})
    kept = {k: v.detach().clone().float() for k, v in target.hf_state_dict().items()
            if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers}
    with torch.device("meta"):
        model = LlamaForCausalLM(arch)
    model.load_hf_state_dict(kept, assign=True)
    return place(model, "cpu").train()


@torch.no_grad()
def evaluate(draft, target, groups: dict[str, list[torch.Tensor]]) -> dict[str, dict[str, float]]:
    """Per group: greedy α_1 = the share of positions where the draft's argmax is the target's, and
    t1_alpha = the mean of sum_v min(p_v, q_v) at T=1."""
    draft.eval()
    out = {}
    for name, batches in groups.items():
        hit = overlap = n = 0
        for batch in batches:
            tokens = batch[:, :-1]
            p = F.softmax(target(tokens).logits.float(), -1)
            q = F.softmax(draft(tokens).logits.float(), -1)
            hit += int((p.argmax(-1) == q.argmax(-1)).sum())
            overlap += float(torch.minimum(p, q).sum(-1).sum())
            n += tokens.numel()
        out[name] = {"greedy_alpha_1": hit / n, "t1_alpha_1": overlap / n, "positions": n}
    draft.train()
    return out


def decode(target_loaded, draft_folder: Path, n: int, tokens: int, rounds: int) -> dict:
    """Tokens/s ratios to plain decoding, interleaved: the cut at k=1..3 and the shipped EAGLE-3 head at k=1."""
    cut_draft = api.load_drafter(target_loaded, "draft-model", draft_folder)
    eagle = api.load_drafter(target_loaded, "eagle")
    configs = {"plain": (None, 0), **{f"cut k={k}": (cut_draft, k) for k in (1, 2, 3)}, "eagle k=1": (eagle, 1)}
    result = {}
    workloads = [("humaneval", humaneval_prompts(n), False)]
    if target_loaded.tokenizer.has_chat_template:  # the chat prompts need one (a plain checkpoint: code only)
        workloads.append(("chat", chat_prompts(n), True))
    for workload, prompts, chat in workloads:
        sums = {m: [0, 0.0, 0, 0] for m in configs}
        for _ in range(rounds):
            for prompt in prompts:
                kw = dict(messages=[{"role": "user", "content": prompt}]) if chat else dict(prompts=[prompt])
                for m, (proposer, k) in configs.items():
                    s = api.generate(target_loaded, max_new_tokens=tokens, proposer=proposer, k=k, **kw).stats
                    sums[m][0] += s["new_tokens"]
                    sums[m][1] += s["seconds"]
                    sums[m][2] += s.get("accepted", 0)
                    sums[m][3] += s.get("proposed", 0)
        plain = sums["plain"][0] / sums["plain"][1]
        result[workload] = {"plain_tokens_per_second": round(plain, 1), **{
            m: {"speedup": round(v[0] / v[1] / plain, 3), "alpha": round(v[2] / max(v[3], 1), 3)}
            for m, v in sums.items() if m != "plain"}}
        print(workload, json.dumps(result[workload]), flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", default="runs/gpu-pool", help="a long-run folder: its shards and heldout/")
    parser.add_argument("--out", default="runs/cut-draft", help="where the cut draft and its figures are written")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--points", type=int, nargs="+", default=[250_000, 500_000, 1_000_000])
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--decode-prompts", type=int, default=8)
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--decode-rounds", type=int, default=2)
    parser.add_argument("--model", help="the target (default: SmolLM2)")
    args = parser.parse_args()
    torch.manual_seed(0)
    run, out = Path(args.run), Path(args.out)
    folder = api.checkpoint_folder(args.model)
    target = load_model(folder, dtype=torch.float32).requires_grad_(False).eval()
    bf16 = native_bf16()
    teacher = load_model(folder, dtype=torch.bfloat16).requires_grad_(False).eval() if bf16 else target
    eos = Tokenizer.load(folder).eos_id
    rows = [json.loads(line) for line in (run / "heldout" / "answers.jsonl").read_text().splitlines()]
    groups = heldout_windows(rows, eos, args.seq_len)
    pool = Pool(run)
    pool.refresh()
    draft = cut(target, args.layers)
    opt = torch.optim.AdamW(draft.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    curve = [{"tokens": 0, **evaluate(draft, target, groups)}]
    print(json.dumps(curve[-1]), flush=True)
    step, seen, t0 = 0, 0, time.time()
    while seen < args.points[-1]:
        batch = windows(pool.tokens, 1, step, args.batch_size, args.seq_len)
        tokens = batch[:, :-1]
        targets = teacher_targets(teacher, tokens)
        for group in opt.param_groups:
            group["lr"] = args.lr * min(1.0, (step + 1) / 20)
        with autocast:
            logits = draft(tokens).logits
        loss = distill_kl(logits, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step, seen = step + 1, seen + tokens.numel()
        if step % 20 == 0:
            print(f"step {step}: {seen} tokens, KL {loss.item():.3f}, {seen / (time.time() - t0):.0f} tokens/s",
                  flush=True)
        if any(seen - tokens.numel() < p <= seen for p in args.points):
            curve.append({"tokens": seen, "step": step, "seconds": round(time.time() - t0, 1),
                          **evaluate(draft, target, groups)})
            print(json.dumps(curve[-1]), flush=True)
    draft_folder = save_model(draft, out / "model", tokenizer_file=folder / TOKENIZER,
                              meta={"kind": "target-or-draft-model", "cut_from": str(folder.name),
                                    "layers": args.layers, "tokens": seen, "steps": step})
    result = {"layers": args.layers, "parameters": sum(p.numel() for p in draft.parameters()), "curve": curve,
              "decoding": decode(api.load(args.model) if args.model else api.load(quantize="bf16"), draft_folder,
                                 args.decode_prompts, args.decode_tokens, args.decode_rounds)}
    (out / "cut-draft.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
