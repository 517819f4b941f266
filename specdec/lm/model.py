"""A Llama-style causal LM (RMSNorm, rotary positions, gated MLP, grouped-query attention) with the
variations of the families in arch.py (biases, q/k norms, partial and scaled rotary, Gemma's norm
offset, embedding scale and GELU; Gemma 3's norms around attention and MLP, local sliding-window
layers with their own rotary base, query scale and soft-capped logits), all described by one `Arch`.

Parameter names and numerics follow transformers' `LlamaForCausalLM` (and the family's own model
for the variations), so a checkpoint is interchangeable with it (see checkpoint.py). One forward
serves training (no cache, causal), prefill and decoding (KV cache, a length per row), and
verification of draft tokens or trees (explicit positions and an explicit attention mask among the
new tokens).

This module knows nothing about decoding strategies, sampling or files.
"""
from __future__ import annotations

import math
import threading
import warnings
from collections import OrderedDict
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from .. import kernels
from ..errors import SpecdecError
from .arch import Arch
from .device import backend, placement
from .kv_cache import KVCache, cache_for
from .window import Window, apply_rotary


class ModelOutput(NamedTuple):
    logits: torch.Tensor            # (B, T, V) or (B, N, V) when logits_index is given
    hidden: torch.Tensor            # (B, T, C) final hidden states (after the last norm)
    layers: dict[int, torch.Tensor]  # layer index -> (B, T, C) output of that decoder layer


class Abilities(NamedTuple):
    """What a causal LM admitted by lm.causal_lm can do, fixed when it is loaded or wrapped."""
    trees: bool        # verifies draft trees (an attention mask among the new tokens)
    layers: bool       # returns chosen decoder layers' outputs, and carries specdec's heads (MTP, EAGLE)
    draft_vocab: bool  # unembeds a subset of its vocabulary (a draft vocabulary)
    batch: bool        # more than one row per cache
    backend: str       # the operators it runs on, as the conditions name them (device.backend)


