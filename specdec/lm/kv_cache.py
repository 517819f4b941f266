"""Preallocated per-layer key/value cache with a length per batch row.

Keys and values are two tensors of shape (layers, B, H_kv, max_len, D) allocated once (the
kernels read them whole; `k[layer]` and `v[layer]` are views). Row b holds
`lengths[b]` committed positions; a forward pass writes its T new keys/values at slots
lengths[b] .. lengths[b] + T - 1 and advances the length. Rolling back is moving the length
pointer: stale entries past it are masked out and later overwritten, nothing is copied.

The lengths live on the cache's device (`lengths`, read by attention) and, as the same numbers, on
the host (`held`): every length the host needs (room checks, the span attention reads, whether
rows are equally long) is read from `held`, so a forward never waits on the device for them.

Serving regroups the rows between steps (`regroup`): rows that finished leave, new ones join.
Row b of every layer lives at the same place of the buffer whatever the batch size (the buffer is
laid out for `capacity` rows; the batch is its first B), and the kernels read a layer's rows as one
contiguous (B, H_kv, S, D) block. So a regroup copies only the rows that change place, and the
joining rows (prefilled in a cache of their own); the engine orders the staying rows so that the
fewest move (engine.compacted).

This module knows nothing about attention or models; it only stores and indexes.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from ..errors import SpecdecError


class Slots(NamedTuple):
    """Where a forward's T new entries go: row b's go to slots index[b] of the layer tensors."""
    rows: torch.Tensor       # (B, 1)
    index: torch.Tensor      # (B, T)
    start: int | None        # the common first slot when every row has the same length, else None


class KVCache:
    def __init__(self, num_layers: int, batch_size: int, num_kv_heads: int, head_dim: int,
                 max_len: int, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        self.capacity = batch_size  # the most rows `regroup` may make
        # keys, values: (2, L, capacity, H_kv, S, D); zeros, since attention reads masked slots too (0 x NaN = NaN)
        self.store = torch.zeros(2, num_layers, batch_size, num_kv_heads, max_len, head_dim, dtype=dtype,
                                 device=device)
        self.joining: KVCache | None = None      # where joining rows are prefilled (`staging`)
        self.max_len = max_len
        self._view([0] * batch_size)

    def _view(self, held: list[int]) -> None:
        """len(held) rows: the first of every layer's `capacity` (L, B, H_kv, S, D)."""
        B = len(held)
        self.keys, self.values = self.store[0, :, :B], self.store[1, :, :B]   # (L, B, H_kv, S, D) each
        self.k = [self.keys[i] for i in range(self.store.shape[1])]  # views (not unbind: writable under autograd)
        self.v = [self.values[i] for i in range(self.store.shape[1])]
        self.lengths = torch.tensor(held, dtype=torch.long, device=self.store.device)  # (B,)
        self.held = list(held)  # (B,) the same lengths on the host

    def regroup(self, keep: list[int], joining: "KVCache | None" = None, empty: int = 0) -> None:
        """Make the rows: rows `keep` of this cache (in that order), then every row of `joining`,
        then `empty` rows of length 0. Only the committed entries of rows that change place, and
        of the joining rows, are copied: O(moved rows x their longest length), no allocation."""
        joined = [] if joining is None else joining.held
        rows = len(keep) + len(joined) + empty
        if rows > self.capacity:
            raise SpecdecError(f"the cache holds at most {self.capacity} rows, {rows} were asked for: "
                               "allocate it with more rows (the server's --max-batch)")
        moved = [(i, b) for i, b in enumerate(keep) if i != b]
        if longest := max((self.held[b] for _, b in moved), default=0):
            dst = torch.tensor([i for i, _ in moved], device=self.store.device)
            src = torch.tensor([b for _, b in moved], device=self.store.device)
            # the right side is gathered (a copy) before anything is written
            self.store[:, :, dst, :, :longest] = self.store[:, :, src, :, :longest]
        if longest := max(joined, default=0):
            n = len(keep)
            self.store[:, :, n:n + len(joined), :, :longest] = joining.store[:, :, :len(joined), :, :longest]
        self._view([self.held[b] for b in keep] + joined + [0] * empty)

    def staging(self, rows: int) -> "KVCache":
        """An empty cache of `rows` rows laid out like this one, to prefill joining rows in before
        `regroup` copies them here (allocated on first use, then reused)."""
        if self.joining is None:
            _, L, capacity, H, S, D = self.store.shape
            self.joining = KVCache(L, capacity, H, D, S, self.store.dtype, self.store.device)
        self.joining.regroup([], empty=rows)
        return self.joining

    @property
    def batch_size(self) -> int:
        return self.lengths.shape[0]

    @property
    def longest(self) -> int:
        """The committed length of the longest row (0 without rows)."""
        return max(self.held, default=0)

    def check_room(self, num_new: int) -> None:
        """Raise unless every row has room for `num_new` more entries."""
        needed = self.longest + num_new
        if needed > self.max_len:
            raise SpecdecError(
                f"KV cache overflow: {needed} positions needed but the cache holds {self.max_len}. "
                "Shorten the prompt or max_new_tokens, or allocate a larger cache (<= the model's context).")

    def slots(self, num_new: int) -> Slots:
        """Where the next `num_new` tokens of each row go."""
        shortest, longest = min(self.held), max(self.held)
        self.check_room(num_new)
        rows = torch.arange(self.batch_size, device=self.lengths.device)[:, None]
        index = self.lengths[:, None] + torch.arange(num_new, device=self.lengths.device)
        return Slots(rows, index, shortest if shortest == longest else None)

    def write(self, layer: int, slots: Slots, k: torch.Tensor, v: torch.Tensor, span: int):
        """Store k, v (B, T, H_kv, D) at `slots` (rounded to the cache's dtype); return the layer's first
        `span` slots (B, H_kv, S, D)."""
        if slots.start is not None:
            # one strided copy instead of an index_put (the common case: batch 1, or equal lengths)
            stop = slots.start + k.shape[1]
            self.k[layer][:, :, slots.start:stop] = k.transpose(1, 2)
            self.v[layer][:, :, slots.start:stop] = v.transpose(1, 2)
        else:
            # advanced indices split by a slice put the indexed dims first: the target is (B, T, H_kv, D)
            self.k[layer][slots.rows, :, slots.index] = k.to(self.store.dtype)
            self.v[layer][slots.rows, :, slots.index] = v.to(self.store.dtype)
        return self.k[layer][:, :, :span], self.v[layer][:, :, :span]

    def advance(self, num_new: int) -> None:
        self.lengths += num_new
        self.held = [n + num_new for n in self.held]

    def compact(self, starts: list[int], paths: list[list[int]]) -> None:
        """Keep a verified tree's accepted path: row b's window began at slot starts[b] (the root),
        node i's entry is at starts[b] + 1 + i, and path node j moves to starts[b] + 1 + j, so the
        kept entries follow each other as if the path alone had been fed (tree.py). Rows whose path
        is already in place move nothing. Set the lengths with `rollback` after."""
        moved = [(b, start + 1 + j, start + 1 + i) for b, (start, path) in enumerate(zip(starts, paths))
                 for j, i in enumerate(path) if i != j]  # (row, to slot, from slot)
        if moved:
            row, dst, src = torch.tensor(moved, device=self.keys.device).unbind(1)
            # every row at once; the right side is gathered (a copy) before anything is written
            for store in (self.keys, self.values):
                store[:, row, :, dst] = store[:, row, :, src]

    def rollback(self, lengths: list[int] | int) -> None:
        """Set every row's committed length (O(1): entries past it become invisible), given on the
        host: a list (one per row) or one int for every row."""
        if isinstance(lengths, torch.Tensor):
            lengths = lengths.tolist()  # a read from the device: callers keep their lengths on the host
        held = [lengths] * len(self.held) if isinstance(lengths, int) else [int(n) for n in lengths]
        if held == self.held:
            return
        self.held = held
        self.lengths.copy_(torch.tensor(held, dtype=torch.long), non_blocking=True)
