"""Block-quantized matrices (llama.cpp's Q8_0, Q4_0, Q4_1) in PyTorch: quantizing a weight, the
kernels' packed layout (quant.h) both ways, and the arithmetic of the quantized kernels as a
PyTorch reference that computes the very same fp32 numbers.

A matrix (N, K) is cut along K into blocks of 32 weights; each block holds unsigned codes u and an
fp16 scale d (Q4_1 also an fp16 min m): Q8_0 w = d (u - 128), Q4_0 w = d (u - 8), Q4_1 w = d u + m.
(GGUF stores Q8_0's codes as signed int8; `from_gguf` turns a GGUF tensor's raw bytes into Blocks.)
An activation row is quantized per block of 32 to int8 (`quantize_rows`), each output is the sum
over blocks, in order, of an exact integer dot product times the two scales (quant.h).

This module knows nothing about models or files.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

BLOCK = 32
QUANTIZED = ("q8_0", "q4_0", "q4_1")
OFFSET = {"q8_0": 128, "q4_0": 8, "q4_1": 0}  # w = d (u - OFFSET) [+ m]
LANES = 16
TINY = 2.0 ** -64  # quantize_rows scales a block whose largest magnitude is below this by 1 / TINY


class Blocks(NamedTuple):
    """A quantized matrix (N, K): codes (N, K) uint8, scales (N, K/32) fp16, mins (N, K/32) fp16 (Q4_1)."""
    format: str
    codes: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    def rows(self, ids: torch.Tensor) -> Blocks:
        """The output rows `ids` (exact: blocks run along K)."""
        return Blocks(self.format, self.codes[ids], self.scales[ids], None if self.mins is None else self.mins[ids])

    def dense(self) -> torch.Tensor:
        """(N, K) fp32: the weights the blocks hold, d (u - offset) [+ m] each in fp32."""
        d = self.scales.float().repeat_interleave(BLOCK, 1)
        w = d * (self.codes.float() - OFFSET[self.format])
        return w if self.mins is None else w + self.mins.float().repeat_interleave(BLOCK, 1)


def quantizing_error(format: str, weight: torch.Tensor) -> str | None:
    """Why `weight` (N, K) cannot be quantized to `format`, or None: rows that do not cut into blocks,
    or values that are not finite (a block holding inf or NaN quantizes to NaN or inf weights, and
    its outputs become NaN)."""
    K = weight.shape[-1]
    if K % BLOCK:
        return f"{format} stores rows in blocks of {BLOCK} values, and a row here has {K}: use bf16 (no --quantize)"
    return _nonfinite_error(weight.detach(), "weights")


def stored_error(blocks: Blocks) -> str | None:
    """Why quantized blocks as a file stores them cannot run, or None: scales or mins that are not finite."""
    return _nonfinite_error(blocks.scales, "block scales") or (
        None if blocks.mins is None else _nonfinite_error(blocks.mins, "block mins"))


def _nonfinite_error(t: torch.Tensor, what: str) -> str | None:
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
    raise ValueError(f"unknown quantized format {format!r}: one of {', '.join(QUANTIZED)}")


def _reciprocal(d: torch.Tensor) -> torch.Tensor:
    """1 / d where that is finite, else 0 (d = 0, or so small that 1 / d overflows)."""
    inv = 1 / d
    return torch.where(torch.isfinite(inv), inv, torch.zeros_like(d))


def _round_away(x: torch.Tensor) -> torch.Tensor:
    """C's roundf: halves away from zero."""
    return torch.sign(x) * torch.floor(x.abs() + 0.5)


GGUF_BLOCK_BYTES = {"q8_0": 34, "q4_0": 18, "q4_1": 20}


