"""The multi-row matrix kernel against the machine's measured FMA peak, weights in cache; and
each format's one-row streaming rate, weights from memory.

    python benchmarks/kernel_efficiency.py [--repeats 300] [--shapes N,K ...] [--rows 1 4 8 16 32]
    python benchmarks/kernel_efficiency.py streaming [THREADS] [ISA] [FORMATS] [--shapes N,K ...] [--evict-mb 320]

streaming: for each format (bf16, q8_0, q4_1, q4_k, q6_k; FORMATS comma-separated) and the matrix
shapes of SmolLM2-135M (576x576, 1536x576, 576x1536, the 49152x576 unembedding) and
Qwen2.5-1.5B (1536x1536, 17920x1536 its gate/up, 1536x8960, the 151936x1536 unembedding), one
row times the matrix (plain decoding's matrix-vector product): the packed bytes over the least
time of 5 calls, each call on another copy of the matrix among copies of 320 MB in all (more than
the L3: every call streams its weights from memory, as a decoding step does). One thread: the
thread's CPU time (what other processes add in waits for a core left out); more: wall time.
Random codes and scales (the K-quants' blocks are made directly, not by a quantizer).

For three of the shipped target's matrix shapes and M = 1..32 rows: the median seconds of
kernels' linear over 300 calls (after 30 warm-up calls, so the packed weights sit in L2/L3),
the matrix GFLOP/s (2 M N K / t) and their share of the FMA peak that the kernels' register-only
loop reaches on the same threads. 2 threads (torch.set_num_threads); the timed call includes
pybind's dispatch (a few microseconds, visible at small M).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from specdec import kernels
from specdec.kernels import blocks

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


def in_cache(shapes: dict[str, tuple[int, int]], rows: list[int], repeats: int) -> None:
    torch.set_num_threads(2)
    module = kernels.compiled()
    if module is None:
        raise SystemExit("the CPU kernels are not available here")
    peak = module.fma_peak(torch.get_num_threads(), 0.5)
    print(f"FMA peak {peak:.0f} GFLOP/s ({kernels.isa()}, {torch.get_num_threads()} threads)")
    empty = torch.empty(0)
    for name, (N, K) in shapes.items():
        packed = kernels.pack(torch.randn(N, K).bfloat16())
        cells = []
        for M in rows:
            x = torch.randn(M, K)
            t = median_seconds(lambda: module.linear(x, packed, 0, N, empty, empty), repeats,
                               repeats // 10)  # format 0: bf16
            rate = 2 * M * N * K / t / 1e9
            cells.append(f"M={M}: {1e6 * t:.0f} us {rate:.0f} GFLOP/s ({100 * rate / peak:.0f}%)")
        print(f"{name}: " + " | ".join(cells))


STREAMING_SHAPES = [(576, 576), (1536, 576), (576, 1536), (49152, 576), (1536, 1536), (17920, 1536), (1536, 8960),
                    (151936, 1536)]


def random_matrix(format: str, N: int, K: int, g: torch.Generator) -> kernels.Matrix:
    """An (N, K) matrix in `format`: quantized from N(0, 0.05) weights, or random K-quant blocks."""
    if format not in ("q4_k", "q6_k"):
        return kernels.Matrix.store(torch.randn(N, K, generator=g) * 0.05, format)
    codes = torch.randint(0, 16 if format == "q4_k" else 64, (N, K), generator=g).to(torch.uint8)
    scales = (torch.rand(N, K // blocks.SUPER, generator=g) * 0.01).half()
    if format == "q4_k":
        sub = torch.randint(0, 64, (N, K // blocks.BLOCK, 2), generator=g).to(torch.uint8)
        return kernels.Matrix.from_blocks(blocks.Blocks(format, codes, scales, scales, sub))
    sub = torch.randint(-128, 128, (N, K // 16), generator=g).to(torch.int8)
    return kernels.Matrix.from_blocks(blocks.Blocks(format, codes, scales, None, sub))


def streaming_rate(module, matrix: kernels.Matrix, K: int, threads: int, total: int = 320 << 20,
                   repeats: int = 5) -> float:
    """GB/s of packed weights of one row times `matrix`, every call on a copy the others evicted."""
    clock = time.thread_time if threads == 1 else time.perf_counter
    copies = [matrix.data] + [matrix.data.clone() for _ in range(-(-total // matrix.nbytes) - 1)]
    x, empty, best = torch.randn(1, K), torch.empty(0), float("inf")
    for i in range(len(copies) + max(repeats, len(copies))):  # the first round warms up
        start = clock()
        module.linear(x, copies[i % len(copies)], matrix.kernel_format, matrix.shape[0], empty, empty)
        if i >= len(copies):
            best = min(best, clock() - start)
    return matrix.nbytes / best / 1e9


def streaming(threads: int, isa: str | None, formats: list[str], shapes=STREAMING_SHAPES,
              evict_mb: int = 320) -> None:
    torch.set_num_threads(threads)
    module = kernels.compiled()
    if module is None:
        raise SystemExit("the CPU kernels are not available here")
    if isa:
        module.set_isa(isa)
    module.set_fixed_threads(threads)
    g = torch.Generator().manual_seed(0)
    print(f"GB/s of weights, one row, {threads} thread(s), {module.isa()} / {module.quant_isa()}")
    for format in formats:
        cells = [f"{N}x{K} {streaming_rate(module, random_matrix(format, N, K, g), K, threads, evict_mb << 20):.1f}"
                 for N, K in shapes if format not in ("q4_k", "q6_k") or K % blocks.SUPER == 0]
        print(f"{format}: " + " | ".join(cells), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("mode", nargs="?", choices=["streaming"], help="one row's streaming rate, weights from memory")
    p.add_argument("threads", nargs="?", type=int, default=1, help="streaming: threads")
    p.add_argument("isa", nargs="?", help="streaming: the instruction set (default: the best here)")
    p.add_argument("formats", nargs="?", default="bf16,q8_0,q4_1,q4_k,q6_k", help="streaming: comma-separated")
    p.add_argument("--shapes", nargs="+", metavar="N,K", help="the matrix shapes (default: the module's)")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 32], help="rows M per call (in cache)")
    p.add_argument("--repeats", type=int, default=300, help="timed calls per cell (in cache; a tenth more warm up)")
    p.add_argument("--evict-mb", type=int, default=320, help="streaming: the copies' size in all (more than the L3)")
    args = p.parse_args()
    shapes = [tuple(int(x) for x in s.split(",")) for s in args.shapes] if args.shapes else None
    if args.mode == "streaming":
        streaming(args.threads, args.isa, args.formats.split(","), shapes or STREAMING_SHAPES, args.evict_mb)
    else:
        in_cache({f"{N}x{K}": (N, K) for N, K in shapes} if shapes else SHAPES, args.rows, args.repeats)


if __name__ == "__main__":
    main()
