"""Preallocated per-layer key/value cache with a length per batch row.

Keys and values are two tensors of shape (layers, B, H_kv, max_len, D) allocated once (the
kernels read them whole; `k[layer]` and `v[layer]` are views). Row b holds
`lengths[b]` committed positions; a forward pass writes its T new keys/values at slots
lengths[b] .. lengths[b] + T - 1 and advances the length. Rolling back is moving the length
pointer: stale entries past it are masked out and later overwritten, nothing is copied.

This module knows nothing about attention or models; it only stores and indexes.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from .errors import SpecdecError


class Slots(NamedTuple):
    """Where a forward's T new entries go: row b's go to slots index[b] of the layer tensors."""
    rows: torch.Tensor       # (B, 1)
    index: torch.Tensor      # (B, T)
    start: int | None        # the common first slot when every row has the same length, else None


class KVCache:
    def __init__(self, num_layers: int, batch_size: int, num_kv_heads: int, head_dim: int,
                 max_len: int, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        shape = (num_layers, batch_size, num_kv_heads, max_len, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.k = [self.keys[i] for i in range(num_layers)]  # views (not unbind: writable under autograd)
        self.v = [self.values[i] for i in range(num_layers)]
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=device)  # (B,)
        self.max_len = max_len

    @property
    def batch_size(self) -> int:
        return self.lengths.shape[0]

    def check_room(self, num_new: int, longest: int | None = None) -> None:
        """Raise unless every row has room for `num_new` more entries."""
        needed = (int(self.lengths.max()) if longest is None else longest) + num_new
        if needed > self.max_len:
            raise SpecdecError(
                f"KV cache overflow: {needed} positions needed but the cache holds {self.max_len}. "
                "Shorten the prompt or max_new_tokens, or allocate a larger cache (<= the model's context).")

    def slots(self, num_new: int) -> Slots:
        """Where the next `num_new` tokens of each row go."""
        shortest, longest = (int(n) for n in self.lengths.aminmax())
        self.check_room(num_new, longest)
        rows = torch.arange(self.batch_size, device=self.lengths.device)[:, None]
        index = self.lengths[:, None] + torch.arange(num_new, device=self.lengths.device)
        return Slots(rows, index, shortest if shortest == longest else None)

    def write(self, layer: int, slots: Slots, k: torch.Tensor, v: torch.Tensor, span: int):
        """Store k, v (B, T, H_kv, D) at `slots`; return the layer's first `span` slots (B, H_kv, S, D)."""
        if slots.start is not None:
            # one strided copy instead of an index_put (the common case: batch 1, or equal lengths)
            stop = slots.start + k.shape[1]
            self.k[layer][:, :, slots.start:stop] = k.transpose(1, 2)
            self.v[layer][:, :, slots.start:stop] = v.transpose(1, 2)
        else:
            # advanced indices split by a slice put the indexed dims first: the target is (B, T, H_kv, D)
            self.k[layer][slots.rows, :, slots.index] = k
            self.v[layer][slots.rows, :, slots.index] = v
        return self.k[layer][:, :, :span], self.v[layer][:, :, :span]

    def advance(self, num_new: int) -> None:
        self.lengths += num_new

    def compact(self, starts: list[int], paths: list[list[int]]) -> None:
        """Keep a verified tree's accepted path: row b's window began at slot starts[b] (the root),
        node i's entry is at starts[b] + 1 + i, and path node j moves to starts[b] + 1 + j, so the
        kept entries follow each other as if the path alone had been fed (tree.py). Rows whose path
        is already in place move nothing. Set the lengths with `rollback` after."""
        for b, (start, path) in enumerate(zip(starts, paths)):
            moved = [(j, i) for j, i in enumerate(path) if i != j]
            if moved:
                dst = torch.tensor([start + 1 + j for j, _ in moved], device=self.keys.device)
                src = torch.tensor([start + 1 + i for _, i in moved], device=self.keys.device)
                # the right side is gathered (a copy) before anything is written
                for store in (self.keys, self.values):
                    store[:, b, :, dst] = store[:, b, :, src]

    def rollback(self, lengths: torch.Tensor | list[int] | int) -> None:
        """Set every row's committed length (O(1): entries past it become invisible)."""
        if isinstance(lengths, list) and self.lengths.device.type == "cpu":  # one copy, no intermediate tensor
            self.lengths.numpy()[:] = lengths
            return
        lengths = torch.as_tensor(lengths, dtype=torch.long, device=self.lengths.device)
        self.lengths.copy_(lengths.expand_as(self.lengths))
