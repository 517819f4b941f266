"""Time one matrix per quantized format in specdec's kernels (docs/quantized.md, "Where the pair stands").

A matrix of N x K weights (default 8960 x 1536: Qwen2.5-Coder-1.5B's gate or up half) in bf16, the
formats specdec quantizes (q8_0, q4_0, q4_1) and those read from GGUF files (q5_0, q4_k, q6_k: blocks of
random bytes with small fp16 scales, as a file may hold), times M activation rows, on each instruction
set the kernels run here, in interleaved rounds (every format once per round, so that each call
reads its matrix from memory: together they are larger than a last-level cache); prints the median
microseconds per call and the bytes each format reads.

    python docs/kquant-matrix.py [--rows 1 8] [--rounds 15] [--threads 1]
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from specdec import kernels
from specdec.kernels import blocks

GGUF_ONLY = {"q5_0": 32, "q4_k": 256, "q6_k": 256}  # weights per GGUF block
SCALES = {"q5_0": [(0, 2)], "q4_k": [(0, 2), (2, 4)], "q6_k": [(208, 210)]}  # a block's fp16 scales


def random_gguf(format: str, N: int, K: int, rng: np.random.Generator) -> blocks.Blocks:
    raw = rng.integers(0, 256, (N, K // GGUF_ONLY[format], blocks.GGUF_BLOCK_BYTES[format]), dtype=np.uint8)
    for a, b in SCALES[format]:
        raw[..., a:b] = (rng.standard_normal((*raw.shape[:2], 1)) * 1e-3).astype(np.float16).view(np.uint8)
    return blocks.from_gguf(raw.reshape(N, -1), format, (N, K))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", type=int, nargs=2, default=[8960, 1536], metavar=("N", "K"))
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    if kernels.compiled() is None:
        raise SystemExit("the CPU kernels do not run here")
    kernels.set_threads(args.threads)
    N, K = args.shape
    rng = np.random.default_rng(0)
    w = torch.from_numpy((rng.standard_normal((N, K)) * 0.05).astype(np.float32))
    matrices = {f: kernels.Matrix.store(w, f) for f in kernels.FORMATS}
    matrices.update({f: kernels.Matrix.from_blocks(random_gguf(f, N, K, rng)) for f in GGUF_ONLY})
    isas = ["avx2"] + (["avx512"] if kernels.isa() == "avx512" else [])
    for isa in isas:
        kernels.compiled().set_isa(isa)
        for M in args.rows:
            x = torch.randn(M, K)
            times: dict[str, list[float]] = {f: [] for f in matrices}
            for _ in range(args.rounds):
                for f, m in matrices.items():
                    t0 = time.perf_counter()
                    kernels.linear(x, w, m)
                    times[f].append((time.perf_counter() - t0) * 1e6)
            for f, m in matrices.items():
                print(f"{kernels.quant_isa() if isa == 'avx512' else isa:12s} M={M:<3d} {f:5s} "
                      f"{statistics.median(times[f]):9.0f} us  {m.nbytes / 1e6:6.1f} MB", flush=True)


if __name__ == "__main__":
    main()
