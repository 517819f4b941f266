"""What one forward's new tokens attend to, shared by every layer (`Window`): their positions and
rotary tables, the KV cache they join, which new tokens each sees (causal, or a draft tree), and the
local layers' sliding window (Gemma 3). This module knows nothing about layers or weights."""
from __future__ import annotations

from functools import cached_property

import torch

from .kv_cache import KVCache


def rotary(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype, factor: float = 1.0):
    """cos, sin of shape (B, T, 1, R) for integer positions (B, T), R = 2 len(inv_freq), times
    `factor` (yarn's attention factor; 1 elsewhere)."""
    freqs = positions[..., None].float() * inv_freq  # (B, T, R/2)
    emb = torch.cat((freqs, freqs), dim=-1)[:, :, None]
    if factor != 1.0:
        return (emb.cos() * factor).to(dtype), (emb.sin() * factor).to(dtype)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x, cos, sin):
    """x (..., D) rotated in its first R = cos.shape[-1] dims (all of them but for partial rotary)."""
    R = cos.shape[-1]
    if R < x.shape[-1]:
        return torch.cat((apply_rotary(x[..., :R], cos, sin), x[..., R:]), dim=-1)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Window:
    """The new tokens of one forward, shared by every layer: their positions (B, T), the KV cache
    they join (None: training, causal over the input) and which new tokens each one sees (tree
    (B, T, T) bool, itself included; None: causal). The kernels read just these; the PyTorch
    path's rotary tables, cache slots and additive mask are computed on first use, and so are the
    local layers' (Gemma 3: their own inverse frequencies, keys further than `sliding_window`
    positions behind a query masked)."""

    def __init__(self, positions: torch.Tensor | None, inv_freq: torch.Tensor, dtype: torch.dtype,
                 cache: KVCache | None = None, tree: torch.Tensor | None = None, width: int | None = None,
                 rotary_factor: float = 1.0, local_inv_freq: torch.Tensor | None = None,
                 sliding_window: int | None = None):
        """positions None: each row's cache length (0 without a cache) + 0..width-1; rotary_factor:
        on cos and sin (Arch.attention_factor); local_inv_freq and sliding_window: the local layers'."""
        self.given_positions, self.inv_freq, self.dtype, self.cache, self.tree = positions, inv_freq, dtype, cache, tree
        self.rotary_factor = rotary_factor
        self.local_inv_freq, self.sliding_window = local_inv_freq, sliding_window
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
        return Window(self.positions[:, :T], self.inv_freq, self.dtype, rotary_factor=self.rotary_factor)

    def kernel_args(self) -> tuple:
        """What a kernels.Stack forward reads after (x, k_cache, v_cache, layer0)."""
        tree = _EMPTY_TREE if self.tree is None else self.tree.contiguous()
        positions = _EMPTY_POSITIONS if self.given_positions is None else self.given_positions.contiguous()
        return self.cache.lengths, positions, self.inv_freq, tree

    @cached_property
    def rotary(self) -> tuple[torch.Tensor, torch.Tensor]:
        return rotary(self.positions, self.inv_freq, self.dtype, self.rotary_factor)

    @cached_property
    def local_rotary(self) -> tuple[torch.Tensor, torch.Tensor]:
        return rotary(self.positions, self.local_inv_freq, self.dtype)

    @cached_property
    def local_mask(self) -> torch.Tensor | None:
        """The mask of a local layer: `mask`, with every key sliding_window or more positions behind
        its query hidden (additive (B, 1, T, S) with a cache; boolean (B or 1, 1, T, T) without)."""
        W, T = self.sliding_window, self.width
        if self.cache is None:
            if T <= W:
                return self.mask
            pos = self.positions                                          # (B, T)
            seen = (torch.ones(T, T, dtype=torch.bool, device=pos.device).tril()[None] if self.tree is None
                    else self.tree)                                       # (B or 1, T, T)
            near = (pos[:, :, None] - pos[:, None, :]) < W                # (B, T, T)
            return (seen & near)[:, None]
        if self.span <= W:  # no key lies a window behind any query
            return self.mask
        lengths = self.cache.lengths[:, None]                                      # (B, 1)
        key = torch.arange(self.span, device=lengths.device)[None]                 # (1, S)
        rel = key - lengths                                                         # (B, S) index among new tokens
        new = (rel >= 0) & (rel < T)
        key_pos = torch.where(new, self.positions.gather(1, rel.clamp(0, T - 1)), key)  # (B, S)
        far = (self.positions[:, :, None] - key_pos[:, None, :]) >= W                  # (B, T, S)
        mask = self.mask if self.mask is not None else torch.zeros(
            far.shape[0], 1, T, self.span, dtype=self.dtype, device=far.device)
        return mask.masked_fill(far[:, None], float("-inf"))

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
        if self.width > 1 or self.tree is not None or min(self.cache.held) != self.cache.longest:
            return attention_mask_for(self.cache, self.width, self.span, self.tree, self.dtype)
        return None


_EMPTY_TREE = torch.empty(0, dtype=torch.bool)
_EMPTY_POSITIONS = torch.empty(0, dtype=torch.long)


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
