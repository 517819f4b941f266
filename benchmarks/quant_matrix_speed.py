"""Time one matrix per quantized format in specdec's kernels (docs/quantized.md, "Where the pair stands").

A matrix of N x K weights (default 8960 x 1536: Qwen2.5-Coder-1.5B's gate or up half) in bf16, the
formats specdec quantizes (q8_0, q4_0, q4_1) and those read from GGUF files (q5_0, q4_k, q6_k: blocks of
random bytes with small fp16 scales, as a file may hold), times M activation rows, on each instruction
set the kernels run here, in interleaved rounds (every format once per round, so that each call
reads its matrix from memory: together they are larger than a last-level cache); prints the median
microseconds per call and the bytes each format reads.

    python benchmarks/quant_matrix_speed.py [--shape N K] [--rows 1 8] [--rounds 15] [--threads 1] [--formats F,...]
        [--evict MB]
    python benchmarks/quant_matrix_speed.py --bytes-of MODEL


--formats: the formats to time (default all); `q5_0-as-q8_0` is the q5_0 matrix's blocks run as Q8_0
(its codes u - 16 as bytes, the same scales: the same bits, as Q5_0 ran before it had its own packed
layout). --evict MB: each format cycles through copies of its matrix of MB in all, so that every call
reads its copy from memory even where the formats together fit in the cache (a draft model's
matrices, which together do not). --bytes-of MODEL: the bytes of a GGUF model's packed matrices
(`load(MODEL, quantize="gguf")`: its Linear weights, which a decoding step reads, a fused matrix's
runs apart; the embedding table apart) by format, and what they took with Q5_0 at a byte a code
(Q8_0's 544 bytes per 16 outputs x 32 k, where Q5_0 now takes 352).
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
    p.add_argument("--formats", default=None, help="comma-separated, of the formats and q5_0-as-q8_0")
    p.add_argument("--evict", type=int, default=0, metavar="MB", help="copies of each matrix, MB in all")
    p.add_argument("--bytes-of", metavar="MODEL", help="print a GGUF model's packed bytes by format, and exit")
    args = p.parse_args()
    if args.bytes_of:
        return model_bytes(args.bytes_of)
    if kernels.compiled() is None:
        raise SystemExit("the CPU kernels do not run here")
    kernels.set_threads(args.threads)
    N, K = args.shape
    rng = np.random.default_rng(0)
    w = torch.from_numpy((rng.standard_normal((N, K)) * 0.05).astype(np.float32))
    names = args.formats.split(",") if args.formats else list(kernels.FORMATS) + list(GGUF_ONLY)
    matrices = {f: kernels.Matrix.store(w, f) for f in kernels.FORMATS if f in names}
    matrices.update({f: kernels.Matrix.from_blocks(random_gguf(f, N, K, rng)) for f in GGUF_ONLY
                     if f in names or f == "q5_0" and "q5_0-as-q8_0" in names})
    if "q5_0-as-q8_0" in names:
        q5 = matrices["q5_0"].blocks()
        matrices["q5_0-as-q8_0"] = kernels.Matrix.from_blocks(
            blocks.Blocks("q8_0", (q5.codes + (128 - 16)).to(torch.uint8), q5.scales, None))
    matrices = {f: matrices[f] for f in names}
    copies = {f: [m] + [kernels.Matrix(m.format, m.shape, m.data.clone())
                        for _ in range(max(0, (args.evict << 20) // m.nbytes - 1))] for f, m in matrices.items()}
    isas = ["avx2"] + (["avx512"] if kernels.isa() == "avx512" else [])
    for isa in isas:
        kernels.compiled().set_isa(isa)
        for M in args.rows:
            x = torch.randn(M, K)
            times: dict[str, list[float]] = {f: [] for f in matrices}
            for r in range(args.rounds):
                for f, m in matrices.items():
                    c = copies[f][r % len(copies[f])]
                    t0 = time.perf_counter()
                    kernels.linear(x, w, c)
                    times[f].append((time.perf_counter() - t0) * 1e6)
            first = next(iter(matrices))
            for f, m in matrices.items():
                ratio = statistics.median(a / b for a, b in zip(times[f], times[first]))
                print(f"{kernels.quant_isa() if isa == 'avx512' else isa:12s} M={M:<3d} {f:12s} "
                      f"{statistics.median(times[f]):9.0f} us  {m.nbytes / 1e6:6.1f} MB  "
                      f"{ratio:.2f}x {first}'s time (median of the rounds' ratios)", flush=True)


def model_bytes(name: str) -> None:
    from specdec import api
    from specdec.lm.model import Linear
    model = api.load(name, quantize="gguf").model
    held: dict[str, list[tuple[int, int]]] = {}  # format -> (bytes, weights) of each matrix or run
    seen = set()
    for module in model.modules():
        stored = getattr(module, "stored", None)
        if not isinstance(stored, kernels.Matrix) or id(stored.data) in seen:
            continue
        seen.add(id(stored.data))
        if not isinstance(module, Linear):  # the embedding table: a step reads a row of it, not all
            print(f"{type(module).__name__} {stored.format} {stored.shape}: {stored.nbytes / 1e6:.1f} MB (apart)")
            continue
        for part in stored.runs or [stored]:
            held.setdefault(part.format, []).append((part.nbytes, part.shape[0] * part.shape[1]))
    total, weights = (sum(v[i] for parts in held.values() for v in parts) for i in (0, 1))
    for format, parts in sorted(held.items(), key=lambda item: -sum(b for b, _ in item[1])):
        size, n = sum(b for b, _ in parts), sum(w for _, w in parts)
        print(f"{format:5s} {len(parts):4d} matrices (or runs)  {size / 1e6:8.1f} MB  {size / n:.3f} bytes a weight")
    q5 = sum(b for b, _ in held.get("q5_0", []))
    old = total - q5 + q5 * blocks.PANEL_BLOCK_BYTES["q8_0"] // blocks.PANEL_BLOCK_BYTES["q5_0"]
    print(f"all   {total / 1e6:8.1f} MB, {total / weights:.3f} bytes a weight (what a step reads); with Q5_0 "
          f"at a byte a code {old / 1e6:8.1f} MB, {old / weights:.3f}")


if __name__ == "__main__":
    main()
