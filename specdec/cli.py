"""The `specdec` command: argument parsing and printing only; the work happens in the package."""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

from .errors import SpecdecError


def cmd_train(args) -> None:
    from .presets import PRESETS
    from .train.loop import TrainConfig, train

    preset = dict(PRESETS[args.preset])
    for name in ("steps", "batch_size", "micro_batch", "seq_len", "lr", "seed", "tokenizer", "eval_every",
                 "save_every", "stop_after", "objective", "mtp_depth", "mtp_lambda", "mtp_lambda_late",
                 "mtp_beta", "frozen_trunk"):
        value = getattr(args, name)
        if value is not None:
            preset[name] = value
    if args.corpus:
        preset["corpus"] = args.corpus
    if args.vocab_size:
        preset["model"] = dataclasses.replace(preset["model"], vocab_size=args.vocab_size)
    if args.naive_mtp_order:
        preset["mtp_memory_saving"] = False
    path = train(TrainConfig(out=args.out, **preset))
    if path is None:
        print(f"stopped early with a checkpoint in {args.out}; rerun the same command to resume")
    elif int(os.environ.get("RANK", 0)) == 0:
        print(f"{'MTP heads' if path.name == 'heads' else 'model'} written to {path}")


def cmd_generate(args) -> None:
    from .api import generate, load
    from .bench.workloads import humaneval_prompt

    if (args.prompt is None) == (args.humaneval is None):
        raise SpecdecError("give exactly one of --prompt TEXT or --humaneval INDEX")
    prompt = args.prompt if args.prompt is not None else humaneval_prompt(args.humaneval)
    target = load(args.model)
    proposer = make_proposer(args, target)
    k = args.k if args.k is not None else getattr(getattr(proposer, "heads", None), "depth", 4)
    result = generate(target, prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                      top_k=args.top_k, top_p=args.top_p, seed=args.seed, stop=tuple(args.stop),
                      proposer=proposer, k=k)
    if args.json:
        print(json.dumps({"text": result.texts[0], "tokens": result.tokens[0],
                          "finish_reason": result.finish_reasons[0], "stats": result.stats}))
        return
    s = result.stats
    print(prompt.rstrip() + result.texts[0])
    method = "plain decoding" if s["method"] == "plain" else (
        f"{s['method']} k={k}: acceptance rate {s['acceptance_rate'] or 0:.2f}, "
        f"mean acceptance length {s['mean_acceptance_length']:.2f} over {s['steps']} steps")
    print(f"\n--- {s['new_tokens']} tokens in {s['seconds']:.2f} s ({s['tokens_per_s']:.1f} tokens/s, "
          f"time to first token {s['time_to_first_token'] * 1000:.0f} ms); {method}; target {target.path}, "
          f"{s['dtype']}, batch 1, temperature {args.temperature}, {s['threads']} threads; "
          f"finish: {result.finish_reasons[0]}", file=sys.stderr)


def make_proposer(args, target):
    from .api import load_draft_model, load_mtp_heads
    from .proposers import build_proposer

    if args.draft == "none":
        return None
    if args.draft == "draft-model":
        return build_proposer("draft-model", model=load_draft_model(target, args.draft_model).model)
    if args.draft == "mtp":
        return build_proposer("mtp", heads=load_mtp_heads(target, args.heads), target=target.model,
                              draft_vocab=args.draft_vocab)
    return build_proposer("ngram", max_n=args.ngram_max, min_n=args.ngram_min)


