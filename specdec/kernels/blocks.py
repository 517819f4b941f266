"""Block-quantized matrices (llama.cpp's Q8_0, Q4_0, Q4_1, and as GGUF files store them Q5_0, Q5_1,
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS) in PyTorch: quantizing a weight (the first three), the
kernels' packed layout (quant.h, kquant.h) both ways, and the arithmetic of the quantized kernels as a
PyTorch reference that computes the very same fp32 numbers. BLOCK_FORMATS describes each format once.

A matrix (N, K) is cut along K into blocks of 32 weights; each block holds unsigned codes u and an
fp16 scale d (Q4_1, Q5_1 also an fp16 min m): Q8_0 w = d (u - 128), Q4_0 w = d (u - 8), Q4_1 and Q5_1
w = d u + m, Q5_0 w = d (u - 16). The K-quants group 256 weights in a super-block with an fp16 scale d:
Q4_K and Q5_K (also an fp16 dmin) hold 8 sub-blocks of 32 with 6-bit scale sc and min m each,
w = (d sc) u - (dmin m), u 4- or 5-bit; Q6_K holds 16 sub-blocks of 16 with an int8 scale sc each,
w = (d sc) (u - 32), u 6-bit; Q3_K likewise with a 6-bit sc - 32, w = (d sc) (u - 4), u 3-bit; Q2_K
holds 16 sub-blocks of 16 with 4-bit sc and m and an fp16 dmin, w = (d sc) u - (dmin m), u 2-bit.
IQ4_NL (blocks of 32, an fp16 d) and IQ4_XS (super-blocks of 256, an fp16 d and a 6-bit ls - 32 per
sub-block of 32) map a 4-bit code u to a level: w = d L[u], w = (d ls) L[u]. (`from_gguf`: a GGUF
tensor's raw bytes as Blocks.) An activation row is quantized to int8 (`quantize_rows`) per block of 32
for the formats of 32 and, as llama.cpp's Q8_K, per super-block of 256 for the K-quants (`width`); each
output is the sum, in order, of one term per block (per super-block) of the row's scale, the weights'
fp16 scale and an exact integer: the sub-block scales times their integer dot products are summed in
integers, so a K-quant pays its float arithmetic once per 256 weights (quant.h, kquant.h).

This module knows nothing about models or files.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

BLOCK = 32
SUPER = 256  # weights per K-quant super-block
LANES = 16


class BlockFormat(NamedTuple):
    """A quantized format, as a GGUF file stores it and as the kernels run it."""
    gguf: str    # the GGML type's name
    kernel: int  # cpu.cpp's Format (types.h: kQ8_0 ...)
    size: int    # weights per block of the file, along K: 32, or a K-quant's super-block of 256
    bytes: int   # bytes per block of the file; the kernels' panels hold 16 outputs' blocks in as many
    offset: int  # a code u stands for u - offset (times its scale [+ a min])


BLOCK_FORMATS = {
    "q8_0": BlockFormat("Q8_0", 1, BLOCK, 34, 128), "q4_0": BlockFormat("Q4_0", 2, BLOCK, 18, 8),
    "q4_1": BlockFormat("Q4_1", 3, BLOCK, 20, 0), "q5_0": BlockFormat("Q5_0", 4, BLOCK, 22, 16),
    "q5_1": BlockFormat("Q5_1", 8, BLOCK, 24, 0), "q4_k": BlockFormat("Q4_K", 5, SUPER, 144, 0),
    "q5_k": BlockFormat("Q5_K", 9, SUPER, 176, 0), "q6_k": BlockFormat("Q6_K", 6, SUPER, 210, 32),
    "iq4_nl": BlockFormat("IQ4_NL", 12, BLOCK, 18, 0), "iq4_xs": BlockFormat("IQ4_XS", 13, SUPER, 136, 0),
    "q3_k": BlockFormat("Q3_K", 14, SUPER, 110, 4), "q2_k": BlockFormat("Q2_K", 15, SUPER, 84, 0),
}
IQ4_LEVELS = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)  # IQ4_NL's and IQ4_XS's
LEVELS = {"iq4_nl": IQ4_LEVELS, "iq4_xs": IQ4_LEVELS}  # the level each code stands for (quant.h: kIq4Levels)
NIBBLES = ("q4_0", "q4_1", "iq4_nl")  # blocks of 32 whose codes are 4 bits (quant.h: 4 loads of nibbles)
QUANTIZED = ("q8_0", "q4_0", "q4_1")  # formats `quantize` makes
AS_STORED = tuple(f for f in BLOCK_FORMATS if f not in QUANTIZED)  # formats read from a file's blocks only
OFFSET = {f: b.offset for f, b in BLOCK_FORMATS.items()}  # u - OFFSET [+ m]
MINS = ("q4_1", "q5_1")  # formats of 32 with a min per block
SIX_BIT = ("q4_k", "q5_k")  # K-quants with 6-bit (sc, m) per sub-block of 32
SIXTEENS = ("q6_k", "q3_k", "q2_k")  # K-quants with sub-blocks of 16
LOW_BITS = ("q3_k", "q2_k")  # K-quants whose codes' low 2 bits are planes of bit pairs (kquant.h)
TINY = 2.0 ** -64  # quantize_rows scales a block whose largest magnitude is below this by 1 / TINY


class Blocks(NamedTuple):
    """A quantized matrix (N, K): codes (N, K) uint8; scales fp16, (N, K/32) or per super-block (N, K/256)
    (the K-quants); mins fp16 of the same shape (Q4_1, Q5_1; Q4_K's and Q5_K's dmin) or None; sub the
    K-quants' sub-block scales: Q4_K, Q5_K (N, K/32, 2) uint8 [sc, m], Q2_K (N, K/16, 2) uint8 [sc, m],
    Q6_K (N, K/16) int8, Q3_K's sc - 32 (N, K/16) int8, IQ4_XS's ls (N, K/32) int8, else None."""
    format: str
    codes: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None
    sub: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    def rows(self, ids: torch.Tensor) -> Blocks:
        """The output rows `ids` (exact: blocks run along K)."""
        return Blocks(self.format, self.codes[ids], self.scales[ids], None if self.mins is None else self.mins[ids],
                      None if self.sub is None else self.sub[ids])

    def sub_scales(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The K-quants' fp32 scales per sub-block, exact (fp16 times an integer of at most 8 bits): Q4_K,
        Q5_K (d sc, dmin m) each (N, K/32), Q2_K the same (N, K/16), Q6_K, Q3_K (d sc (N, K/16), None),
        IQ4_XS (d ls (N, K/32), None)."""
        per = self.sub.shape[1] // self.scales.shape[1]  # sub-blocks per super-block
        if self.mins is not None:
            d, dmin = (t.float().repeat_interleave(per, 1) for t in (self.scales, self.mins))
            return d * self.sub[..., 0].float(), dmin * self.sub[..., 1].float()
        return self.scales.float().repeat_interleave(per, 1) * self.sub.float(), None

    def levels(self) -> torch.Tensor:
        """(N, K) int32: the integer each code stands for, u - offset or (IQ4) its level."""
        if self.format in LEVELS:
            return torch.tensor(LEVELS[self.format], dtype=torch.int32)[self.codes.long()]
        return self.codes.int() - OFFSET[self.format]

    def dense(self) -> torch.Tensor:
        """(N, K) fp32: the weights the blocks hold, each in fp32 as gguf.quants dequantizes them:
        d (u - offset) [+ m]; Q4_K, Q5_K, Q2_K (d sc) u - (dmin m); Q6_K, Q3_K (d sc) (u - offset);
        IQ4_NL d L[u]; IQ4_XS (d ls) L[u]."""
        u = self.levels().float()
        if self.sub is not None:  # per sub-block
            scale, low = self.sub_scales()
            width = self.codes.shape[1] // scale.shape[1]
            w = scale.repeat_interleave(width, 1) * u
            return w if low is None else w - low.repeat_interleave(width, 1)
        w = self.scales.float().repeat_interleave(BLOCK, 1) * u
        return w if self.mins is None else w + self.mins.float().repeat_interleave(BLOCK, 1)