def from_gguf(raw: np.ndarray, format: str, shape: tuple[int, int]) -> Blocks:
    """A GGUF tensor's raw blocks (bytes, in file order) of shape (N, K) as Blocks, exactly: Q8_0
    [d f16, 32 int8], Q4_0 [d f16, 16 bytes: k j in the low nibble of byte j, k 16 + j in its high],
    Q4_1 [d f16, m f16, 16 bytes]."""
    N, K = shape
    rows = np.ascontiguousarray(raw).view(np.uint8).reshape(N, K // BLOCK, GGUF_BLOCK_BYTES[format])
    scales = torch.from_numpy(rows[..., 0:2].copy().view(np.float16)[..., 0])
    if format == "q8_0":
        codes = torch.from_numpy((rows[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8))
        return Blocks(format, codes.reshape(N, K), scales, None)
    start = 2 if format == "q4_0" else 4
    mins = None if format == "q4_0" else torch.from_numpy(rows[..., 2:4].copy().view(np.float16)[..., 0])
    packed = torch.from_numpy(rows[..., start:].copy())  # (N, K/32, 16)
    codes = torch.cat((packed & 0x0F, packed >> 4), dim=-1)  # (N, K/32, 32): k 0-15, then 16-31
    return Blocks(format, codes.reshape(N, K), scales, mins)


# ------------------------------------------------------------------------ the kernels' layout

def pack(blocks: Blocks) -> torch.Tensor:
    """The panels quant.h reads, as uint8: per panel of 16 outputs (zero past N) and block of 32 k,
    16 fp16 scales, [16 fp16 mins,] then the codes, 4 consecutive k of an output per 4 bytes."""
    N, K = blocks.shape
    P, nb = -(-N // LANES), K // BLOCK
    pad = P * LANES - N

    def per_panel(t, dtype_bytes):  # (N, nb) fp16 -> (P, nb, 32) bytes
        t = torch.nn.functional.pad(t, (0, 0, 0, pad)).reshape(P, LANES, nb).transpose(1, 2).contiguous()
        return t.view(torch.uint8).reshape(P, nb, LANES * dtype_bytes)
    head = [per_panel(blocks.scales, 2)] + ([] if blocks.mins is None else [per_panel(blocks.mins, 2)])
    u = torch.nn.functional.pad(blocks.codes, (0, 0, 0, pad)).reshape(P, LANES, nb, BLOCK)
    if blocks.format == "q8_0":  # load j: k 4j..4j+3 of each output
        codes = u.reshape(P, LANES, nb, 8, 4).permute(0, 2, 3, 1, 4).reshape(P, nb, 512)
    else:  # load i: low nibbles k 4i..4i+3, high nibbles k 16+4i..16+4i+3
        u = u.reshape(P, LANES, nb, 2, 4, 4)
        both = u[:, :, :, 0] | (u[:, :, :, 1] << 4)  # (P, 16, nb, 4, 4)
        codes = both.permute(0, 2, 3, 1, 4).reshape(P, nb, 256)
    return torch.cat(head + [codes], dim=-1).contiguous()


def unpack(data: torch.Tensor, format: str, shape: tuple[int, int]) -> Blocks:
    """Inverse of pack."""
    N, K = shape
    P, nb = -(-N // LANES), K // BLOCK
    data = data.reshape(P, nb, -1)

    def from_panel(t):  # (P, nb, 32) bytes -> (N, nb) fp16
        return t.contiguous().view(torch.float16).reshape(P, nb, LANES).transpose(1, 2).reshape(P * LANES, nb)[:N]
    scales = from_panel(data[..., :32])
    mins = from_panel(data[..., 32:64]) if format == "q4_1" else None
    codes = data[..., 64 if format == "q4_1" else 32:]
    if format == "q8_0":
        u = codes.reshape(P, nb, 8, LANES, 4).permute(0, 3, 1, 2, 4)
    else:
        both = codes.reshape(P, nb, 4, LANES, 4).permute(0, 3, 1, 2, 4)  # (P, 16, nb, 4, 4)
        u = torch.stack((both & 0x0F, both >> 4), dim=3)  # (P, 16, nb, 2, 4, 4)
    return Blocks(format, u.reshape(P * LANES, K)[:N].contiguous(), scales.contiguous(),
                  None if mins is None else mins.contiguous())


# ------------------------------------------------------------------- the kernels' arithmetic

def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x (M, K) fp32 per block of 32 as quant.h's quantize_row: dx = max|x| / 127, q = round half to
    even of x (1 / dx) (0 where dx is 0). A block whose largest magnitude is below 2^-64 is scaled by
    2^64 first (exact; where dx is a normal float this changes no bit), so that 1 / dx never
    overflows; a block holding inf or NaN gets q = 0 and dx = NaN (its row's outputs are NaN).
    Returns q (M, K) int8, dx (M, K/32) fp32, sum of q (M, K/32) int32."""
    M, K = x.shape
    xb = x.reshape(M, K // BLOCK, BLOCK)
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
    exactly (quant.h): per block an exact integer dot product s, then the fp32 terms in block order."""
    N, K = blocks.shape
    rows = x.detach().float().reshape(-1, K)
    q, dx, qsum = quantize_rows(rows)
    M, nb = rows.shape[0], K // BLOCK
    # exact integer sums: every partial sum is an integer below 2^24, exact in float64
    s = torch.einsum("mbk,nbk->bmn", q.double().reshape(M, nb, BLOCK),
                     (blocks.codes.double() - OFFSET[blocks.format]).reshape(N, nb, BLOCK)).float()
    d = blocks.scales.float()  # (N, nb)
    acc = torch.zeros(M, N)
    for b in range(nb):
        term = (d[None, :, b] * dx[:, b, None]) * s[b]
        if blocks.mins is not None:
            term = term + (blocks.mins.float()[None, :, b] * dx[:, b, None]) * qsum[:, b, None].float()
        acc = acc + term
    if bias is not None:
        acc = acc + bias.detach().float()
    return acc.reshape(*x.shape[:-1], N)
