"""A Llama-architecture causal LM (RMSNorm, rotary positions, SwiGLU, grouped-query attention).

Parameter names and numerics follow transformers' `LlamaForCausalLM`, so a checkpoint is
interchangeable with it (see checkpoint.py). One forward serves training (no cache, causal),
prefill and decoding (KV cache, a length per row), and verification of draft tokens or trees
(explicit positions and an explicit attention mask among the new tokens).

This module knows nothing about decoding strategies, sampling or files.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from functools import cached_property
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from . import kernels
from .kv_cache import KVCache


@dataclass
class LlamaConfig:
    vocab_size: int = 8192
    hidden_size: int = 512
    intermediate_size: int = 1408
    num_hidden_layers: int = 8
    num_attention_heads: int = 8
    num_key_value_heads: int = 2
    head_dim: int = 64
    max_position_embeddings: int = 1024
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    bos_token_id: int = 1
    eos_token_id: int = 2

    def __post_init__(self):
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "LlamaConfig":
        known = {f.name for f in fields(cls)}
        kw = {k: v for k, v in d.items() if k in known}
        if "rope_theta" not in kw and isinstance(d.get("rope_parameters"), dict):
            kw["rope_theta"] = d["rope_parameters"].get("rope_theta", cls.rope_theta)
        if "head_dim" not in kw or kw["head_dim"] is None:
            kw["head_dim"] = d["hidden_size"] // d["num_attention_heads"]
        if "num_key_value_heads" not in kw or kw["num_key_value_heads"] is None:
            kw["num_key_value_heads"] = d["num_attention_heads"]
        return cls(**kw)


class ModelOutput(NamedTuple):
    logits: torch.Tensor            # (B, T, V) or (B, N, V) when logits_index is given
    hidden: torch.Tensor            # (B, T, C) final hidden states (after the last norm)
    layers: dict[int, torch.Tensor]  # layer index -> (B, T, C) output of that decoder layer


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return kernels.rms_norm(x, self.weight, self.eps)


class Linear(nn.Linear):
    """nn.Linear whose weight may be stored in bf16 while activations are fp32 (see kernels);
    `packed` holds the weight's panels for the kernels once it is frozen in bf16."""
    packed: torch.Tensor | None = None

    def forward(self, x):
        return kernels.linear(x, self.weight, self.packed)


def frozen_linear(weight: torch.Tensor) -> Linear:
    """A Linear over a given (N, K) weight for inference, packed for the kernels where they run."""
    m = Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    m.weight = nn.Parameter(weight.detach(), requires_grad=False)
    if weight.dtype == torch.bfloat16 and kernels.can_store_bf16():
        m.packed = kernels.pack(m.weight)
    return m


def store_matrices_bf16(module: nn.Module) -> nn.Module:
    """Keep every Linear weight in bf16 while the rest computes in fp32: exact for weights that
    hold bf16 values (a bf16 checkpoint), half the memory. Where the kernels run, the matrices
    are packed for them and every run of decoder layers becomes one kernel call (decided here,
    once, at load). For inference: the bf16 matrices are frozen."""
    for m in module.modules():
        if isinstance(m, Linear):
            m.weight = nn.Parameter(m.weight.detach().to(torch.bfloat16), requires_grad=False)
            if kernels.can_store_bf16():
                m.packed = kernels.pack(m.weight)
    if kernels.can_store_bf16() and compute_dtype(module) == torch.float32:
        for m in module.modules():
            if isinstance(m, DecoderLayer):
                m.stack = kernels.stack([m], m.config)
            elif isinstance(m, LlamaForCausalLM):
                m.stack = kernels.stack(m.model.layers, m.config)
    return module


def compute_dtype(module: nn.Module) -> torch.dtype:
    """The dtype a model or head computes in (activations, KV cache): that of its norms, since
    its matrices may be stored in bf16 for fp32 arithmetic."""
    return next(m.weight.dtype for m in module.modules() if isinstance(m, RMSNorm))


def place(module: nn.Module, device: torch.device | str) -> nn.Module:
    """`module` (a model or head) moved to `device` with what it derives from its config and keeps
    outside its state (inv_freq, which stays fp32 whatever dtype the module computes in)."""
    module.to(device)
    for m in module.modules():
        if isinstance(getattr(m, "inv_freq", None), torch.Tensor):
            m.inv_freq = m.inv_freq.to(device)
    return module


def device_of(module: nn.Module) -> torch.device:
    """The device a model or head lives on (that of its first parameter)."""
    return next(module.parameters()).device