class RMSNorm(nn.Module):
    """x / rms(x) times (offset + weight): offset 0 (Llama), 1 (Gemma, whose weights start at 0)."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim) if offset == 0 else torch.zeros(dim))
        self.eps, self.offset = eps, offset

    @property
    def scale(self) -> torch.Tensor:
        """(dim,) what the normalised x is multiplied by."""
        return self.weight if self.offset == 0 else self.offset + self.weight

    def forward(self, x):
        return kernels.rms_norm(x, self.scale, self.eps)


def kernel_scale(norm: RMSNorm) -> torch.Tensor:
    """(dim,) what an RMSNorm multiplies by, as the kernels read it (fp32)."""
    return norm.scale.detach().float().contiguous()


class Linear(nn.Linear):
    """nn.Linear whose weight may be stored for inference as a kernels.Matrix (`stored`: bf16 panels
    or a quantized format) while activations are fp32 (see kernels). A quantized one holds its blocks
    only: `weight` is None, and `dense()` makes the values for whatever needs them."""
    stored: kernels.Matrix | None = None

    def forward(self, x):
        return kernels.linear(x, self.weight, self.stored, self.bias)

    def store(self, format: str = "bf16", matrix: kernels.Matrix | None = None) -> None:
        """Freeze the weight for inference in `format` (kernels.FORMATS), or as `matrix` (quantized
        weights as a file stores them). bf16: `weight` in bf16, its panels where the kernels run; a
        quantized format: the blocks alone (`weight` None)."""
        if matrix is None and format == "bf16":
            self.weight = nn.Parameter(self.weight.detach().to(torch.bfloat16), requires_grad=False)
            self.stored = kernels.Matrix.store(self.weight) if kernels.can_store_bf16() else None
            return
        self.stored = matrix if matrix is not None else kernels.Matrix.store(self.weight, format)
        self.weight = None

    def dense(self) -> torch.Tensor:
        """(N, K) the weight's values: the parameter, or a quantized matrix's blocks in fp32, exactly
        (made anew on each call)."""
        return self.weight if self.weight is not None else self.stored.dense()

    def dense_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """(n, K) the values of the output rows ids (n,), exactly (a quantized matrix's: only theirs unpacked)."""
        if self.weight is not None:
            return self.weight[ids]
        return self.stored.row_blocks(ids).dense() if self.stored.quantized else self.stored.dense()[ids]


class Embedding(nn.Embedding):
    """nn.Embedding whose table may be held as a quantized kernels.Matrix (`stored`: a tied
    unembedding's blocks, or a file's), each looked-up row dequantized exactly: `weight` is then None.
    The rows looked up last are kept dequantized, up to KEPT_BYTES: decoding looks up the same few
    thousand tokens again and again, and a row unpacked anew costs a dozen operations (a visible
    share of a self-draft run, whose table this is: docs/evidence/behind-the-code.md)."""
    stored: kernels.Matrix | None = None
    kept: OrderedDict | None = None  # id -> its (C,) row, the oldest first
    KEPT_BYTES = 4 << 20

    def forward(self, tokens):
        if self.stored is None:
            return super().forward(tokens)
        return self.kept_rows(tokens.reshape(-1)).reshape(*tokens.shape, -1)

    def kept_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """(n,) ids -> (n, C) their rows in fp32, exactly as the blocks hold them; the newest kept."""
        wanted = ids.tolist()
        with _KEPT_LOCK:
            if self.kept is None:
                self.kept = OrderedDict()
            kept, distinct = self.kept, list(dict.fromkeys(wanted))
            found = {i: kept[i] for i in distinct if i in kept}
            missing = [i for i in distinct if i not in found]
            if missing:
                made = self.stored.row_blocks(torch.tensor(missing, device=ids.device)).dense()
                found.update(zip(missing, [row.clone() for row in made]))  # rows of their own, not views of made
            for i in distinct:  # newest last
                kept[i] = found[i]
                kept.move_to_end(i)
            while len(kept) * self.embedding_dim * 4 > self.KEPT_BYTES:
                kept.popitem(last=False)
        if not wanted:
            return torch.empty(0, self.embedding_dim, device=ids.device)
        return torch.stack([found[i] for i in wanted])

    def reset_parameters(self) -> None:
        """nn.Embedding's random initialisation, skipped for a table built on the meta device to be
        filled from a file (a meta normal_ runs torch's Python reference kernels, which import the
        compiler stack on first use: 54 MB resident of modules a decoding process never needs)."""
        if not self.weight.is_meta:
            super().reset_parameters()

    def store(self, matrix: kernels.Matrix) -> None:
        self.stored, self.weight = matrix, None
        self.kept = None  # rows of another table

    def dense(self) -> torch.Tensor:
        """(V, C) the table's values (a quantized one's made anew on each call)."""
        return self.weight if self.weight is not None else self.stored.dense()


_KEPT_LOCK = threading.Lock()  # the embeddings' kept rows: a server's threads may look up at once


def frozen_linear(weight: torch.Tensor) -> Linear:
    """A Linear over a given (N, K) weight for inference, stored for the kernels where they run."""
    m = Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    m.weight = nn.Parameter(weight.detach(), requires_grad=False)
    if weight.dtype == torch.bfloat16 and kernels.can_store_bf16():
        m.stored = kernels.Matrix.store(m.weight)
    return m


def store_matrices(module: nn.Module, format: str | None = "bf16",
                   given: dict[str, kernels.Matrix] | None = None) -> nn.Module:
    """Freeze every Linear of a model or head for inference in `format` (Linear.store), those named
    in `given` as given (a GGUF file's quantized tensors; format None: the others are left as they
    are, on PyTorch operators). bf16 is exact for weights that hold bf16 values; a quantized format
    rounds them (llama.cpp's Q8_0, Q4_0, Q4_1). A tied unembedding stays tied to the embedding (which
    looks its rows up in the unembedding's blocks). Where the kernels run, every run of decoder layers
    whose matrices are all stored then becomes one kernel call (decided here, once, at load)."""
    given = given or {}
    for name, m in module.named_modules():
        if isinstance(m, Linear) and (name in given or format is not None):
            why = kernels.storing_error(m.weight, format, given.get(name))
            if why is not None:
                shape = f"{name} ({m.out_features} x {m.in_features})"
                what = f"run {shape} as stored ({given[name].format})" if name in given else \
                    f"quantize {shape} to {format}"
                raise SpecdecError(f"cannot {what}: {why}")
            m.store(format, given.get(name))
    return restack(module)


def requantize(module: nn.Module, format: str) -> int:
    """Each Linear of a model or head whose stored matrix reads more bytes a weight than `format` (a
    quantized one of kernels.FORMATS) would, stored anew in `format` from its exact values (llama.cpp's
    rounding): a GGUF file's Q5_0, Q8_0 and Q6_K matrices as Q4_0, say (a tied embedding looks its
    rows up in the new blocks). Its decoder layers are stacked anew. Returns how many were
    requantized; on the CPU in float32 only."""
    where = placement(module)
    if where.dtype != torch.float32 or where.device.type != "cpu":
        raise SpecdecError(f"quantized weights ({format}) run on the CPU in float32: this model computes in "
                           f"{where.dtype} on {where.device}")
    form = kernels.blocks.BLOCK_FORMATS[format]
    done = 0
    for name, m in module.named_modules():
        if (isinstance(m, Linear) and m.stored is not None and m.in_features % form.size == 0
                and m.stored.nbytes > m.out_features * m.in_features * form.bytes / form.size):
            m.stored, m.weight = m.stored.requantized(format), None
            done += 1
    restack(module)
    return done


def restack(module: nn.Module) -> nn.Module:
    """A tied embedding looking its rows up in the unembedding's blocks (where they are quantized) and,
    where the kernels run, every run of decoder layers whose matrices are all stored as one kernel call."""
    head = module.lm_head.stored if isinstance(module, LlamaForCausalLM) else None
    if head is not None and head.quantized and module.config.tie_word_embeddings:
        module.model.embed_tokens.store(head)
    if kernels.can_store_bf16() and placement(module).dtype == torch.float32:
        for m in module.modules():
            if isinstance(m, StackedLayers):
                m.stack_layers()
    return module


def stored_formats(module: nn.Module) -> str:
    """The formats a model's matrices are stored in, as the conditions name them: "bf16", "q8_0",
    "q4_1 + q8_0" (most matrices first)..., "unstored" where none is."""
    counts: dict[str, int] = {}
    for m in module.modules():
        if isinstance(m, Linear) and m.stored is not None:
            counts[m.stored.format] = counts.get(m.stored.format, 0) + m.in_features * m.out_features
    return " + ".join(sorted(counts, key=counts.get, reverse=True)) or "unstored"


class StackedLayers:
    """A model or layer whose decoder layers may run as one kernel call: `stack`, built by
    `stack_layers` from each layer's kernels.LayerWeights (store_matrices), or why not (`unstacked`)."""
    stack = None
    unstacked = None  # why the kernels cannot run the layers as one call, where they could have

    def stacked(self) -> list[DecoderLayer]:
        raise NotImplementedError

    def stacked_forward(self, x: torch.Tensor, window: Window, layer: int = 0, keep: list[int] = ()) -> list | None:
        """The layers over x (B, T, C) as ONE kernel call, writing the window's cache from its `layer`:
        [output, the outputs of the layers `keep`...], or None where they do not run so (no stack, no
        cache, or autograd on: training)."""
        cache = window.cache
        if self.stack is None or cache is None or torch.is_grad_enabled():
            return None
        return self.stack.forward(x.contiguous(), cache.keys, cache.values, cache.table, layer, *window.kernel_args(),
                                  list(keep),
                                  _NO_ROWS)

    def stack_layers(self) -> None:
        unstored = [name for name, m in self.named_modules() if isinstance(m, Linear) and m.stored is None
                    and name != "lm_head"]  # matrices left dequantized (store_matrices' caller says so)
        self.unstacked = kernels.cannot_stack(self.config) or (
            f"{', '.join(unstored[:3])}{' ...' if len(unstored) > 3 else ''} have no format the kernels run"
            if unstored else None)
        if self.unstacked is None:
            self.stack = kernels.stack([layer.kernel_weights() for layer in self.stacked()], self.config)
        elif not unstored:
            warnings.warn(f"specdec: {self.unstacked}; its decoder layers run on PyTorch operators (the same "
                          "arithmetic, slower)", stacklevel=4)


def place(module: nn.Module, device: torch.device | str) -> nn.Module:
    """`module` (a model or head) moved to `device` with what it derives from its config and keeps
    outside its state (inv_freq, which stays fp32 whatever dtype the module computes in)."""
    module.to(device)
    for m in module.modules():
        for name in ("inv_freq", "local_inv_freq"):
            if isinstance(getattr(m, name, None), torch.Tensor):
                setattr(m, name, getattr(m, name).to(device))
    return module


_NO_ROWS = torch.empty(0)  # a Stack's forward without an EAGLE-3 layer's 2C-wide rows


class Attention(nn.Module):
    """q, k and v come from one fused projection (one matmul instead of three per token); the
    checkpoint stores them as transformers' separate q_proj / k_proj / v_proj (see hf_state_dict),
    or fused (Phi-3). Qwen3 and Gemma 3 normalise each head's q and k (q_norm, k_norm) before rotation.
    A local layer (Gemma 3) rotates with its own frequencies and sees the last sliding_window positions."""

    def __init__(self, cfg: Arch, local: bool = False):
        super().__init__()
        self.local = local
        self.scale = None if cfg.query_pre_attn_scalar is None else cfg.attention_scale  # None: SDPA's 1/sqrt(D)
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, (self.n_heads + 2 * self.n_kv) * self.head_dim, bias=cfg.qkv_bias)
        self.o_proj = Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, cfg.norm_offset)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, cfg.norm_offset)
        self.qk_norm = cfg.qk_norm

    def forward(self, x, layer: int, window: Window):
        B, T, _ = x.shape
        qkv = self.qkv_proj(x).view(B, T, self.n_heads + 2 * self.n_kv, self.head_dim)
        qk = qkv[:, :, :self.n_heads + self.n_kv]
        if self.qk_norm:
            qk = torch.cat((self.q_norm(qk[:, :, :self.n_heads]), self.k_norm(qk[:, :, self.n_heads:])), dim=2)
        qk = apply_rotary(qk, *(window.local_rotary if self.local else window.rotary))  # q and k rotated together
        q, k, v = qk[:, :, :self.n_heads], qk[:, :, self.n_heads:], qkv[:, :, self.n_heads + self.n_kv:]
        if window.cache is not None:  # the cached keys and values with the new ones: (B, Hkv, S, D)
            k, v = window.cache.write(layer, window.slots, k, v, window.span)
            k, v = k.to(q.dtype), v.to(q.dtype)  # a cache kept at a lower precision (new_cache's dtype)
        else:
            k, v = k.transpose(1, 2), v.transpose(1, 2)
        mask = window.local_mask if self.local else window.mask
        q = q.transpose(1, 2)
        # Inference in fp32 on the CPU: in fp64, rounded back. PyTorch's attention sums a query row in an
        # order that depends on how many rows come with it, and a last-bit difference can move an
        # activation across an int8 rounding of the quantized matrices (a few hundredths on the logits):
        # in fp64 the rows agree to far below fp32's rounding, so a token's result does not depend on
        # being verified alone, in a window or in a whole sequence without a cache (the kernels'
        # row-invariance, which speculation relies on).
        if q.dtype == torch.float32 and q.device.type == "cpu" and not torch.is_grad_enabled():
            q, k, v = q.double(), k.double(), v.double()
            mask = mask.double() if mask is not None and mask.dtype != torch.bool else mask
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None and T > 1,
                                           scale=self.scale, enable_gqa=self.n_kv != self.n_heads)
        return self.o_proj(y.to(x.dtype).transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    """A gated MLP, act(gate) * up (SwiGLU; GeGLU with tanh-approximated GELU for Gemma), gate
    and up fused into one projection (stored separately in checkpoints, but for Phi-3)."""

    def __init__(self, cfg: Arch):
        super().__init__()
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.gelu = cfg.activation == "gelu_tanh"

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj((F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)) * up)


