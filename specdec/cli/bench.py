"""`specdec bench`: the benchmark of every decoding method, and its plain, serve and structured modes."""
from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

from ..errors import SpecdecError
from .common import add_target_arguments, add_threads_argument, drafter, set_threads, torch_dtype, tree_widths


def cmd_bench(args) -> None:
    from .. import inputs

    inputs.bench(args.prompts, args.repeats, args.max_new_tokens, args.ks, args.temperatures, args.batch_sizes)
    set_threads(args.threads)
    if args.mode == "serve":
        bench_serve_mode(args)
        return
    if args.mode == "structured":
        bench_structured_mode(args)
        return
    if args.quantize and args.mode != "plain":
        raise SpecdecError("--quantize measures plain decoding (`specdec bench plain --quantize ...`); the other "
                           "benchmarks run the checkpoints as stored")
    if args.mode == "plain":
        bench_plain_mode(args)
        return
    from ..bench.report import console_report, write_report
    from ..bench.runner import run_bench

    paths = {"draft-model": args.draft_model, "hybrid": args.draft_model, "mtp": args.heads, "eagle": args.eagle,
             "eagle-hybrid": args.eagle, "block": args.block}
    result = run_bench(bench_plan(args), args.model, {name: path for name, path in paths.items() if path},
                       torch_dtype(args.dtype), command=["specdec", *sys.argv[1:]], device=args.device,
                       skip_misfits=args.methods is None)
    out = write_report(result, args.out or ("runs/bench-quick" if args.quick else "runs/bench"))
    print(console_report(result, out))


def bench_serve_mode(args) -> None:
    """`specdec bench serve`: the server against the same engine offline, plain vs the first of --methods."""
    from .. import inputs
    from ..api import default_k, load
    from ..bench.serve import bench_serve, format_serve, write

    for c in args.clients:
        inputs.integer("--clients values", c, low=1)
    method = (args.methods or ["draft-model"])[0]
    target = load(args.model, dtype=torch_dtype(args.dtype), device=args.device)
    proposer = drafter(target, method, args.draft_model, args.heads)
    k = args.ks[0] if args.ks else default_k(proposer)
    serve_args = ["--device", args.device, "--draft", method, "-k", str(k)]
    serve_args += ["--dtype", args.dtype] if args.dtype else []
    serve_args += ["--threads", str(args.server_threads)] if args.server_threads else []
    serve_args += ["--draft-model", args.draft_model] if args.draft_model and method == "draft-model" else []
    serve_args += ["--heads", args.heads] if args.heads and method == "mtp" else []
    result = bench_serve(target, method, serve_args, proposer, k, args.clients, args.prompts or 32,
                         args.max_new_tokens or 64, args.repeats or 3)
    result["command"] = ["specdec", *sys.argv[1:]]  # with conditions.software.git: how to rerun it
    print(format_serve(result))
    if args.out:
        write(result, args.out)


def bench_structured_mode(args) -> None:
    """`specdec bench structured`: the structured workload, plain constrained decoding against forced
    drafts alone and with each of --methods (default ngram), at each of --ks (default 6) and auto."""
    from ..api import load
    from ..bench.structured import bench_structured, configurations, format_structured, spread_tasks

    target = load(args.model, dtype=torch_dtype(args.dtype), device=args.device)
    drafters = {m: drafter(target, m, args.draft_model, args.heads) for m in args.methods or ["ngram"]}
    result = bench_structured(target, configurations(drafters, args.ks or [6], not args.no_auto),
                              args.temperatures or [0.0, 1.0], spread_tasks(args.prompts), args.max_new_tokens or 96,
                              args.repeats or 1)
    result["conditions"]["command"] = ["specdec", *sys.argv[1:]]
    print(format_structured(result))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "structured.json").write_text(json.dumps(result, indent=1))


def bench_plain_mode(args) -> None:
    """`specdec bench plain`: specdec's plain decoding against transformers and llama.cpp, and the bandwidth."""
    from ..bench.plain import bench_plain, format_plain

    if args.device != "cpu":
        raise SpecdecError("`specdec bench plain` compares CPU engines (specdec's kernels, transformers, "
                           "llama.cpp) and the memory bandwidth; on a GPU run `specdec bench --device cuda`")
    if args.size and args.model:
        raise SpecdecError("give --model or --size, not both")
    sized = args.size is not None  # smaller defaults: a model of a real size decodes slowly on a CPU
    result = bench_plain(args.model, n_prompts=args.prompts or (2 if sized else 10),
                         repeats=args.repeats or (3 if sized else 5),
                         max_new_tokens=args.max_new_tokens or (32 if sized else 128),
                         dtype=torch_dtype(args.dtype), llama_cpp=not args.no_llamacpp, size=args.size,
                         quantize=args.quantize)
    result["command"] = ["specdec", *sys.argv[1:]]  # with conditions.software.git: how to rerun it
    print(format_plain(result))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "plain.json").write_text(json.dumps(result, indent=1))