def inverse_frequencies(head_dim: int, theta: float) -> torch.Tensor:
    # explicit device: also correct when the model is built under a meta-device context
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device="cpu") / head_dim))


def rotary(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype):
    """cos, sin of shape (B, T, 1, D) for integer positions (B, T)."""
    freqs = positions[..., None].float() * inv_freq  # (B, T, D/2)
    emb = torch.cat((freqs, freqs), dim=-1)[:, :, None]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Window:
    """The new tokens of one forward, shared by every layer: their positions (B, T), the KV cache
    they join (None: training, causal over the input) and which new tokens each one sees (tree
    (B, T, T) bool, itself included; None: causal). The kernels read just these; the PyTorch
    path's rotary tables, cache slots and additive mask are computed on first use."""

    def __init__(self, positions: torch.Tensor | None, inv_freq: torch.Tensor, dtype: torch.dtype,
                 cache: KVCache | None = None, tree: torch.Tensor | None = None, width: int | None = None):
        """positions None: each row's cache length (0 without a cache) + 0..width-1."""
        self.given_positions, self.inv_freq, self.dtype, self.cache, self.tree = positions, inv_freq, dtype, cache, tree
        self.width = positions.shape[1] if positions is not None else width

    @cached_property
    def positions(self) -> torch.Tensor:
        if self.given_positions is not None:
            return self.given_positions
        if self.cache is None:
            return torch.arange(self.width, device=self.inv_freq.device)[None]
        return self.cache.lengths[:, None] + torch.arange(self.width, device=self.inv_freq.device)[None]

    def first(self, T: int) -> "Window":
        """The window of the first T tokens (training only: no cache)."""
        return Window(self.positions[:, :T], self.inv_freq, self.dtype)

    def kernel_args(self) -> tuple:
        """What a kernels.Stack forward reads after (x, k_cache, v_cache, layer0)."""
        tree = _EMPTY_TREE if self.tree is None else self.tree.contiguous()
        positions = _EMPTY_POSITIONS if self.given_positions is None else self.given_positions.contiguous()
        return self.cache.lengths, positions, self.inv_freq, tree

    @cached_property
    def rotary(self) -> tuple[torch.Tensor, torch.Tensor]:
        return rotary(self.positions, self.inv_freq, self.dtype)

    @cached_property
    def slots(self):
        return self.cache.slots(self.width)

    @cached_property
    def span(self) -> int:
        return self.cache.longest + self.width

    @cached_property
    def mask(self) -> torch.Tensor | None:
        """Additive (B, 1, T, S) with a cache; the tree as a boolean (B, 1, T, T) without."""
        if self.cache is None:
            return None if self.tree is None else self.tree[:, None]
        # one new token after equal-length rows sees the whole span: no mask to build or apply
        if self.width > 1 or self.tree is not None or self.slots.start is None:
            return attention_mask_for(self.cache, self.width, self.span, self.tree, self.dtype)
        return None


_EMPTY_TREE = torch.empty(0, dtype=torch.bool)
_EMPTY_POSITIONS = torch.empty(0, dtype=torch.long)


class Attention(nn.Module):
    """q, k and v come from one fused projection (one matmul instead of three per token); the
    checkpoint stores them as transformers' separate q_proj / k_proj / v_proj (see hf_state_dict)."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, (self.n_heads + 2 * self.n_kv) * self.head_dim, bias=False)
        self.o_proj = Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=False)

    def forward(self, x, layer: int, window: Window):
        B, T, _ = x.shape
        qkv = self.qkv_proj(x).view(B, T, self.n_heads + 2 * self.n_kv, self.head_dim)
        qk = apply_rotary(qkv[:, :, :self.n_heads + self.n_kv], *window.rotary)  # q and k rotated together
        q, k, v = qk[:, :, :self.n_heads], qk[:, :, self.n_heads:], qkv[:, :, self.n_heads + self.n_kv:]
        if window.cache is not None:  # the cached keys and values with the new ones: (B, Hkv, S, D)
            k, v = window.cache.write(layer, window.slots, k, v, window.span)
        else:
            k, v = k.transpose(1, 2), v.transpose(1, 2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k, v,
                                           attn_mask=window.mask, is_causal=window.mask is None and T > 1,
                                           enable_gqa=self.n_kv != self.n_heads)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    """SwiGLU with gate and up fused into one projection (stored separately in checkpoints)."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    stack = None  # the layer as one kernel call (store_matrices_bf16), used with a cache

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.config = cfg
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, layer: int, window: Window):
        """x (B, T, C); `layer` indexes the window's cache."""
        cache = window.cache
        if self.stack is not None and cache is not None and not torch.is_grad_enabled():
            return self.stack.forward(x.contiguous(), cache.keys, cache.values, layer, *window.kernel_args(), [])[0]
        x = x + self.self_attn(self.input_layernorm(x), layer, window)
        return x + self.mlp(self.post_attention_layernorm(x))


