"""The multi-row matrix kernel against the machine's measured FMA peak, weights in cache.

    python docs/kernel-efficiency.py

For three of the shipped target's matrix shapes and M = 1..32 rows: the median seconds of
kernels' linear over 300 calls (after 30 warm-up calls, so the packed weights sit in L2/L3),
the matrix GFLOP/s (2 M N K / t) and their share of the FMA peak that the kernels' register-only
loop reaches on the same threads. 2 threads (torch.set_num_threads); the timed call includes
pybind's dispatch (a few microseconds, visible at small M).
"""
from __future__ import annotations

import statistics
import time

import torch

from specdec import kernels

SHAPES = {"lm_head 16384x384": (16384, 384), "gate_up 2048x384": (2048, 384), "down 384x1024": (384, 1024)}


def median_seconds(fn, repeats: int = 300, warmup: int = 30) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    torch.set_num_threads(2)
    module = kernels.compiled()
    if module is None:
        raise SystemExit("the CPU kernels are not available here")
    peak = module.fma_peak(torch.get_num_threads(), 0.5)
    print(f"FMA peak {peak:.0f} GFLOP/s ({kernels.isa()}, {torch.get_num_threads()} threads)")
    empty = torch.empty(0)
    for name, (N, K) in SHAPES.items():
        packed = kernels.pack(torch.randn(N, K).bfloat16())
        cells = []
        for M in (1, 4, 8, 16, 32):
            x = torch.randn(M, K)
            t = median_seconds(lambda: module.linear(x, packed, 0, N, empty, empty))  # format 0: bf16
            rate = 2 * M * N * K / t / 1e9
            cells.append(f"M={M}: {1e6 * t:.0f} us {rate:.0f} GFLOP/s ({100 * rate / peak:.0f}%)")
        print(f"{name}: " + " | ".join(cells))


if __name__ == "__main__":
    main()