def bench_plan(args):
    """The quick or the full plan, or the grid the sweep options name; other options override."""
    from ..bench.runner import full_plan, grid_plan, quick_plan

    if any(v is not None for v in (args.workloads, args.ks, args.temperatures, args.batch_sizes)):
        plan = grid_plan(args.workloads or ["humaneval"], args.ks or [2], args.temperatures or [0.0],
                         args.batch_sizes or [1], args.prompts or 4, peers=not args.no_peers)
    else:
        plan = quick_plan() if args.quick else full_plan()
    prompts = args.prompts  # validated: None (the plan's) or >= 1
    if args.auto_only and args.no_auto:
        raise SpecdecError("--auto-only runs each method with -k auto alone; --no-auto leaves it out: give one of them")
    trees = {} if args.trees is None else {"trees": tuple(args.trees)}
    only = {"ks": (), "trees": ()} if args.auto_only else {}
    changes = {"cells": tuple(dataclasses.replace(c, prompts=c.prompts if prompts is None else prompts,
                                                  peer_k=None if args.no_peers or args.auto_only else c.peer_k,
                                                  auto=args.auto_only or c.auto and not args.no_auto,
                                                  **{**trees, **only})
                              for c in plan.cells)}
    for name in ("methods", "repeats", "max_new_tokens"):
        value = getattr(args, name)
        if value is not None:
            changes[name] = tuple(value) if name == "methods" else value
    if args.no_moe:
        changes["moe"] = None
    return dataclasses.replace(plan, **changes)


def add_bench_parser(sub) -> None:
    b = sub.add_parser("bench", help="measure every decoding method with its conditions (same weights, same run)",
                       description="Plain decoding, the draft model, n-gram and MTP proposers and transformers' "
                                   "peers on the same prompts, interleaved; writes bench.json, report.md and plots.")
    b.add_argument("mode", choices=["all", "plain", "serve", "structured"], nargs="?", default="all",
                   help="all: the benchmark (default); plain: specdec vs transformers generate (and llama.cpp "
                        "when installed) and bandwidth; serve: `specdec serve` vs the same engine offline, plain vs "
                        "speculative (the first of --methods, default draft-model; k: the first of --ks), at "
                        "--clients; "
                        "structured: the JSON-Schema workload (docs/structured.md), plain constrained decoding vs "
                        "forced drafts alone and with each of --methods (default ngram) at --ks (default 6) and auto, "
                        "--temperatures (default 0 1), --prompts tasks of 54 (default all)")
    b.add_argument("--clients", nargs="+", type=int, default=[1, 4, 16],
                   help="serve: concurrent streaming clients (and offline batch rows)")
    b.add_argument("--server-threads", type=int, help="serve: the server's kernel threads (default: torch's)")
    b.add_argument("--quick", action="store_true",
                   help="the short plan: plain, the drafters that fit and transformers' peers, ~100 generations; "
                        "each cell first says how long it will take here (default: the full plan)")
    b.add_argument("--out", help="folder for bench.json, report.md and the PNG plots "
                                 "(default: runs/bench or runs/bench-quick)")
    add_target_arguments(b, quantize=True)
    b.add_argument("--draft-model", help="draft model folder, .gguf file or packaged name, for draft-model and "
                                         "hybrid (default: the shipped draft)")
    b.add_argument("--heads", help="MTP heads folder (default: the shipped heads)")
    b.add_argument("--eagle", metavar="HEAD",
                   help="EAGLE head folder, for eagle and eagle-hybrid (default: the shipped head)")
    b.add_argument("--block", metavar="HEAD", help="block head folder (default: the shipped head)")
    b.add_argument("--methods", nargs="+",
                   help="speculative methods, each of which must fit the target (default: every drafter that fits "
                        "it, the others named with the reason: draft-model parallel ngram mtp suffix eagle block "
                        "self hybrid eagle-hybrid)")
    b.add_argument("--workloads", nargs="+", help="run this grid instead of the plan: humaneval, stdlib-tests, "
                                                  "random-chars")
    b.add_argument("--ks", nargs="+", type=int, help="grid: draft lengths k")
    b.add_argument("--trees", nargs="+", type=tree_widths, metavar="W1,W2,..",
                   help="static draft trees each method also runs in every cell (default: the plan's)")
    b.add_argument("--no-auto", action="store_true", help="leave out the -k auto configuration of each method")
    b.add_argument("--auto-only", action="store_true",
                   help="each method with -k auto alone (no fixed k, trees or peers): -k auto against plain decoding "
                        "in every cell of the plan, the report saying where it falls below 0.95x")
    b.add_argument("--temperatures", nargs="+", type=float, help="grid: sampling temperatures (0 = greedy)")
    b.add_argument("--batch-sizes", nargs="+", type=int, help="grid: batch sizes")
    b.add_argument("--prompts", type=int, help="prompts per cell (overrides the plan)")
    b.add_argument("--repeats", type=int, help="interleaved repeats (default 3)")
    b.add_argument("--max-new-tokens", type=int, help="new tokens per prompt (overrides the plan)")
    b.add_argument("--no-peers", action="store_true", help="skip transformers' generate, assisted and prompt lookup")
    b.add_argument("--no-moe", action="store_true", help="skip the MoE vs dense verify-cost check")
    b.add_argument("--size", metavar="NAME",
                   help="plain: 0.2b or 1b (bench/sizes.py), a Llama-shaped model of this size with random weights, "
                        "built once into ~/.cache/specdec/sizes (instead of --model); adds the verify curve and the "
                        "cost model's predictions for each draft design at that size")
    b.add_argument("--no-llamacpp", action="store_true",
                   help="plain: skip llama.cpp (run when llama-cpp-python is installed: pip install -e '.[llamacpp]')")
    add_threads_argument(b)
    b.set_defaults(func=cmd_bench)

