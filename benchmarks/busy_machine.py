"""Plain decoding on a busy machine: tokens/s of a model quiet, beside a second specdec process that
is decoding the same model, and beside busy loops (one per core), for specdec's default thread
policy (auto: the cores other processes leave free, bounded spinning) and for the old behaviour
(a fixed thread per core, libgomp's default spinning). Every case is a fresh process; the
competitors are started by this script, each in its own session as another user's command would be
(Linux's autogroup scheduling shares the CPU between sessions first). Run it on an otherwise quiet
machine:

    python benchmarks/busy_machine.py [--size 0.2b | --model PATH] [--seconds 4] [--policy auto|old|both]
        [--competitors none,specdec,busy-loops] [--settle 6]

Prints one line per case and the ratios to the quiet speed of the same policy, then one JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
POLICIES = {"auto (default)": {}, "old: fixed threads, default spinning":
            {"SPECDEC_BENCH_THREADS": str(os.cpu_count()), "GOMP_SPINCOUNT": "300000"}}


def decode(path: str, seconds: float) -> None:
    """The decoding process: plain greedy decoding of 16 tokens at a time for `seconds`; prints JSON."""
    from specdec import kernels
    from specdec.api import load
    from specdec.decoding.engine import plain_generate
    from specdec.decoding.sampling import SamplingConfig
    from specdec.decoding.stopping import StopRule

    if os.environ.get("SPECDEC_BENCH_THREADS"):
        kernels.set_threads(int(os.environ["SPECDEC_BENCH_THREADS"]))
    target = load(path)
    ids = [[0] + list(range(5, 40))]
    plain_generate(target.model, ids, StopRule(8), SamplingConfig())  # warm-up
    speeds, t0 = [], time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        _, metrics = plain_generate(target.model, ids, StopRule(16), SamplingConfig())
        speeds.append(15 / (metrics.total_seconds - metrics.first_token_seconds))
    print(json.dumps({"tokens_per_s": statistics.median(speeds), "windows": len(speeds),
                      "threads": kernels.thread_report()}), flush=True)


def case(path: str, env: dict, competitor: str, seconds: float, settle: float = 6) -> dict:
    run = [sys.executable, __file__, "--decode", path, "--seconds"]
    environ = {**os.environ, **env, "PYTHONPATH": str(ROOT)}
    others = []
    if competitor == "specdec":  # a second specdec process decoding, under the same policy, started first
        others.append(subprocess.Popen(run + [str(seconds + 20)], env=environ, stdout=subprocess.DEVNULL,
                                       start_new_session=True))
        time.sleep(settle)  # loaded and decoding
    elif competitor == "busy loops":
        others += [subprocess.Popen(["sh", "-c", "while :; do :; done"], start_new_session=True)
                   for _ in range(os.cpu_count() or 1)]
    try:
        out = subprocess.run(run + [str(seconds)], env=environ, capture_output=True, text=True, check=True,
                             start_new_session=True).stdout
    finally:
        for p in others:
            p.kill()
            p.wait()
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--size", default="0.2b", help="a random model of this size (bench/sizes.py)")
    p.add_argument("--model", help="this model instead of a random one of --size")
    p.add_argument("--seconds", type=float, default=4.0)
    p.add_argument("--competitors", default="none,specdec,busy-loops", help="the cases, comma-separated")
    p.add_argument("--settle", type=float, default=6.0, help="seconds the competing specdec gets to load first")
    p.add_argument("--policy", choices=["auto", "old", "both"], default="both")
    p.add_argument("--decode", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.decode:
        decode(args.decode, args.seconds)
        return
    sys.path.insert(0, str(ROOT))
    from specdec.bench import sizes
    path = args.model or str(sizes.build(args.size))
    competitors = [c.replace("-", " ") for c in args.competitors.split(",")]
    assert "none" in competitors, "the quiet case is every ratio's baseline"
    results = {}
    chosen = {name: env for name, env in POLICIES.items() if args.policy in ("both", name.split()[0].rstrip(":"))}
    for policy, env in chosen.items():
        for competitor in competitors:
            r = case(path, env, competitor, args.seconds, args.settle)
            results[policy, competitor] = r
            print(f"{policy:40s} beside {competitor:10s}: {r['tokens_per_s']:6.1f} tokens/s, threads {r['threads']}",
                  flush=True)
    summary = {policy: {c: results[policy, c]["tokens_per_s"] / results[policy, "none"]["tokens_per_s"]
                        for c in competitors if c != "none"} for policy in chosen}
    for policy, ratios in summary.items():
        beside = {"specdec": "a second specdec process", "busy loops": f"{os.cpu_count()} busy loops"}
        print(f"{policy}: " + ", ".join(f"beside {beside[c]} {r:.2f}x of quiet" for c, r in ratios.items()))
    print(json.dumps({"size": args.model or args.size, "cores": os.cpu_count(), "ratios": summary,
                      "tokens_per_s": {f"{p} | {c}": r["tokens_per_s"] for (p, c), r in results.items()}}))


if __name__ == "__main__":
    main()