class Trunk(nn.Module):
    """Named like transformers' `LlamaModel` (`model.layers.0...`)."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


def attention_mask_for(cache: KVCache, num_new: int, span: int, tree_mask: torch.Tensor | None,
                       dtype: torch.dtype):
    """Additive mask (B, 1, T, S): 0 for the committed prefix of each row and the allowed new
    tokens, -inf elsewhere (built once per forward, shared by every layer).

    tree_mask (B, T, T), if given, says which new tokens each new token may see (itself
    included); by default it is causal.
    """
    lengths = cache.lengths[:, None, None]                                # (B, 1, 1)
    key = torch.arange(span, device=lengths.device)[None, None, :]        # (1, 1, S)
    query = torch.arange(num_new, device=lengths.device)[None, :, None]   # (1, T, 1)
    rel = key - lengths                                                   # (B, 1, S) index among new tokens
    if tree_mask is None:
        new = (rel >= 0) & (rel <= query)
    else:
        B = tree_mask.shape[0]
        gathered = tree_mask.gather(2, rel.clamp(0, num_new - 1).expand(B, num_new, span))
        new = (rel >= 0) & (rel < num_new) & gathered
    visible = ((rel < 0) | new)[:, None]
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(~visible, float("-inf"))


class LlamaForCausalLM(nn.Module):
    stack = None  # the decoder layers as one kernel call (store_matrices_bf16), used with a cache

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.config = cfg
        self.model = Trunk(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # derived from the config, not a weight: kept out of the state dict and in fp32
        self.inv_freq = inverse_frequencies(cfg.head_dim, cfg.rope_theta)

    def new_cache(self, batch_size: int, max_len: int | None = None) -> KVCache:
        cfg = self.config
        return KVCache(cfg.num_hidden_layers, batch_size, cfg.num_key_value_heads, cfg.head_dim,
                       max_len or cfg.max_position_embeddings, dtype=compute_dtype(self),
                       device=self.lm_head.weight.device)

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
        x = self.model.embed_tokens(tokens)  # (B, T, C)
        window = Window(positions, self.inv_freq, x.dtype, cache, attention_mask, T)
        if self.stack is not None and cache is not None and not torch.is_grad_enabled():
            cache.check_room(T)
            keep = sorted(i for i in set(output_layers) if 0 <= i < len(self.model.layers))
            x, *kept = self.stack.forward(x, cache.keys, cache.values, 0, *window.kernel_args(), keep)
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
        return ModelOutput(head(picked), hidden, layers)

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The weights under transformers' `LlamaForCausalLM` names (fused projections split)."""
        cfg, out = self.config, {}
        q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        for name, value in self.state_dict().items():
            if name.endswith("self_attn.qkv_proj.weight"):
                stem = name.removesuffix("qkv_proj.weight")
                for part, w in zip(("q", "k", "v"), value.split([q, kv, kv])):
                    out[f"{stem}{part}_proj.weight"] = w
            elif name.endswith("mlp.gate_up_proj.weight"):
                stem = name.removesuffix("gate_up_proj.weight")
                out[f"{stem}gate_proj.weight"], out[f"{stem}up_proj.weight"] = value.chunk(2)
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
            if name.endswith(("self_attn.k_proj.weight", "self_attn.v_proj.weight", "mlp.up_proj.weight")):
                continue
            if name.endswith("self_attn.q_proj.weight"):
                stem = name.removesuffix("q_proj.weight")
                value = torch.cat([value, state[stem + "k_proj.weight"], state[stem + "v_proj.weight"]])
                name = stem + "qkv_proj.weight"
            elif name.endswith("mlp.gate_proj.weight"):
                stem = name.removesuffix("gate_proj.weight")
                value = torch.cat([value, state[stem + "up_proj.weight"]])
                name = stem + "gate_up_proj.weight"
            fused[name] = value
        if self.config.tie_word_embeddings:
            fused["lm_head.weight"] = fused["model.embed_tokens.weight"]
        self.load_state_dict(fused, strict=True, assign=assign)
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def num_parameters(self) -> int:
        """Distinct parameters; a tied lm_head counts once even when stored apart in bf16."""
        tied = self.config.tie_word_embeddings
        return sum(p.numel() for name, p in self.named_parameters() if not (tied and name == "lm_head.weight"))
