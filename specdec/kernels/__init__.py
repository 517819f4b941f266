"""Compiled CPU kernels for decoding with bf16-stored weights and fp32 arithmetic (see cpu.cpp).

Built from cpu.cpp by the machine's C++ compiler the first time they are needed (about a minute,
once per machine and source version; cached under ~/.cache/specdec). `linear`, `rms_norm` and
`cached_attention` fall back to PyTorch operators computing the same arithmetic wherever the
kernels cannot run (no AVX2, no compiler, gradients needed, other dtypes or devices), so a result
never depends on whether they were built beyond fp32 rounding; the fused layer halves are called
only where `fusable` says they run. SPECDEC_KERNELS=0 turns the kernels off.
"""
from __future__ import annotations

import functools
import hashlib
import os
import sys
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

SOURCE = Path(__file__).with_name("cpu.cpp")


@functools.cache
def compiled():
    """The built extension module, or None where it cannot be used here."""
    if os.environ.get("SPECDEC_KERNELS", "1") == "0":
        return None
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return None
    from torch.utils import cpp_extension
    tag = hashlib.sha256(SOURCE.read_bytes() + torch.__version__.encode()).hexdigest()[:16]
    build = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "specdec" / "kernels" / tag
    build.mkdir(parents=True, exist_ok=True)
    if not any(build.glob("*.so")):
        print("specdec: building the CPU kernels (once per machine, about a minute)...", file=sys.stderr)
    try:
        return cpp_extension.load(name="specdec_cpu", sources=[str(SOURCE)], build_directory=str(build),
                                  extra_cflags=["-O3", "-mavx2", "-mfma", "-fopenmp"],
                                  extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as e:  # no compiler or ninja: slower, same results
        warnings.warn(f"specdec: the CPU kernels could not be built ({type(e).__name__}: ...{str(e)[-600:]}); using "
                      "PyTorch operators instead, which are slower for bf16 weights. Install a C++ "
                      "compiler (g++) to get them, or set SPECDEC_KERNELS=0 to silence this.")
        return None


def _inference(*tensors: torch.Tensor) -> bool:
    return all(t.device.type == "cpu" for t in tensors) and not (
        torch.is_grad_enabled() and any(t.requires_grad for t in tensors))


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w.T for nn.Linear's weight layout; fp32 x with bf16 w is computed in fp32."""
    if w.dtype == x.dtype:
        return F.linear(x, w)
    if x.dtype == torch.float32 and w.dtype == torch.bfloat16 and _inference(x, w) and compiled():
        return compiled().linear(x, w)
    return F.linear(x, w.to(x.dtype))


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == w.dtype == torch.float32 and _inference(x, w) and compiled():
        return compiled().rms_norm(x, w, eps)
    return F.rms_norm(x, x.shape[-1:], w, eps)


def cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                     groups: int) -> torch.Tensor:
    """Attention of q (B, Hkv, G*T, D) — the G query heads sharing a key/value head along the
    query axis — over the cached k, v (B, Hkv, S, D); mask (B, 1, T, S) additive or None."""
    if (q.dtype == k.dtype == v.dtype == torch.float32 and q.shape[-1] % 8 == 0 and _inference(q, k, v)
            and compiled()):
        empty = q.new_empty(0)
        return compiled().attention(q, k, v, empty if mask is None else mask[:, 0], q.shape[-1] ** -0.5)
    if mask is not None:
        B, _, T, S = mask.shape
        mask = mask[:, :, None].expand(B, 1, groups, T, S).reshape(B, 1, groups * T, S)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def fusable(x: torch.Tensor, *matrices: torch.Tensor) -> bool:
    """Whether a decoder layer on x with these matrices runs as the two fused kernels below."""
    return (x.dtype == torch.float32 and all(w.dtype == torch.bfloat16 for w in matrices)
            and _inference(x, *matrices) and compiled() is not None)


def attention_input(x, norm_w, eps, w_qkv, cos, sin, rotated_heads: int, head_dim: int) -> torch.Tensor:
    """rms_norm(x) @ w_qkv.T with rotary positions on the first `rotated_heads` heads: (..., E)."""
    return compiled().attention_input(x, norm_w, eps, w_qkv, cos, sin, rotated_heads, head_dim)


def attention_output_mlp(x, y, w_o, norm_w, eps, w_gate_up, w_down) -> torch.Tensor:
    """x2 + SwiGLU(rms_norm(x2)) where x2 = x + y @ w_o.T: the rest of a decoder layer."""
    return compiled().attention_output_mlp(x, y, w_o, norm_w, eps, w_gate_up, w_down)


def can_store_bf16() -> bool:
    """Whether fp32 arithmetic on bf16-stored matrices runs at kernel speed here."""
    return compiled() is not None