def blocking_error(format: str, K: int) -> str | None:
    """Why a matrix with rows of K values cannot be stored in `format`, or None."""
    size = BLOCK_FORMATS[format].size if format in BLOCK_FORMATS else BLOCK
    if K % size:
        return f"{format} stores rows in blocks of {size} values, and a row here has {K}"
    return None


def quantizing_error(format: str, weight: torch.Tensor) -> str | None:
    """Why `weight` (N, K) cannot be quantized to `format`, or None: rows that do not cut into blocks,
    or values that are not finite (a block holding inf or NaN quantizes to NaN or inf weights, and
    its outputs become NaN)."""
    blocking = blocking_error(format, weight.shape[-1])
    if blocking:
        return blocking + ": use bf16 (no --quantize)"
    return _nonfinite_error(weight.detach(), "weights")


def stored_error(blocks: Blocks) -> str | None:
    """Why quantized blocks as a file stores them cannot run, or None: scales or mins that are not finite."""
    return _nonfinite_error(blocks.scales, "block scales") or (
        None if blocks.mins is None else _nonfinite_error(blocks.mins, "block mins"))


def _nonfinite_error(t: torch.Tensor, what: str) -> str | None:
    if t.dtype == torch.float16 and not ((t.view(torch.int16) & 0x7C00) == 0x7C00).any():
        return None  # no fp16 with every exponent bit set (inf, NaN): the common case, read as integers
    bad = ~torch.isfinite(t)
    if not bad.any():
        return None
    first = [int(i) for i in bad.nonzero()[0]]
    return (f"{int(bad.sum())} of its {what} are not finite (the first at {tuple(first)}: {float(t[tuple(first)])}); "
            "quantized arithmetic would turn whole blocks of outputs into NaN: the weights are damaged")