class DecoderLayer(StackedLayers, nn.Module):
    """One layer; its `stack` (StackedLayers) runs it alone as one kernel call, used with a cache.
    With sandwich norms (Gemma 3), as transformers names them: post_attention_layernorm normalises the
    attention's output, pre_ and post_feedforward_layernorm the MLP's input and output; otherwise
    post_attention_layernorm is the MLP's input norm (Llama's name). local: a sliding-window layer."""

    def __init__(self, cfg: Arch, local: bool = False):
        super().__init__()
        self.config = cfg
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset)
        self.self_attn = Attention(cfg, local)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset)
        self.mlp = MLP(cfg)
        self.sandwich = cfg.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset)
            self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset)

    def stacked(self) -> list[DecoderLayer]:
        return [self]

    def kernel_weights(self) -> kernels.LayerWeights:
        """The layer as the kernels read it (its matrices stored: store_matrices)."""
        return kernel_layer(self.input_layernorm.scale, self.self_attn, self.post_attention_layernorm.scale, self.mlp)

    def forward(self, x, layer: int, window: Window):
        """x (B, T, C); `layer` indexes the window's cache."""
        stacked = self.stacked_forward(x, window, layer)
        if stacked is not None:
            return stacked[0]
        if self.sandwich:
            x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), layer, window))
            return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        x = x + self.self_attn(self.input_layernorm(x), layer, window)
        return x + self.mlp(self.post_attention_layernorm(x))


