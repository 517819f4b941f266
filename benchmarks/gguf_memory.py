"""Resident memory of a GGUF file run as stored, stage by stage: the runtime alone (Python, torch,
specdec, the CPU kernels loaded, transformers' tokenizer classes imported: code, the same for every
file), the load (api.load; with --split its two steps, the model by gguf_blocks.load_as_stored and
the tokenizer by gguf.tokenizer, holding the open file between them as api.load does), then a plain
greedy decode. Per stage: the peak while it ran (VmHWM, reset before it through /proc/self/clear_refs)
and what stays resident after it (VmRSS, split into anonymous memory, RssAnon, and the file's mapped
pages, RssFile), each in MB and as a multiple of the file's size.

    python benchmarks/gguf_memory.py FILE.gguf [--tokens 32] [--split] [--profile N]

--profile N: the load's cProfile instead, its N largest cumulative shares (timings on a busy machine
are not worth more than their shares). Linux only (/proc). Prints a table, then one JSON line.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

FIELDS = ("VmHWM", "VmRSS", "RssAnon", "RssFile")


def status() -> dict[str, int]:
    """This process's memory figures (bytes) from /proc/self/status."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in FIELDS:
                out[key] = int(rest.split()[0]) * 1024
    return out


def reset_peak() -> None:
    """VmHWM from now on (Linux: writing 5 to clear_refs resets the peak resident set size)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("file", type=Path)
    parser.add_argument("--tokens", type=int, default=32, help="tokens of the plain greedy decode")
    parser.add_argument("--split", action="store_true", help="the model and the tokenizer as two stages (api.load's "
                        "steps, each measured), not api.load as one")
    parser.add_argument("--profile", type=int, default=0, help="profile the load instead: its N largest shares")
    args = parser.parse_args()

    from specdec import api, kernels  # first, as the command line imports it (before torch: specdec/openmp.py)
    from specdec.lm import gguf
    from specdec.lm.device import release_freed_memory
    from specdec.lm.gguf_blocks import load_as_stored
    import torch

    kernels.compiled()
    # the code a GGUF's load runs, imported before anything of the file is read: the runtime's own memory
    from transformers import PreTrainedTokenizerFast  # noqa: F401
    from transformers.integrations.gguf import gguf_tokenizer_mapping  # noqa: F401
    size = args.file.stat().st_size
    if args.profile:
        profile = cProfile.Profile()
        profile.enable()
        api.load(args.file)
        profile.disable()
        text = io.StringIO()
        stats = pstats.Stats(profile, stream=text).sort_stats("cumulative")
        total = stats.total_tt
        stats.print_stats(args.profile)
        print(text.getvalue())
        shares = {f"{Path(file).name}:{line}({name})": round(cumulative / total, 3)
                  for (file, line, name), (_, _, _, cumulative, _) in stats.stats.items()}
        top = dict(sorted(shares.items(), key=lambda kv: -kv[1])[:args.profile])
        print(json.dumps({"file": args.file.name, "profile_shares": top}))
        return
    release_freed_memory()
    stages = {}

    def stage(name: str) -> None:
        release_freed_memory()
        stages[name] = status()
        reset_peak()

    stage("runtime")
    if args.split:
        reader = gguf.open_file(args.file)
        model = load_as_stored(args.file, reader=reader)
        stage("model")
        tokenizer = gguf.tokenizer(args.file, reader)
        stage("tokenizer")
        del reader  # as api.load returns: the file's mapping goes with the reader
        loaded = api.Loaded(model, tokenizer, args.file)
    else:
        loaded = api.load(args.file)
    stage("loaded")
    result = api.generate(loaded, ["def fibonacci(n):"], max_new_tokens=args.tokens)
    stage("decode")
    base = stages["runtime"]["VmRSS"]
    print(f"{args.file.name}: {size / 1e6:.0f} MB; runtime baseline {base / 1e6:.0f} MB "
          f"(Python, torch, specdec, the kernels, transformers' tokenizers); {len(result.tokens[0])} tokens decoded")
    print(f"{'stage':<10} {'peak MB':>8} {'RSS MB':>8} {'anon MB':>8} {'file MB':>8} {'peak/file':>9} "
          f"{'RSS/file':>8} {'(RSS-base)/file':>15}")
    for name, s in stages.items():
        print(f"{name:<10} {s['VmHWM'] / 1e6:8.0f} {s['VmRSS'] / 1e6:8.0f} {s['RssAnon'] / 1e6:8.0f} "
              f"{s['RssFile'] / 1e6:8.0f} {s['VmHWM'] / size:9.2f} {s['VmRSS'] / size:8.2f} "
              f"{(s['VmRSS'] - base) / size:15.2f}")
    print(json.dumps({"file": args.file.name, "file_bytes": size, "threads": torch.get_num_threads(),
                      "pid": os.getpid(), "stages": stages}))


if __name__ == "__main__":
    main()
