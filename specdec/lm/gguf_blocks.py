"""A GGUF file's matrices as it stores them: its Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, IQ4_NL
and IQ4_XS tensors (what a Q4_K_M, Q5_K_M or IQ4_XS file holds: kernels.blocks.BLOCK_FORMATS), and its
F16, BF16 and F32 ones, become the kernels' Matrix of each Linear of specdec's model,
block for block, never dequantized and re-rounded: how a .gguf runs unless a conversion is asked for
(`--quantize gguf` says so explicitly). q, k and v are fused into
qkv_proj and gate and up into gate_up_proj by stacking their rows (blocks run along a row, so this
is exact); the blocks come from gguf.raw_tensors, which has already put Llama's q and k rows back
in transformers' order.

A fused matrix whose parts are stored in different types (a Q4_K_M file's q and k in Q4_K with v
in Q6_K, in some layers) runs as runs of its parts' formats (kernels.Matrix.from_runs) where each
part but the last is a whole number of panels of 16 outputs. F16, BF16 and F32 matrices run as their
panels of the file's values (kernels.FLOAT_FORMATS), bit for bit in as many bytes; a fused one whose
parts are in several of these, as f32 panels (each value exact, 4 bytes a weight). A matrix of another
type (Q3_K, IQ2_XS, ...), or whose parts do not cut into panels or mix float and quantized types, keeps
the file's values rounded to bf16 (as its conversion holds them), said once in a warning. The embedding
table is the file's blocks too (a tied one, the unembedding's), each looked-up row dequantized to the
file's values exactly; of another type (a float one included), those values in fp32.

The model holds what it runs and nothing beside it (`load_as_stored`): built on the meta device and
filled tensor by tensor from the memory-mapped file, no float copy of a matrix is ever made, so it
holds about the file's size (the kernels' layout holds each format in the file's bytes); the file's
pages of each tensor are let go once it is packed (gguf_file.GGUFFile.release), so that the load never
holds the file beside its copy, and what the load freed goes back to the system. The architecture
comes from the file's metadata (gguf.config_of); nothing is written to disk. `gguf_model`: a file's
model as stored, or its conversion where one is asked for.
This module knows nothing about the rest of a GGUF file (its configuration, its vocabulary) or
about decoding.
"""
from __future__ import annotations

import re
import warnings
from pathlib import Path

import torch

from .. import kernels
from ..errors import SpecdecError
from ..kernels import Matrix
from ..kernels.blocks import BLOCK_FORMATS, from_gguf
from .arch import resolve
from .checkpoint import build_model
from .device import release_freed_memory
from .gguf import (RawTensor, check_types, check_weights, config_of, converted, dequantized, open_file,
                   raw_tensors)
from .model import LlamaForCausalLM, place, store_matrices

AS_STORED = "gguf"  # --quantize gguf: the file's blocks as stored (a .gguf's default, said explicitly)
CONVERTED = "bf16"  # --quantize bf16: the file's values rounded to bf16, its conversion (gguf.converted)
FORMATS = kernels.GGUF_FORMATS  # GGUF type name -> kernels format (BF16, F16, F32 panels; quantized blocks)
# a decoder layer's matrix (transformers' name) -> specdec's Linear holding it, and its part (row order)
PARTS = {"self_attn.q_proj": ("self_attn.qkv_proj", 0), "self_attn.k_proj": ("self_attn.qkv_proj", 1),
         "self_attn.v_proj": ("self_attn.qkv_proj", 2), "self_attn.qkv_proj": ("self_attn.qkv_proj", 0),
         "self_attn.o_proj": ("self_attn.o_proj", 0), "mlp.gate_proj": ("mlp.gate_up_proj", 0),
         "mlp.up_proj": ("mlp.gate_up_proj", 1), "mlp.gate_up_proj": ("mlp.gate_up_proj", 0),
         "mlp.down_proj": ("mlp.down_proj", 0)}