def kernel_layer(norm1: torch.Tensor | None, attn: Attention, norm2: torch.Tensor, mlp: MLP) -> kernels.LayerWeights:
    """A decoder layer's parts as the kernels read them (their matrices stored); norm1 None: EAGLE-3's
    layer, whose q/k/v read 2C-wide rows (kernels.LayerWeights)."""
    return kernels.LayerWeights(
        norm1, attn.qkv_proj.stored, attn.qkv_proj.bias, attn.o_proj.stored, attn.o_proj.bias, norm2,
        mlp.gate_up_proj.stored, mlp.gate_up_proj.bias, mlp.down_proj.stored, mlp.down_proj.bias,
        attn.q_norm.scale if attn.qk_norm else None, attn.k_norm.scale if attn.qk_norm else None)


class Trunk(nn.Module):
    """Named like transformers' `LlamaModel` (`model.layers.0...`)."""

    def __init__(self, cfg: Arch):
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i in cfg.local_layers) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset)
        self.embedding_scale = cfg.hidden_size ** 0.5 if cfg.scale_embeddings else None

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """(B, T) -> (B, T, C): the embeddings, scaled where the architecture scales them (Gemma)."""
        x = self.embed_tokens(tokens)
        if self.embedding_scale is None:
            return x
        return x * torch.tensor(self.embedding_scale, dtype=x.dtype)