def cmd_bench(args) -> None:
    import torch

    from .bench.plain import bench_plain, format_plain
    from .bench.spec import bench_spec, format_spec

    dtype = {"stored": None, "float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    if args.mode == "plain":
        result = bench_plain(args.model, n_prompts=args.prompts, repeats=args.repeats,
                             max_new_tokens=args.max_new_tokens, dtype=dtype)
        print(format_plain(result))
        summary = {"speedup_vs_transformers": result["speedup_vs_transformers"],
                   "bandwidth_fraction": result["bandwidth_fraction"]}
    else:
        result = bench_spec(args.model, args.draft_model, n_prompts=args.prompts, repeats=args.repeats,
                            max_new_tokens=args.max_new_tokens, ks=tuple(args.ks), methods=tuple(args.methods),
                            peers=not args.no_peers, temperature=args.temperature, batch_size=args.batch_size,
                            dtype=dtype)
        print(format_spec(result))
        summary = {f"{x['method']} k={x['k']}": round(x["speedup_vs_plain"], 3) for x in result["results"]}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(summary))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specdec", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="train a model (single process, or under torchrun)")
    t.add_argument("--preset", choices=["target", "draft", "target-mtp", "tiny"], default="target",
                   help="target-mtp: MTP heads for the shipped target, trained on its frozen weights")
    t.add_argument("--out", required=True, help="run folder (resumed if it already holds a run)")
    t.add_argument("--corpus", nargs="+", help="text/.jsonl files or folders (default: the standard library)")
    t.add_argument("--tokenizer", help="use this tokenizer.json instead of training one")
    t.add_argument("--vocab-size", type=int)
    t.add_argument("--steps", type=int)
    t.add_argument("--batch-size", type=int)
    t.add_argument("--micro-batch", type=int)
    t.add_argument("--seq-len", type=int)
    t.add_argument("--lr", type=float)
    t.add_argument("--seed", type=int)
    t.add_argument("--eval-every", type=int)
    t.add_argument("--save-every", type=int)
    t.add_argument("--stop-after", type=int, help="leave after N steps (checkpointed); rerun to resume")
    t.add_argument("--objective", choices=["next-token", "mtp-parallel", "mtp-sequential"],
                   help="next-token only, or with MTP heads: parallel (Gloeckle et al.) or sequential "
                        "modules (DeepSeek-V3)")
    t.add_argument("--mtp-depth", type=int, help="MTP heads: tokens predicted beyond the next one")
    t.add_argument("--mtp-lambda", type=float, help="MTP head j's loss weight is lambda * beta^(j-1)")
    t.add_argument("--mtp-lambda-late", type=float, help="lambda from 70%% of the steps on (schedule)")
    t.add_argument("--mtp-beta", type=float, help="per-position decay of the MTP loss weights")
    t.add_argument("--frozen-trunk", metavar="MODEL",
                   help="train only MTP heads on this checkpoint, its weights frozen (its tokenizer is used)")
    t.add_argument("--naive-mtp-order", action="store_true",
                   help="one backward over all heads (more memory) instead of head by head")
    t.set_defaults(func=cmd_train)

    g = sub.add_parser("generate", help="complete a prompt with the target")
    g.add_argument("--model", help="checkpoint folder (default: the shipped target)")
    g.add_argument("--prompt", help="text to continue")
    g.add_argument("--humaneval", type=int, metavar="INDEX", help="use HumanEval prompt INDEX (0..163)")
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-k", type=int)
    g.add_argument("--top-p", type=float)
    g.add_argument("--seed", type=int)
    g.add_argument("--stop", nargs="*", default=[], help="stop strings (not included in the text)")
    g.add_argument("--json", action="store_true", help="print one JSON object")
    g.add_argument("--draft", choices=["none", "draft-model", "ngram", "mtp"], default="none",
                   help="speculative decoding with this proposer (default: plain decoding; mtp: the "
                        "target's own MTP heads)")
    g.add_argument("--draft-model", help="draft model folder (default: the shipped draft)")
    g.add_argument("--heads", help="MTP heads folder for --draft mtp (default: the shipped target's heads)")
    g.add_argument("--draft-vocab", type=int, metavar="N",
                   help="--draft mtp: draft over the N token ids most frequent in the heads' training tokens "
                        "(cheaper heads; lossless; default: the full vocabulary)")
    g.add_argument("-k", type=int, help="draft tokens proposed per step (default: 4; for mtp, one per head)")
    g.add_argument("--ngram-max", type=int, default=3, help="longest n-gram matched (ngram proposer)")
    g.add_argument("--ngram-min", type=int, default=1, help="shortest n-gram matched (ngram proposer)")
    g.set_defaults(func=cmd_generate)

    b = sub.add_parser("bench", help="measure decoding speed with its conditions (same weights, same run)")
    b.add_argument("mode", choices=["plain", "spec"], nargs="?", default="plain",
                   help="plain: specdec vs transformers generate; spec: speculative methods vs plain and peers")
    b.add_argument("--model", help="checkpoint folder (default: the shipped target)")
    b.add_argument("--draft-model", help="draft model folder (default: the shipped draft)")
    b.add_argument("--methods", nargs="+", default=["draft-model", "ngram"], choices=["draft-model", "ngram"])
    b.add_argument("--ks", nargs="+", type=int, default=[1, 2, 4, 8], help="draft lengths to sweep")
    b.add_argument("--temperature", type=float, default=0.0)
    b.add_argument("--batch-size", type=int, default=1)
    b.add_argument("--no-peers", action="store_true", help="skip the transformers peers")
    b.add_argument("--dtype", choices=["stored", "float32", "bfloat16"], default="stored",
                   help="compute dtype of target and draft (default: as stored, bf16 for the shipped models)")
    b.add_argument("--prompts", type=int, default=20, help="number of HumanEval prompts")
    b.add_argument("--repeats", type=int, default=5)
    b.add_argument("--max-new-tokens", type=int, default=128)
    b.add_argument("--out", help="write the full result with its conditions as JSON here")
    b.set_defaults(func=cmd_bench)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except SpecdecError as e:
        print(f"specdec: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