def gguf_matrices(raws: dict[str, RawTensor], release=None) -> tuple[dict[str, Matrix], dict[str, str]]:
    """The matrices of a GGUF file's tensors ({name: gguf.RawTensor}) as specdec's model holds them:
    {Linear name: Matrix} for those stored in a format the kernels run (every part of a fused one
    so), and {Linear name: GGUF type(s)} for the others. A file without output.weight ties the
    unembedding to token_embd. release: called with each tensor's data once it is packed (the file's
    pages can go: gguf_file.GGUFFile.release)."""
    parts: dict[str, list] = {}
    for name, raw in raws.items():
        if name == "lm_head.weight" or (name == "model.embed_tokens.weight" and "lm_head.weight" not in raws):
            parts["lm_head"] = [(0, raw)]
        elif (m := re.fullmatch(r"(model\.layers\.\d+)\.(.+)\.weight", name)) and m[2] in PARTS:
            linear, order = PARTS[m[2]]
            parts.setdefault(f"{m[1]}.{linear}", []).append((order, raw))
    given, others = {}, {}
    for name, pieces in parts.items():
        kinds = sorted({raw.type for _, raw in pieces})
        if any(kind not in FORMATS for kind in kinds):
            others[name] = "+".join(kinds)
            continue
        in_order = [raw for _, raw in sorted(pieces, key=lambda p: p[0])]
        floats = [FORMATS[kind] in kernels.FLOAT_FORMATS for kind in kinds]
        if kinds[1:] == []:  # one tensor (an unembedding of V rows, say), or parts of one type stacked (blocks
            # run along a row): packed a slice of rows at a time, straight from the file's bytes
            rows = sum(raw.shape[0] for raw in in_order), in_order[0].shape[1]
            given[name] = Matrix.from_gguf([raw.data for raw in in_order], FORMATS[kinds[0]], rows, release)
            continue
        if all(floats):  # parts in several float types: their values in f32, each exactly
            given[name] = Matrix.store(torch.cat([kernels.float_values(raw.data, FORMATS[raw.type], raw.shape).float()
                                                  for raw in in_order]), "f32")
        elif any(floats):  # a float part beside quantized ones: runs hold quantized formats only
            others[name] = "+".join(kinds)
            continue
        else:
            try:  # parts of different types: runs, each as stored
                given[name] = Matrix.from_runs([from_gguf(raw.data, FORMATS[raw.type], raw.shape) for raw in in_order])
            except ValueError:  # runs the kernels cannot cut into panels
                others[name] = "+".join(kinds)
                continue
        for raw in in_order if release is not None else ():
            release(raw.data)
    return given, others