class LlamaForCausalLM(StackedLayers, nn.Module):
    """Its `stack` (StackedLayers) runs all its decoder layers as one kernel call, used with a cache."""

    def __init__(self, cfg: Arch):
        super().__init__()
        self.config = cfg
        self.model = Trunk(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # derived from the config, not a weight: kept out of the state dict and in fp32
        self.inv_freq = cfg.inv_freq()
        self.local_inv_freq = cfg.local_inv_freq()  # the local layers' (Gemma 3), None where none is

    @property
    def abilities(self) -> Abilities:
        return Abilities(trees=True, layers=True, draft_vocab=True, batch=True, 
                         backend=backend(placement(self).device, placement(self).dtype,
                                         self.stack, self.unstacked, stored_formats(self)))

    def stacked(self) -> list[DecoderLayer]:
        return list(self.model.layers)

    def new_cache(self, batch_size: int, max_len: int | None = None, dtype: torch.dtype | None = None,
                  tokens: int | None = None) -> KVCache:
        """A cache of up to `batch_size` rows of `max_len` positions (default the context) over a pool of
        `tokens` positions (default enough for every row's whole length; memory is taken as rows grow);
        dtype: its keys' and values' (default: the model's compute dtype; bfloat16 halves the bytes,
        the entries rounded to it)."""
        cfg = self.config
        return cache_for(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, batch_size,
                         max_len or cfg.max_position_embeddings, dtype or placement(self).dtype,
                         placement(self).device, tokens)

    def token_embeddings(self, tokens: torch.Tensor) -> torch.Tensor:
        """(B, T) -> (B, T, C): the embedding's rows, unscaled: what a draft head reads."""
        return self.model.embed_tokens(tokens)

    def drafts_in_one_call(self, head=None) -> bool:
        """Whether `draft_block` can run: this model's decoder layers, or `head`'s, stacked for the kernels."""
        return (self if head is None else head.layer).stack is not None

    def draft_block(self, ids: torch.Tensor, cache: KVCache, positions: torch.Tensor | None, columns: torch.Tensor,
                    unembedding: kernels.Matrix, vocab_ids: torch.Tensor, logits: bool, head=None,
                    prev: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """A drafter's step as ONE kernel call (kernels.draft_block; `drafts_in_one_call` says whether it
        can run): ids (B, W) embedded by this model, through its decoder layers and final norm, or
        through `head`'s (an EAGLE head: its layer, rotary and norm, its input proj([embed_norm(emb);
        hidden_norm(prev)]) with prev (B, W, C), or for the eagle3 layout that concatenation itself
        into q/k/v and prev as the residual), then `unembedding` over the ids vocab_ids (N,) at
        columns (B, m). Returns the argmax as target ids (B, m), the logits (B, m, N) when `logits`
        is asked, and the layers' output at the columns (B, m, C); `cache` advances by W."""
        layers, inv_freq, norm = (self, self.inv_freq, self.model.norm) if head is None else (
            head.layer, head.inv_freq, head.norm)
        fuse = None if head is None else (prev, kernel_scale(head.embed_norm), kernel_scale(head.hidden_norm),
                                          head.proj.stored if head.layout == "specdec" else None)
        cache.reserve(ids.shape[1])
        table = self.model.embed_tokens.weight  # the kernels read a float table's rows as they are
        if table is None or self.model.embedding_scale is not None:  # held as blocks, or scaled: the rows first
            table = self.model.embed(ids).reshape(-1, self.config.hidden_size).contiguous()
            ids = torch.arange(table.shape[0], device=ids.device).view(ids.shape)
        out = kernels.draft_block(layers.stack, table, ids, cache.keys, cache.values, cache.table,
                                  cache.lengths, positions, inv_freq, columns, kernel_scale(norm), norm.eps,
                                  unembedding, vocab_ids, logits, fuse)
        cache.advance(ids.shape[1])
        return out

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                cache: KVCache | None = None, attention_mask: torch.Tensor | None = None,
                output_layers: tuple[int, ...] = (), logits_index: torch.Tensor | None = None,
                unembedding: nn.Module | None = None) -> ModelOutput:
        """tokens (B, T); positions (B, T), default: each row's cache length + 0..T-1.

        With a cache, the new keys/values are written after each row's committed length and
        the length advances by T (roll back with `cache.rollback`). attention_mask (B, T, T)
        is the visibility among the new tokens (tree verification); default causal.
        logits_index (B, N) picks the positions to unembed (default: all T); unembedding replaces
        lm_head (a draft vocabulary's rows of it, say).
        """
        B, T = tokens.shape
        longest = cache.longest if cache is not None else 0  # committed entries of the longest row
        last = longest + T - 1 if positions is None else int(positions.max())
        if last >= self.config.max_position_embeddings:
            raise ValueError(f"position {last} is beyond the model's context of "
                             f"{self.config.max_position_embeddings} tokens")
        x = self.model.embed(tokens)  # (B, T, C)
        window = Window(positions, self.inv_freq, x.dtype, cache, attention_mask, T, self.config.attention_factor,
                        self.local_inv_freq, self.config.sliding_window)
        if cache is not None:
            cache.reserve(T)
        keep = sorted(i for i in set(output_layers) if 0 <= i < len(self.model.layers))
        stacked = self.stacked_forward(x, window, 0, keep)
        if stacked is not None:
            x, *kept = stacked
            layers = dict(zip(keep, kept))
        else:
            layers = {}
            for i, layer in enumerate(self.model.layers):
                x = layer(x, i, window)
                if i in output_layers:
                    layers[i] = x
        if cache is not None:
            cache.advance(T)
        hidden = self.model.norm(x)
        picked = hidden if logits_index is None else hidden.gather(
            1, logits_index[..., None].expand(-1, -1, hidden.shape[-1]))
        head = self.lm_head if unembedding is None else unembedding
        logits = head(picked)
        if (cap := self.config.final_logit_softcapping) is not None:
            logits = torch.tanh(logits / cap) * cap
        return ModelOutput(logits, hidden, layers)

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The weights under transformers' names for the architecture: q/k/v and gate/up split
        (kept fused where the checkpoint fuses them: Phi-3), a tied lm_head left out."""
        if blocks := self.held_as_blocks():
            raise SpecdecError(f"{blocks[0]} holds its weights as quantized blocks only: a model whose matrices run "
                               "quantized is not saved as a checkpoint; save the model it was loaded from")
        cfg, out = self.config, {}
        q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        for name, value in self.state_dict().items():
            stem, _, kind = name.rpartition(".")  # kind: weight or bias
            if cfg.fused_checkpoint:
                out[name] = value
            elif stem.endswith("self_attn.qkv_proj"):
                for part, w in zip(("q", "k", "v"), value.split([q, kv, kv])):
                    out[f"{stem.removesuffix('qkv_proj')}{part}_proj.{kind}"] = w
            elif stem.endswith("mlp.gate_up_proj"):
                base = stem.removesuffix("gate_up_proj")
                out[f"{base}gate_proj.{kind}"], out[f"{base}up_proj.{kind}"] = value.chunk(2)
            else:
                out[name] = value
        if cfg.tie_word_embeddings:
            out.pop("lm_head.weight")
        return out

    def load_hf_state_dict(self, state: dict[str, torch.Tensor], assign: bool = False) -> None:
        """Inverse of hf_state_dict; raises KeyError/RuntimeError on missing or mis-shaped weights.
        assign=True adopts the given tensors (for a model built on the meta device); otherwise the
        parameters are copied into, so an optimizer holding them stays valid."""
        fused = {}
        for name, value in state.items():
            stem, _, kind = name.rpartition(".")
            if self.config.fused_checkpoint or stem.endswith(("self_attn.k_proj", "self_attn.v_proj", "mlp.up_proj")):
                if self.config.fused_checkpoint:
                    fused[name] = value
                continue
            if stem.endswith("self_attn.q_proj"):
                base = stem.removesuffix("q_proj")
                value = torch.cat([value, state[f"{base}k_proj.{kind}"], state[f"{base}v_proj.{kind}"]])
                name = f"{base}qkv_proj.{kind}"
            elif stem.endswith("mlp.gate_proj"):
                base = stem.removesuffix("gate_proj")
                value = torch.cat([value, state[f"{base}up_proj.{kind}"]])
                name = f"{base}gate_up_proj.{kind}"
            fused[name] = value
        tied = self.config.tie_word_embeddings and "model.embed_tokens.weight" in fused  # not when held as blocks
        if tied:
            fused["lm_head.weight"] = fused["model.embed_tokens.weight"]
        self.load_state_dict(fused, strict=True, assign=assign)
        if tied:
            self.lm_head.weight = self.model.embed_tokens.weight

    def held_as_blocks(self) -> list[str]:
        """The Linear and Embedding modules whose weight is held as quantized blocks only (`weight` None)."""
        return [name for name, m in self.named_modules() if isinstance(m, (Linear, Embedding)) and m.weight is None]

    def num_parameters(self) -> int:
        """Distinct weights, those held as blocks included; a tied lm_head counts once even when stored
        apart in bf16."""
        sizes = {name: p.numel() for name, p in self.named_parameters()}
        sizes.update({f"{name}.weight": math.prod(self.get_submodule(name).stored.shape)
                      for name in self.held_as_blocks()})
        tied = self.config.tie_word_embeddings
        return sum(n for name, n in sizes.items() if not (tied and name == "lm_head.weight"))