def quantize(weight: torch.Tensor, format: str) -> Blocks:
    """weight (N, K), K a multiple of 32 and every value finite (quantizing_error), in `format`,
    rounded as llama.cpp's reference quantizers do (ggml-quants.c: quantize_row_q8_0_ref, _q4_0_ref,
    _q4_1_ref). A block whose scale d is so small that 1 / d overflows (|w| below ~4e-37; its fp16
    scale is 0 anyway) gets the codes of zeros, as every block whose d is 0 does."""
    N, K = weight.shape
    x = weight.detach().float().reshape(N, K // BLOCK, BLOCK)
    if format == "q8_0":
        d = x.abs().amax(-1) / 127
        q = _round_away(x * _reciprocal(d)[..., None])  # in [-127, 127]
        return Blocks(format, (q + 128).to(torch.uint8).reshape(N, K), d.half(), None)
    if format == "q4_0":
        at = x.abs().argmax(-1, keepdim=True)  # the value of largest magnitude, its sign kept
        d = x.gather(-1, at)[..., 0] / -8
        q = (x * _reciprocal(d)[..., None] + 8.5).trunc().clamp(0, 15)
        return Blocks(format, q.to(torch.uint8).reshape(N, K), d.half(), None)
    if format == "q4_1":
        lo, hi = x.amin(-1), x.amax(-1)
        d = (hi - lo) / 15
        q = ((x - lo[..., None]) * _reciprocal(d)[..., None] + 0.5).trunc().clamp(0, 15)
        return Blocks(format, q.to(torch.uint8).reshape(N, K), d.half(), lo.half())
    if format in AS_STORED:
        raise ValueError(f"{format} matrices are read from a GGUF file as stored (--quantize gguf), not made here: "
                         f"quantize to one of {', '.join(QUANTIZED)}")
    raise ValueError(f"unknown quantized format {format!r}: one of {', '.join(QUANTIZED)}")


def _reciprocal(d: torch.Tensor) -> torch.Tensor:
    """1 / d where that is finite, else 0 (d = 0, or so small that 1 / d overflows)."""
    inv = 1 / d
    return torch.where(torch.isfinite(inv), inv, torch.zeros_like(d))


def _round_away(x: torch.Tensor) -> torch.Tensor:
    """C's roundf: halves away from zero."""
    return torch.sign(x) * torch.floor(x.abs() + 0.5)


GGUF_BLOCK_BYTES = {f: b.bytes for f, b in BLOCK_FORMATS.items()}


def from_gguf(raw: np.ndarray, format: str, shape: tuple[int, int]) -> Blocks:
    """A GGUF tensor's raw blocks (bytes, in file order) of shape (N, K) as Blocks, exactly: Q8_0
    [d f16, 32 int8], Q4_0 [d f16, 16 bytes: k j in the low nibble of byte j, k 16 + j in its high],
    Q4_1 [d f16, m f16, 16 bytes], Q5_0 [d f16, 4 bytes: bit j the 5th bit of k j, 16 bytes as Q4_0],
    Q5_1 [d f16, m f16, then as Q5_0], IQ4_NL as Q4_0 (its codes the levels'); the K-quants per 256: `_q4_k`
    (Q4_K, Q5_K), `_q6_k`, `_iq4_xs`, `_low_bits` (Q3_K, Q2_K)."""
    N, K = shape
    rows = np.ascontiguousarray(raw).view(np.uint8).reshape(N, K // BLOCK_FORMATS[format].size,
                                                            GGUF_BLOCK_BYTES[format])
    if format in SIX_BIT:
        return _q4_k(rows, N, K, format)
    if format == "q6_k":
        return _q6_k(rows, N, K)
    if format == "iq4_xs":
        return _iq4_xs(rows, N, K)
    if format in LOW_BITS:
        return _low_bits(rows, N, K, format)
    scales = torch.from_numpy(rows[..., 0:2].copy().view(np.float16)[..., 0])
    if format == "q8_0":
        codes = torch.from_numpy((rows[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8))
        return Blocks(format, codes.reshape(N, K), scales, None)
    at = 4 if format in MINS else 2  # where the codes' fifth bits, or their nibbles, start
    start = at + 4 if format in ("q5_0", "q5_1") else at
    mins = None if format not in MINS else torch.from_numpy(rows[..., 2:4].copy().view(np.float16)[..., 0])
    codes = torch.from_numpy(_nibbles(rows[..., start:]))  # (N, K/32, 32): k 0-15, then 16-31
    if start > at:
        high = rows[..., at:start].copy().view(np.uint32)  # (N, K/32, 1)
        bits = (high >> np.arange(32, dtype=np.uint32)) & 1  # (N, K/32, 32)
        codes = codes | torch.from_numpy((bits << 4).astype(np.uint8))
    return Blocks(format, codes.reshape(N, K), scales, mins)


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """(..., n) bytes -> (..., 2n): the low nibbles, then the high ones."""
    return np.concatenate((packed & 0x0F, packed >> 4), axis=-1)


def _q4_k(rows: np.ndarray, N: int, K: int, format: str) -> Blocks:
    """Q4_K super-blocks (N, K/256, 144): [d f16, dmin f16, 12 bytes of 6-bit (sc, m) x 8, 128 bytes]
    where k 64c + j (j < 32) is the low nibble of byte 32c + j and k 64c + 32 + j its high nibble; Q5_K's
    (N, K/256, 176) hold 32 bytes of fifth bits before those 128 (k 32c + j's: bit c of byte j)."""
    d = rows[..., 0:2].copy().view(np.float16)[..., 0]
    dmin = rows[..., 2:4].copy().view(np.float16)[..., 0]
    s = rows[..., 4:16].astype(np.uint8)  # (N, S, 12)
    low, high, both = s[..., 0:4], s[..., 4:8], s[..., 8:12]  # sub-blocks 0-3 in 0-7; 4-7 split over all
    sc = np.concatenate((low & 63, (both & 0x0F) | ((low >> 6) << 4)), axis=-1)  # (N, S, 8)
    m = np.concatenate((high & 63, (both >> 4) | ((high >> 6) << 4)), axis=-1)
    fifth = format == "q5_k"
    qs = rows[..., 48 if fifth else 16:].reshape(N, -1, 4, 32)  # (N, S, chunk, 32)
    codes = _nibbles(qs).reshape(N, -1, 8, 32)  # (N, S, 8, 32): chunk c's k 64c .. 64c + 63 as 2 blocks
    if fifth:
        codes = codes | (((rows[..., 16:48, None] >> np.arange(8, dtype=np.uint8)) & 1) << 4).swapaxes(-1, -2)
    sub = torch.from_numpy(np.stack((sc, m), axis=-1).reshape(N, K // BLOCK, 2))
    return Blocks(format, torch.from_numpy(codes.reshape(N, K)), torch.from_numpy(d), torch.from_numpy(dmin), sub)


def _q6_k(rows: np.ndarray, N: int, K: int) -> Blocks:
    """Q6_K super-blocks (N, K/256, 210): [128 bytes low 4 bits, 64 bytes high 2 bits, 16 int8 scales,
    d f16]; in half h (128 k), k 128h + 32g + j has the low (g < 2) or high (g >= 2) nibble of low-bits
    byte 64h + 32 (g % 2) + j and bits 2g, 2g+1 of high-bits byte 32h + j."""
    S = K // SUPER
    ql = rows[..., 0:128].reshape(N, S, 2, 1, 64)
    qh = rows[..., 128:192].reshape(N, S, 2, 1, 32)
    lo = ((ql >> np.array([0, 4], dtype=np.uint8).reshape(2, 1)) & 0x0F).reshape(N, S, 2, 4, 32)
    hi = (qh >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(4, 1)) & 0x03  # (N, S, 2, 4, 32)
    codes = (lo | (hi << 4)).astype(np.uint8)
    sub = rows[..., 192:208].copy().view(np.int8).reshape(N, K // 16)
    d = rows[..., 208:210].copy().view(np.float16)[..., 0]
    return Blocks("q6_k", torch.from_numpy(codes.reshape(N, K)), torch.from_numpy(d), None, torch.from_numpy(sub))


def _low_bits(rows: np.ndarray, N: int, K: int, format: str) -> Blocks:
    """Q3_K super-blocks (N, K/256, 110): [32 bytes: the codes' third bits (k 32j + b's: bit j of byte b), 64
    bytes of their low 2 bits (k 128h + 32j + b's: bits 2j, 2j+1 of byte 32h + b), 12 bytes of 6-bit scales
    (_q3_k_scales), d f16]; Q2_K's (N, K/256, 84): [16 bytes of [sc, m] nibbles, 64 bytes of codes as Q3_K's
    low 2 bits, d f16, dmin f16]."""
    S, three = K // SUPER, format == "q3_k"
    at = 32 if three else 16
    qs = torch.from_numpy(rows[..., at:at + 64].copy()).reshape(N, S, 2, 1, 32)
    codes = ((qs >> (2 * torch.arange(4, dtype=torch.uint8)).view(4, 1)) & 3).reshape(N, K)
    raw = torch.from_numpy(rows[..., 96:108].copy() if three else rows[..., 0:16].copy())
    d = torch.from_numpy(rows[..., 108:110].copy().view(np.float16)[..., 0] if three else
                         rows[..., 80:82].copy().view(np.float16)[..., 0])
    if three:
        hmask = torch.from_numpy(rows[..., 0:32].copy()).reshape(N, S, 1, 32)
        codes = codes | (((hmask >> torch.arange(8, dtype=torch.uint8).view(8, 1)) & 1).reshape(N, K) << 2)
        return Blocks(format, codes, d, None, _q3_k_scales(raw).reshape(N, K // 16))
    dmin = torch.from_numpy(rows[..., 82:84].copy().view(np.float16)[..., 0])
    return Blocks(format, codes, d, dmin, torch.stack((raw & 15, raw >> 4), dim=-1).reshape(N, K // 16, 2))


def _q3_k_scales(raw: torch.Tensor) -> torch.Tensor:
    """Q3_K's 12 bytes of scales (..., 12) -> sc - 32 (..., 16) int8: sub-block i's low 4 bits in the low
    (i < 8) or high nibble of byte i % 8, its high 2 in bits 2g, 2g+1 of byte 8 + j (i = 4g + j)."""
    low = torch.cat((raw[..., :8] & 15, raw[..., :8] >> 4), dim=-1)
    high = torch.cat([(raw[..., 8:12] >> (2 * g)) & 3 for g in range(4)], dim=-1)
    return ((low | (high << 4)).short() - 32).to(torch.int8)


def _iq4_xs(rows: np.ndarray, N: int, K: int) -> Blocks:
    """IQ4_XS super-blocks (N, K/256, 136): [d f16, the 8 ls' high bit pairs (u16: c's in bits 2c, 2c+1),
    their low nibbles (4 bytes: c's in bits 4c..4c+3 of the 32 bits), 8 x 16 bytes: sub-block c's k j and
    16 + j in the low and high nibble of its byte j]."""
    d = rows[..., 0:2].copy().view(np.float16)[..., 0]
    ls = _iq4_xs_ls(torch.from_numpy(rows[..., 2:4].copy().view(np.int16)[..., 0]),
                    torch.from_numpy(rows[..., 4:8].copy().view(np.int32)[..., 0]))
    codes = _nibbles(rows[..., 8:].reshape(N, -1, 8, 16))  # (N, S, 8, 32)
    return Blocks("iq4_xs", torch.from_numpy(codes.reshape(N, K)), torch.from_numpy(d), None, ls.reshape(N, K // BLOCK))


def _iq4_xs_ls(high: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """IQ4_XS's scales (..., S): high bit pairs (int16), low nibbles (int32) -> ls (..., S, 8) int8, in -32..31."""
    c = torch.arange(8)
    six = ((low[..., None].long() >> (4 * c)) & 15) | (((high[..., None].long() >> (2 * c)) & 3) << 4)
    return (six - 32).to(torch.int8)


def _iq4_xs_packed(ls: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of _iq4_xs_ls: ls (..., S, 8) -> (high (..., S) int16, low (..., S) int32)."""
    six, c = ls.long() + 32, torch.arange(8)
    high = ((six >> 4) << (2 * c)).sum(-1)
    low = ((six & 15) << (4 * c)).sum(-1)
    return high.to(torch.int32).to(torch.int16), low.to(torch.int64).to(torch.int32)


# ------------------------------------------------------------------------ the kernels' layout

# per 16 outputs x 32 k: 16 outputs' blocks in the file's bytes (types.h: kPanelBlockBytes)
PANEL_BLOCK_BYTES = {f: LANES * b.bytes * BLOCK // b.size for f, b in BLOCK_FORMATS.items()}


def _per_panel(t: torch.Tensor, P: int) -> torch.Tensor:
    """(N, n[, e]) of any dtype -> (P, n, 16 x bytes): the 16 outputs of each panel side by side (zero past N)."""
    N, n = t.shape[:2]
    t = _rows_to(t.contiguous().view(torch.uint8).reshape(N, n, -1), P * LANES)
    return t.reshape(P, LANES, n, -1).transpose(1, 2).reshape(P, n, -1).contiguous()


def _rows_to(t: torch.Tensor, rows: int) -> torch.Tensor:
    """t with zero rows after its own up to `rows` (t itself, not a copy, where it has them all)."""
    return t if len(t) == rows else torch.nn.functional.pad(t, (0, 0) * (t.dim() - 1) + (0, rows - len(t)))


def _from_panel(t: torch.Tensor, N: int, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of _per_panel: (P, n, 16 x bytes) -> (N, n) of dtype."""
    P, n, width = t.shape
    t = t.reshape(P, n, LANES, width // LANES).transpose(1, 2).reshape(P * LANES, n, -1)[:N]
    return t.contiguous().view(dtype).reshape(N, n)


def _codes(u: torch.Tensor, nibbles: bool) -> torch.Tensor:
    """(P, 16, nb, 32) codes -> (P, nb, 512 or 256) as the kernels load them, 64 bytes a load, 4 bytes per
    output: bytes, load j = k 4j..4j+3; nibbles, load i = k 4i..4i+3 (low) and 16+4i..16+4i+3 (high)."""
    P, _, nb, _ = u.shape
    if not nibbles:
        return u.reshape(P, LANES, nb, 8, 4).permute(0, 2, 3, 1, 4).reshape(P, nb, 512)
    u = u.reshape(P, LANES, nb, 2, 4, 4).permute(0, 2, 3, 4, 1, 5)  # (P, nb, low/high, i, 16, 4)
    out = torch.empty(P, nb, 4, LANES, 4, dtype=torch.uint8)  # written in place: two passes, no transposed copy
    torch.bitwise_left_shift(u[:, :, 1], 4, out=out)
    out |= u[:, :, 0]
    return out.reshape(P, nb, 256)


def _uncodes(codes: torch.Tensor, nibbles: bool) -> torch.Tensor:
    """Inverse of _codes: -> (P * 16, nb * 32)."""
    P, nb, _ = codes.shape
    if not nibbles:
        return codes.reshape(P, nb, 8, LANES, 4).permute(0, 3, 1, 2, 4).reshape(P * LANES, nb * BLOCK)
    both = codes.reshape(P, nb, 4, LANES, 4).permute(0, 3, 1, 2, 4)  # (P, 16, nb, 4, 4)
    return torch.stack((both & 0x0F, both >> 4), dim=3).reshape(P * LANES, nb * BLOCK)


def _bit_pairs(u: torch.Tensor) -> torch.Tensor:
    """(P, 16, nb, 32) 2-bit values (Q6_K's codes >> 4) -> (P, nb, 128): 2 loads of 64 bytes, load h
    byte t of output n holding k = 16h + 4i + t in bits 2i, 2i+1."""
    P, _, nb, _ = u.shape
    u = u.reshape(P, LANES, nb, 2, 4, 4) << (2 * torch.arange(4, dtype=torch.uint8)).view(4, 1)
    return u.sum(dim=4, dtype=torch.uint8).permute(0, 2, 3, 1, 4).reshape(P, nb, 128)


def _unbit_pairs(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of _bit_pairs: -> (P * 16, nb * 32)."""
    P, nb, _ = packed.shape
    b = packed.reshape(P, nb, 2, LANES, 4).permute(0, 3, 1, 2, 4)[:, :, :, :, None, :]  # (P, 16, nb, 2, 1, 4)
    return ((b >> (2 * torch.arange(4, dtype=torch.uint8)).view(4, 1)) & 3).reshape(P * LANES, nb * BLOCK)


def _fifth_bits(u: torch.Tensor) -> torch.Tensor:
    """(P, 16, nb, 32) bits (Q5_0's codes >> 4) -> (P, nb, 64): one load of 64 bytes, byte t of output n
    holding in bit i that of k = 4i + t and in bit 4 + i that of k = 16 + 4i + t."""
    P, _, nb, _ = u.shape
    u = u.reshape(P, LANES, nb, 8, 4) << torch.arange(8, dtype=torch.uint8).view(8, 1)  # (h, i) -> bit 4h + i
    return u.sum(dim=3, dtype=torch.uint8).permute(0, 2, 1, 3).reshape(P, nb, 64)


def _unfifth_bits(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of _fifth_bits: -> (P * 16, nb * 32)."""
    P, nb, _ = packed.shape
    b = packed.reshape(P, nb, LANES, 1, 4).permute(0, 2, 1, 3, 4)  # (P, 16, nb, 1, 4)
    return ((b >> torch.arange(8, dtype=torch.uint8).view(8, 1)) & 1).reshape(P * LANES, nb * BLOCK)


LOW_BIT_ORDER = [0, 2, 1, 3]  # Q2_K's sub-blocks 4t.. in load t's 4 bytes: pairs of bytes 0, 2 and 1, 3 (kquant.h)


def _six_bits(c: torch.Tensor) -> torch.Tensor:
    """6-bit sub-block scales (..., 4 loads C_t, 4 bytes: Q4_K's, Q5_K's [sc, m] of sub-blocks 2t, 2t+1;
    Q3_K's sc + 32 of sub-blocks 4t..4t+3)
    -> (..., 3, 4) in their 6 bits (kquant.h): the low nibbles of C_{2u} and C_{2u+1} in load u, low and
    high, then the high bit pairs of C_t as bits 2t, 2t+1 of load 2. Computed on a load's 4 bytes as one
    int32 (every mask and shift stays within a byte)."""
    v = c.contiguous().view(torch.int32)[..., 0]  # (..., 4): load t's 4 bytes
    low, high = v & 0x0F0F0F0F, (v >> 4) & 0x03030303
    loads = (low[..., 0] | low[..., 1] << 4, low[..., 2] | low[..., 3] << 4,
             high[..., 0] | high[..., 1] << 2 | high[..., 2] << 4 | high[..., 3] << 6)
    return torch.stack(loads, dim=-1).view(torch.uint8).reshape(*c.shape[:-2], 3, 4)


def _unsix_bits(p: torch.Tensor) -> torch.Tensor:
    """Inverse of _six_bits: (..., 3, 4) -> (..., 4, 4)."""
    low = torch.stack((p[..., 0, :] & 15, p[..., 0, :] >> 4, p[..., 1, :] & 15, p[..., 1, :] >> 4), dim=-2)
    return low | torch.stack([((p[..., 2, :] >> (2 * t)) & 3) << 4 for t in range(4)], dim=-2)


def pack(blocks: Blocks) -> torch.Tensor:
    """The panels quant.h and kquant.h read, as uint8: per panel of 16 outputs (zero past N), per block of
    32 k: 16 fp16 scales, [Q4_1, Q5_1: 16 fp16 mins,] then the codes (_codes: Q8_0's bytes, Q4_x's nibbles;
    Q5_0, Q5_1 the file's 5 bits: their low 4 as nibbles, then their fifth, _fifth_bits). The K-quants per
    super-block of 256 k: 16 fp16 d, [Q4_K, Q5_K: 16 fp16 dmin,] sub-block scales, 4 bytes per output a
    load (Q4_K, Q5_K: [sc, m] of 2 sub-blocks a load, in their 6 bits as 3 loads, _six_bits; Q6_K: sc + 128
    of 4, 4 loads; Q3_K: sc + 32 of 4 a load, as Q4_K's; Q2_K: the file's [sc, m] bytes of 4, LOW_BIT_ORDER,
    4 loads), then 8 blocks of codes (Q4_K nibbles; Q5_K as Q5_0's; Q6_K the file's 6 bits: its low 4 as
    nibbles, then its high 2, _bit_pairs; Q3_K, Q2_K their low 2 bits as _bit_pairs, Q3_K's third as
    _fifth_bits)."""
    N, K = blocks.shape
    P, nb, f = -(-N // LANES), K // BLOCK, blocks.format
    u = _rows_to(blocks.codes, P * LANES).reshape(P, LANES, nb, BLOCK)

    def fifth() -> list[torch.Tensor]:  # 5-bit codes, as the file holds them (made only for the formats that have them)
        return [_codes(u & 15, nibbles=True), _fifth_bits(u >> 4)]
    if f in LOW_BITS:
        S, three = K // SUPER, f == "q3_k"
        head = [_per_panel(blocks.scales, P)] + ([] if three else [_per_panel(blocks.mins, P)])
        sub = (_six_bits((blocks.sub.short() + 32).to(torch.uint8).reshape(N, S, 4, 4)) if three else
               (blocks.sub[..., 0] | (blocks.sub[..., 1] << 4)).reshape(N, S, 4, 4)[..., LOW_BIT_ORDER])
        loads = 3 if three else 4
        head.append(_per_panel(sub.reshape(N, S * loads, 4), P).reshape(P, S, loads * 64))
        codes = [_bit_pairs(u & 3)] + ([_fifth_bits(u >> 2)] if three else [])
        return torch.cat(head + [torch.cat(codes, dim=-1).reshape(P, S, -1)], dim=-1).contiguous()
    if f == "iq4_xs":
        S = K // SUPER
        high, low = _iq4_xs_packed(blocks.sub.reshape(N, S, 8))
        head = [_per_panel(blocks.scales, P), _per_panel(low, P), _per_panel(high, P)]
        return torch.cat(head + [_codes(u, nibbles=True).reshape(P, S, -1)], dim=-1).contiguous()
    if f in SIX_BIT + ("q6_k",):
        S, six = K // SUPER, f in SIX_BIT
        sub = _six_bits(blocks.sub.reshape(N, S, 4, 4)) if six else (blocks.sub.short() + 128).to(torch.uint8)
        head = [_per_panel(blocks.scales, P)] + ([_per_panel(blocks.mins, P)] if six else [])
        loads = 3 if six else 4
        head.append(_per_panel(sub.reshape(N, S * loads, 4), P).reshape(P, S, loads * 64))
        codes = (_codes(u, nibbles=True) if f == "q4_k" else torch.cat(fifth(), dim=-1) if f == "q5_k" else
                 torch.cat((_codes(u & 15, nibbles=True), _bit_pairs(u >> 4)), dim=-1))
        codes = codes.reshape(P, S, -1)
        return torch.cat(head + [codes], dim=-1).contiguous()
    head = [_per_panel(blocks.scales, P)] + ([] if blocks.mins is None else [_per_panel(blocks.mins, P)])
    if f in ("q5_0", "q5_1"):
        return torch.cat(head + fifth(), dim=-1).contiguous()
    return torch.cat(head + [_codes(u, nibbles=f in NIBBLES)], dim=-1).contiguous()


def unpack(data: torch.Tensor, format: str, shape: tuple[int, int]) -> Blocks:
    """Inverse of pack."""
    N, K = shape
    P, nb = -(-N // LANES), K // BLOCK
    if format in LOW_BITS:
        S, three = K // SUPER, format == "q3_k"
        data = data.reshape(P, S, -1)
        scales = _from_panel(data[..., :32], N, torch.float16)
        mins = None if three else _from_panel(data[..., 32:64], N, torch.float16)
        at, loads = (32, 3) if three else (64, 4)
        sub = _from_panel(data[..., at:at + loads * 64].reshape(P, S * loads, 64), N, torch.int32).view(torch.uint8)
        sub = sub.reshape(N, S, loads, 4)
        sub = ((_unsix_bits(sub).short() - 32).to(torch.int8).reshape(N, K // 16) if three else
               torch.stack((sub[..., LOW_BIT_ORDER] & 15, sub[..., LOW_BIT_ORDER] >> 4), dim=-1).reshape(N, K // 16, 2))
        codes = data[..., at + loads * 64:].reshape(P, nb, -1)
        u = _unbit_pairs(codes[..., :128])
        if three:
            u = u | (_unfifth_bits(codes[..., 128:]) << 2)
        return Blocks(format, u[:N].contiguous(), scales, mins, sub.contiguous())
    if format == "iq4_xs":
        S = K // SUPER
        data = data.reshape(P, S, -1)
        scales = _from_panel(data[..., :32], N, torch.float16)
        ls = _iq4_xs_ls(_from_panel(data[..., 96:128], N, torch.int16), _from_panel(data[..., 32:96], N, torch.int32))
        codes = _uncodes(data[..., 128:].reshape(P, nb, -1), nibbles=True)[:N]
        return Blocks(format, codes.contiguous(), scales, None, ls.reshape(N, nb).contiguous())
    if format in SIX_BIT + ("q6_k",):
        S, k4 = K // SUPER, format in SIX_BIT
        data = data.reshape(P, S, -1)
        scales = _from_panel(data[..., :32], N, torch.float16)
        mins = _from_panel(data[..., 32:64], N, torch.float16) if k4 else None
        at, loads = (64, 3) if k4 else (32, 4)
        sub = _from_panel(data[..., at:at + loads * 64].reshape(P, S * loads, 64), N, torch.int32).view(torch.uint8)
        sub = (_unsix_bits(sub.reshape(N, S, 3, 4)).reshape(N, K // BLOCK, 2) if k4 else
               (sub.reshape(N, K // 16).short() - 128).to(torch.int8))
        codes = data[..., at + loads * 64:].reshape(P, nb, -1)
        codes = (_uncodes(codes, nibbles=True) if format == "q4_k" else
                 _uncodes(codes[..., :256], nibbles=True) | (_unfifth_bits(codes[..., 256:]) << 4) if k4 else
                 _uncodes(codes[..., :256], nibbles=True) | (_unbit_pairs(codes[..., 256:]) << 4))[:N]
        return Blocks(format, codes.contiguous(), scales, mins, sub.contiguous())
    data = data.reshape(P, nb, -1)
    scales = _from_panel(data[..., :32], N, torch.float16)
    at = 64 if format in MINS else 32  # where the codes start
    mins = _from_panel(data[..., 32:64], N, torch.float16) if format in MINS else None
    if format in ("q5_0", "q5_1"):
        codes = (_uncodes(data[..., at:at + 256], nibbles=True) | (_unfifth_bits(data[..., at + 256:]) << 4))[:N]
    else:
        codes = _uncodes(data[..., at:], nibbles=format in NIBBLES)[:N]
    return Blocks(format, codes.contiguous(), scales, mins)


# ------------------------------------------------------------------- the kernels' arithmetic

def activation_block(format: str) -> int:
    """The activations' block for a matrix in `format`: 256 for the K-quants (kquant.h), else 32."""
    return BLOCK_FORMATS[format].size


def quantize_rows(x: torch.Tensor, width: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x (M, K) fp32 per block of `width` (32, or a K-quant's 256) as quant.h's quantize_row: dx =
    max|x| / 127, q = round half to even of x (1 / dx) (0 where dx is 0). A block whose largest magnitude is
    below 2^-64 is scaled by 2^64 first (exact; where dx is a normal float this changes no bit), so that 1 / dx
    never overflows; a block holding inf or NaN gets q = 0 and dx = NaN (its row's outputs are NaN).
    Returns q (M, K) int8, dx (M, K/width) fp32, sum of q per block (M, K/width) int32."""
    M, K = x.shape
    xb = x.reshape(M, K // width, width)
    amax = xb.abs().amax(-1)  # NaN where the block holds one
    finite = torch.isfinite(amax)
    d = torch.div(amax, torch.full_like(amax, 127.0))  # IEEE divisions, as the C++ does
    live = finite & (d != 0)
    scale = torch.where(amax < TINY, torch.full_like(amax, 1 / TINY), torch.ones_like(amax))
    inv = torch.where(live, torch.div(torch.ones_like(d), torch.div(amax * scale, torch.full_like(amax, 127.0))),
                      torch.zeros_like(d))
    q = torch.where(live[..., None], torch.round((xb * scale[..., None]) * inv[..., None]), torch.zeros_like(xb))
    return q.to(torch.int8).reshape(M, K), torch.where(finite, d, torch.full_like(d, torch.nan)), \
        q.sum(-1).to(torch.int32)


def linear(x: torch.Tensor, blocks: Blocks, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., K) fp32 times the quantized matrix, transposed [+ bias]: the quantized kernels' numbers
    exactly (quant.h, kquant.h): per block (per super-block) an exact integer, then fp32 terms in
    block order (`block_terms`), one add at a time from 0, then the bias."""
    N, K = blocks.shape
    rows = x.detach().float().reshape(-1, K)
    terms = block_terms(rows, blocks)  # (K/32 or K/256, M, N)
    acc = torch.zeros(rows.shape[0], N)
    for term in terms:
        acc = acc + term
    if bias is not None:
        acc = acc + bias.detach().float()
    return acc.reshape(*x.shape[:-1], N)


def fine_linear(x: torch.Tensor, blocks: Blocks, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., K) fp32 times the quantized matrix with fine activations (kernels.Matrix.fine): x's
    product plus that of its rounding residual r = x - q dx (quantize_rows' q and dx for the format, each an
    fp32 product and difference), added, then the bias: cpu.cpp's fine_matmul exactly."""
    K, w = blocks.shape[1], activation_block(blocks.format)
    rows = x.detach().float().reshape(-1, K)
    q, dx, _ = quantize_rows(rows, w)
    residual = rows - (q.float().reshape(len(rows), -1, w) * dx[..., None]).reshape(rows.shape)
    y = linear(rows, blocks) + linear(residual, blocks)
    if bias is not None:
        y = y + bias.detach().float()
    return y.reshape(*x.shape[:-1], blocks.shape[0])


def block_terms(rows: torch.Tensor, blocks: Blocks) -> torch.Tensor:
    """(K/32, M, N) fp32, or (K/256, M, N) for the K-quants: block b's term of output n of row m, rows
    (M, K) quantized by quantize_rows per block of the format's width (q, dx, and S the exact integer
    sum over the block of the weight's u - OFFSET (or level) times q):
      Q8_0, Q4_0, Q5_0, IQ4_NL:  (d dx) S
      Q4_1, Q5_1:                (d dx) S + (m dx) qsum
    and per super-block, with sc, m the sub-blocks' integer scales and mins (Q3_K: sc - 32; IQ4_XS: ls)
    and S_i, qsum_i each sub-block's integer sum and sum of q:
      Q6_K, Q3_K, IQ4_XS:        (d dx) float(sum_i sc_i S_i)
      Q4_K, Q5_K, Q2_K:          (d dx) float(sum_i sc_i S_i) - (dmin dx) float(sum_i m_i qsum_i)
    each product rounded to fp32 in the order written (the sums of products are exact integers)."""
    N, K = blocks.shape
    f = blocks.format
    q, dx, qsum = quantize_rows(rows, activation_block(f))
    M = rows.shape[0]
    dxb = dx.T[:, :, None]  # (blocks, M, 1)
    sub = 16 if f in SIXTEENS else BLOCK  # K-quants: weights per sub-block
    # exact integer sums: every partial sum is an integer below 2^31, exact in float64
    s = torch.einsum("mbk,nbk->bmn", q.double().reshape(M, K // sub, sub),
                     blocks.levels().double().reshape(N, K // sub, sub))  # (K/sub, M, N)
    if blocks.sub is None:
        terms = (blocks.scales.float().T[:, None, :] * dxb) * s.float()
        if blocks.mins is not None:
            terms = terms + (blocks.mins.float().T[:, None, :] * dxb) * qsum.T[:, :, None].float()
        return terms
    per = SUPER // sub
    sc = blocks.sub[..., 0] if blocks.sub.dim() == 3 else blocks.sub  # (N, K/sub)
    exact = (s * sc.double().T[:, None, :]).reshape(K // SUPER, per, M, N).sum(1)  # (K/256, M, N)
    terms = (blocks.scales.float().T[:, None, :] * dxb) * exact.float()
    if blocks.mins is None:
        return terms
    sums = q.double().reshape(M, K // sub, sub).sum(-1).T[:, :, None]  # (K/sub, M, 1)
    low = (sums * blocks.sub[..., 1].double().T[:, None, :]).reshape(K // SUPER, per, M, N).sum(1)
    return terms - (blocks.mins.float().T[:, None, :] * dxb) * low.float()