def load_as_stored(path: str | Path, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                   requantize: dict[str, str] | None = None, reader=None) -> LlamaForCausalLM:
    """The model of the GGUF file at `path` (its architecture from its metadata) holding what it runs:
    each matrix the file stores in a kernel format as its blocks (gguf_matrices), the others as its
    values rounded to bf16, as its conversion holds them (said once in a warning), the
    embedding as the file's blocks where they are in a kernel format (a tied one: the unembedding's), else
    its values in fp32, the norms and biases in fp32. Built on the meta device and filled tensor by
    tensor, so that no float copy of the model is ever made: it holds about the file's size.
    requantize: matrices of some types rounded into others first (gguf.raw_tensors; a draft's). reader:
    the file already open (gguf.open_file)."""
    if dtype != torch.float32 or torch.device(device).type != "cpu":
        raise SpecdecError("a GGUF file's blocks as stored (--quantize gguf) run on the CPU in float32: drop "
                           "--dtype/--device, or --quantize")
    path = Path(path)
    reader = open_file(path) if reader is None else reader
    config = config_of(reader, path.name)
    cfg = resolve(config, where=path.name)
    check_types(reader, path.name)
    raws = {raw.name: raw for raw in raw_tensors(path, requantize, reader)}
    check_weights({name: raw.shape for name, raw in raws.items()}, cfg, path.name)
    given, others = gguf_matrices(raws, reader.release)
    if others:
        kinds = sorted(set(others.values()))
        warnings.warn(f"specdec: {path.name}: {len(others)} matrices run from the converted checkpoint's bf16 "
                      f"values, not as stored: they are stored as {', '.join(kinds)}, and the kernels run "
                      f"{', '.join(FORMATS)} (a fused matrix: its parts in these, each but the last whole panels of "
                      "16 outputs)", stacklevel=2)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    embedding = embedding_blocks(raws, reader.release)
    tied = "lm_head.weight" not in raws and "lm_head" in given
    tied_to_blocks = tied and given["lm_head"].quantized  # else a float table: the embedding holds its values
    held = set(given) | ({"model.embed_tokens"} if embedding is not None or tied_to_blocks else set())
    for name in held - ({"lm_head"} if tied and not tied_to_blocks else set()):  # filled below from their blocks
        model.get_submodule(name).weight = None  # (a tied float table's: the embedding's values, then its panels)
    model.load_hf_state_dict({name: dequantized(raw, torch.float32 if name == "model.embed_tokens.weight" else
                                                 torch.bfloat16)
                              for name, raw in raws.items() if not (name.endswith(".weight") and holder(name) in held)},
                             assign=True)
    if embedding is not None:
        model.model.embed_tokens.store(embedding)
    elif model.model.embed_tokens.weight is not None:  # the file's values, or a tied bf16 unembedding's
        model.model.embed_tokens.weight = torch.nn.Parameter(model.model.embed_tokens.weight.float(),
                                                             requires_grad=False)
    for name in others:  # bf16 values for fp32 arithmetic, as load_model holds a bf16 checkpoint's matrices
        linear = model.get_submodule(name)
        if kernels.can_store_bf16():
            linear.store("bf16")
        else:
            linear.weight = torch.nn.Parameter(linear.weight.float(), requires_grad=False)
    model = store_matrices(place(model, "cpu").eval(), None, given)
    reader.release()  # the model holds copies of everything it read (its blocks packed, the rest in fp32 or bf16)
    release_freed_memory()
    return model


def holder(name: str) -> str:
    """The module of specdec's model holding a tensor (transformers' name): q, k and v's is qkv_proj..."""
    stem = name.rpartition(".")[0]
    if (m := re.fullmatch(r"(model\.layers\.\d+)\.(.+)", stem)) and m[2] in PARTS:
        return f"{m[1]}.{PARTS[m[2]][0]}"
    return stem


def embedding_blocks(raws: dict[str, RawTensor], release=None) -> Matrix | None:
    """The file's own embedding table as its blocks, where they are in a kernel format (None for a tied
    one: the unembedding's blocks serve both); release as gguf_matrices'."""
    raw = raws["model.embed_tokens.weight"]
    if "lm_head.weight" not in raws or FORMATS.get(raw.type) not in BLOCK_FORMATS:
        return None
    return Matrix.from_gguf(raw.data, FORMATS[raw.type], raw.shape, release)


def gguf_model(file: Path, reader, dtype: torch.dtype, device: torch.device, quantize: str | None) -> LlamaForCausalLM:
    """The model of a .gguf file (see api.load; `reader` the file open, gguf.open_file): as stored on
    the CPU in float32, else its conversion in memory (gguf.converted: the file's values, matrices in
    bf16) in `dtype`, quantized where asked."""
    as_stored = quantize in (None, AS_STORED) and device.type == "cpu" and dtype == torch.float32
    if quantize == AS_STORED and not as_stored:
        raise SpecdecError(f"--quantize {AS_STORED} runs the file's blocks as stored, on the CPU in float32: drop "
                           "--dtype/--device, or ask for a conversion (--quantize bf16|q8_0|q4_0|q4_1)")
    if as_stored:
        return load_as_stored(file, reader=reader)
    config, state = converted(file, reader)
    return build_model(resolve(config, where=file.name), state, dtype, device,
                       None if quantize == CONVERTED else quantize, file)
