"""Preallocated per-layer key/value cache with a length per batch row.

Every layer owns two tensors of shape (B, H_kv, max_len, D) allocated once. Row b holds
`lengths[b]` committed positions; a forward pass writes its T new keys/values at slots
lengths[b] .. lengths[b] + T - 1 and advances the length. Rolling back is moving the length
pointer: stale entries past it are masked out and later overwritten, nothing is copied.

This module knows nothing about attention or models; it only stores and indexes.
"""
from __future__ import annotations

import torch

from .errors import SpecdecError


class KVCache:
    def __init__(self, num_layers: int, batch_size: int, num_kv_heads: int, head_dim: int,
                 max_len: int, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        shape = (batch_size, num_kv_heads, max_len, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=device)  # (B,)
        self.max_len = max_len

    @property
    def batch_size(self) -> int:
        return self.lengths.shape[0]

    def slots(self, num_new: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Index pair (rows (B, 1), slots (B, T)) where the next `num_new` tokens of each row go."""
        needed = int(self.lengths.max()) + num_new
        if needed > self.max_len:
            raise SpecdecError(
                f"KV cache overflow: {needed} positions needed but the cache holds {self.max_len}. "
                "Shorten the prompt or max_new_tokens, or allocate a larger cache (<= the model's context).")
        rows = torch.arange(self.batch_size, device=self.lengths.device)[:, None]
        return rows, self.lengths[:, None] + torch.arange(num_new, device=self.lengths.device)

    def write(self, layer: int, slots: tuple[torch.Tensor, torch.Tensor], k: torch.Tensor, v: torch.Tensor,
              span: int):
        """Store k, v (B, T, H_kv, D) at `slots`; return the layer's first `span` slots (B, H_kv, S, D)."""
        # advanced indices split by a slice put the indexed dims first: the target is (B, T, H_kv, D)
        self.k[layer][slots[0], :, slots[1]] = k
        self.v[layer][slots[0], :, slots[1]] = v
        return self.k[layer][:, :, :span], self.v[layer][:, :, :span]

    def advance(self, num_new: int) -> None:
        self.lengths += num_new

    def rollback(self, lengths: torch.Tensor | int) -> None:
        """Set every row's committed length (O(1): entries past it become invisible)."""
        lengths = torch.as_tensor(lengths, dtype=torch.long, device=self.lengths.device)
        self.lengths.copy_(lengths.expand_as(self.lengths))
