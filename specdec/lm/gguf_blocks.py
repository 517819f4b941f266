"""A GGUF file's quantized matrices as it stores them: its Q8_0, Q4_0 and Q4_1 tensors become the
kernels' Matrix of each Linear of specdec's model, block for block, never dequantized and
re-rounded. q, k and v are fused into qkv_proj and gate and up into gate_up_proj by stacking their
rows (blocks run along a row, so this is exact); llama.cpp's Llama files store the rows of q and k
in its rotary layout (pairs), which are put back in transformers' (halves) by a row permutation.

Tensors of another type (F16, Q6_K, ...) are listed by `gguf_matrices` for the caller, which runs
them from the dequantized values its loader made (and says so). This module knows nothing about
the rest of a GGUF file (its configuration, its vocabulary).
"""
from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import torch

from ..kernels import Matrix
from ..kernels.blocks import Blocks, from_gguf
from .model import LlamaForCausalLM, store_matrices

FORMATS = {"Q8_0": "q8_0", "Q4_0": "q4_0", "Q4_1": "q4_1"}  # GGUF type name -> kernels format
# GGUF tensor (in block i) -> specdec Linear, and the part of it (row order of the fused matrix)
PARTS = {"attn_q": ("self_attn.qkv_proj", 0), "attn_k": ("self_attn.qkv_proj", 1),
         "attn_v": ("self_attn.qkv_proj", 2), "attn_output": ("self_attn.o_proj", 0),
         "ffn_gate": ("mlp.gate_up_proj", 0), "ffn_up": ("mlp.gate_up_proj", 1), "ffn_down": ("mlp.down_proj", 0)}


def read_raw_tensors(path: str | Path) -> dict[str, tuple[str, tuple[int, int], np.ndarray]]:
    """Each 2-D tensor of the file: name -> (GGUF type name, (rows N, row length K), raw bytes or values)."""
    from gguf import GGUFReader
    reader = GGUFReader(str(path))
    return {t.name: (t.tensor_type.name, (int(t.shape[1]), int(t.shape[0])), t.data)
            for t in reader.tensors if len(t.shape) == 2}


def gguf_matrices(path: str | Path, cfg, rotary_pairs: bool) -> tuple[dict[str, Matrix], dict[str, str]]:
    """The matrices of the GGUF file at `path` for specdec's model of architecture `cfg`: {Linear name:
    Matrix} for those stored in a format the kernels run (every part of a fused one so), and {Linear
    name: GGUF type} for the others. rotary_pairs: q and k rows in llama.cpp's pair layout (its Llama)."""
    raw = read_raw_tensors(path)
    parts: dict[str, list] = {}
    for name, (kind, shape, data) in raw.items():
        if name in ("output.weight", "token_embd.weight"):
            if name == "output.weight" or (cfg.tie_word_embeddings and "output.weight" not in raw):
                parts["lm_head"] = [(0, kind, shape, data, None)]
            continue
        block, _, rest = name.removeprefix("blk.").partition(".")
        stem = rest.removesuffix(".weight")
        if stem in PARTS and name.startswith("blk."):
            target, order = PARTS[stem]
            heads = {"attn_q": cfg.num_attention_heads, "attn_k": cfg.num_key_value_heads}.get(stem)
            parts.setdefault(f"model.layers.{block}.{target}", []).append(
                (order, kind, shape, data, heads if rotary_pairs else None))
    given, others = {}, {}
    for name, pieces in parts.items():
        kinds = sorted({kind for _, kind, _, _, _ in pieces})
        if any(kind not in FORMATS for kind in kinds) or len(kinds) > 1:
            others[name] = "+".join(kinds)
            continue
        stored = [_blocks(kind, shape, data, heads) for _, kind, shape, data, heads in sorted(pieces, key=lambda p: p[0])]
        given[name] = Matrix.from_blocks(Blocks(stored[0].format, torch.cat([b.codes for b in stored]),
                                                torch.cat([b.scales for b in stored]),
                                                None if stored[0].mins is None else torch.cat([b.mins for b in stored])))
    return given, others


def _blocks(kind: str, shape: tuple[int, int], data: np.ndarray, heads: int | None) -> Blocks:
    """One tensor's blocks, its rows put back from llama.cpp's rotary pairs to halves when `heads` is given."""
    blocks = from_gguf(data, FORMATS[kind], shape)
    if heads is None:
        return blocks
    N = shape[0]
    # llama.cpp's converter wrote row (h, i, j) of (heads, head_dim / 2, 2) from transformers' row (h, j, i)
    written_from = torch.arange(N).reshape(heads, 2, N // heads // 2).transpose(1, 2).reshape(N)
    return blocks.rows(torch.argsort(written_from))


def store_gguf_matrices(model: LlamaForCausalLM, path: str | Path, rotary_pairs: bool) -> dict[str, str]:
    """`model` (loaded from the GGUF file at `path`, its matrices dequantized) with each matrix the
    file stores in a kernel format run as stored (gguf_matrices); the others stay dequantized on
    PyTorch operators, said once in a warning. Returns those others: {Linear name: GGUF type}."""
    given, others = gguf_matrices(path, model.config, rotary_pairs)
    if others:
        kinds = sorted(set(others.values()))
        warnings.warn(f"specdec: {Path(path).name}: {len(others)} matrices are stored as {', '.join(kinds)}, which "
                      f"the kernels do not run (they run {', '.join(FORMATS)}); those matrices and their decoder "
                      "layers run dequantized on PyTorch operators (exact, slower)", stacklevel=2)
    store_matrices(model, None, given)
    return others
