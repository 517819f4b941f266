"""Keys and values in fixed-size blocks lent by one pool, a block table and a length per row.

A pool (`Pool`) holds N blocks of BLOCK positions of every layer's keys and values, store (N, 2,
L, H_kv, BLOCK, D), a block contiguous. Memory follows use: the store is reserved, not touched, when
the pool is made; a block's pages are touched when first written, and given back to the system
when the block returns to the free list.

A cache (`KVCache`) is a batch of rows over a pool: row b holds `held[b]` committed positions, its
position i at offset i % BLOCK of block tables[b][i // BLOCK]. A forward writes its T new entries
at positions held[b] .. held[b] + T - 1 (`reserve` lends the blocks they need first) and advances
the lengths; rolling back moves the lengths (entries past them are masked out and later
overwritten), nothing is copied; a row keeps its blocks until it leaves. Attention reads a row's
keys in position order through its table, so what it computes depends neither on where the
blocks lie nor on the other rows.

The lengths live on the cache's device (`lengths`, read by attention) and, as the same numbers, on
the host (`held`); the tables likewise (`table` (B, W) int32, rebuilt when a row gains a block).

Serving regroups the rows between steps (`regroup`): rows that finished leave (their blocks go
back), new ones join from a `staging` cache over the same pool (their tables move, no entry is
copied). Admission is a memory decision: `Pool.promise` sets blocks aside for a row's worst case
(prompt, every new token, a verification window) so that its growth never finds the pool empty;
a request that cannot have its promise waits.

Shared prefixes: a full block of committed prompt positions is registered under the hash of its
tokens and all tokens before it (`register`); a row joining with the same leading tokens maps
those blocks (reference-counted, `share`) and writes only after them, so only full blocks are
shared and no shared entry is ever written again. A registered block nobody holds stays cached
(at most `Pool.keep_idle` of them) until its room is needed, oldest first.

This module knows nothing about attention or models; it only stores and indexes.
"""
from __future__ import annotations

import ctypes
import heapq
from collections import OrderedDict
from typing import NamedTuple

import torch

from ..errors import SpecdecError

BLOCK = 16  # positions per block (a power of two: the kernels find a position's block by a shift)
KEEP_IDLE = 4096  # positions of registered prefix blocks kept when no row holds them (by default)


class KVCacheFull(SpecdecError):
    """The pool has no block left for a row that was promised none (admission should have waited)."""


def blocks_for(positions: int) -> int:
    return -(-positions // BLOCK)


def block_bytes(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """The bytes of one block: BLOCK positions of every layer's keys and values."""
    return 2 * num_layers * num_kv_heads * BLOCK * head_dim * dtype.itemsize


class Pool:
    """N blocks of keys and values for every layer, lent to the rows of caches and given back."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, blocks: int,
                 dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu", keep_idle: int | None = None):
        if blocks < 1:
            raise SpecdecError(f"a KV cache needs at least one block of {BLOCK} positions, got {blocks}")
        # (N, 2, L, H_kv, BLOCK, D): empty, since only positions a row has written are ever read
        self.store = torch.empty(blocks, 2, num_layers, num_kv_heads, BLOCK, head_dim, dtype=dtype, device=device)
        self.free = list(range(blocks))     # a heap: the lowest block first, so memory stays packed
        self.refs = [0] * blocks            # rows holding each block
        self.promised = 0                   # blocks set aside for rows' growth, not lent yet
        self.hashes: dict[int, int] = {}    # a registered block's prefix hash -> the block
        self.hash_of: dict[int, int] = {}   # block -> its prefix hash
        self.idle: OrderedDict[int, None] = OrderedDict()  # registered blocks nobody holds, oldest first
        self.keep_idle = min(blocks // 4, KEEP_IDLE // BLOCK) if keep_idle is None else keep_idle
        self.shared_hits = 0                # blocks mapped from the prefix cache instead of prefilled

    @property
    def blocks(self) -> int:
        return self.store.shape[0]

    @property
    def block_bytes(self) -> int:
        return self.store[0].numel() * self.store.element_size()

    @property
    def available(self) -> int:
        """Blocks a new promise may take: free or idle, less those already promised."""
        return len(self.free) + len(self.idle) - self.promised

    @property
    def in_use(self) -> int:
        """Blocks some row holds."""
        return self.blocks - len(self.free) - len(self.idle)

    def promise(self, blocks: int, taken: int = 0) -> bool:
        """Set `blocks` aside for a row's growth if the pool can, beside `taken` idle blocks the row will
        map (`KVCache.share`); False: it cannot now."""
        if blocks + taken > self.available:
            return False
        self.promised += blocks
        return True

    def take(self, promised: bool) -> int:
        """A block for a row (from its promise, or from what nobody was promised)."""
        if promised:
            self.promised -= 1
        elif self.available < 1:
            raise KVCacheFull(f"the KV cache's {self.blocks} blocks of {BLOCK} positions are all in use or "
                              "promised: give it a larger budget (the server's --kv-budget) or fewer rows")
        if self.free:
            block = heapq.heappop(self.free)
        else:  # the oldest idle prefix block makes room
            block, _ = self.idle.popitem(last=False)
            del self.hashes[self.hash_of.pop(block)]
        self.refs[block] = 1
        return block

    def hold(self, block: int) -> None:
        """One more row maps a registered block."""
        if self.refs[block] == 0:
            del self.idle[block]
        self.refs[block] += 1

    def release(self, blocks: list[int]) -> None:
        """Rows let go of `blocks` (a row's, in position order): a block no row holds is cached
        (registered) or freed, its memory given back. The last go first, so that the oldest idle
        blocks, the first evicted, are the ends of prefixes, not their beginnings."""
        freed = []
        for block in reversed(blocks):
            self.refs[block] -= 1
            if self.refs[block]:
                continue
            if block in self.hash_of and self.keep_idle:
                self.idle[block] = None
                if len(self.idle) > self.keep_idle:
                    freed.append(self.idle.popitem(last=False)[0])
            else:
                freed.append(block)
        for block in freed:
            if block in self.hash_of:
                del self.hashes[self.hash_of.pop(block)]
            heapq.heappush(self.free, block)
        give_back(self.store, freed)

    def lookup(self, tokens: list[int]) -> list[int]:
        """The registered blocks that hold the first full blocks of `tokens`, as far as they match."""
        found, h = [], 0
        for i in range(len(tokens) // BLOCK):
            h = hash((h, tuple(tokens[i * BLOCK:(i + 1) * BLOCK])))
            block = self.hashes.get(h)
            if block is None:
                break
            found.append(block)
        return found

    def register(self, tokens: list[int], table: list[int]) -> None:
        """Register the full blocks of a row holding `tokens` at positions 0.. in blocks `table`."""
        h = 0
        for i in range(len(tokens) // BLOCK):
            h = hash((h, tuple(tokens[i * BLOCK:(i + 1) * BLOCK])))
            if h not in self.hashes and table[i] not in self.hash_of:
                self.hashes[h], self.hash_of[table[i]] = table[i], h


_LIBC = ctypes.CDLL(None, use_errno=True)
_PAGE = 4096
_MADV_DONTNEED = 4


def give_back(store: torch.Tensor, blocks: list[int]) -> None:
    """Return the whole pages of the freed blocks' memory to the system (they read as zeros after)."""
    if store.device.type != "cpu" or not blocks:
        return
    size = store[0].numel() * store.element_size()
    base = store.data_ptr()
    for block in blocks:
        start = base + block * size
        lo, hi = -(-start // _PAGE) * _PAGE, (start + size) // _PAGE * _PAGE
        if hi > lo:
            _LIBC.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), _MADV_DONTNEED)


class Slots(NamedTuple):
    """Where a forward's T new entries go: row b's token t to offset[b, t] of block[b, t]."""
    block: torch.Tensor    # (B, T)
    offset: torch.Tensor   # (B, T)


class KVCache:
    def __init__(self, pool: Pool, max_len: int):
        """An empty batch over `pool`; a row holds at most `max_len` positions."""
        self.pool, self.max_len = pool, max_len
        self.tables: list[list[int]] = []   # (B, blocks) each row's blocks, in position order
        self.promises: list[int] = []       # (B,) blocks still promised to each row
        self.joining: KVCache | None = None
        self._set([], [], [])

    def _set(self, held: list[int], tables: list[list[int]], promises: list[int]) -> None:
        self.held, self.tables, self.promises = list(held), tables, promises
        self._changed()

    def _changed(self) -> None:
        """The rows' lengths or tables changed on the host: the device's copies are made anew when read."""
        self._lengths = self._table = None

    @property
    def lengths(self) -> torch.Tensor:
        """(B,) the rows' committed lengths on the cache's device."""
        if self._lengths is None:
            self._lengths = torch.tensor(self.held, dtype=torch.long, device=self.pool.store.device)
        return self._lengths

    @property
    def keys(self) -> torch.Tensor:
        """Every layer's keys, (L, N, H_kv, BLOCK, D) (a view of the pool)."""
        return self.pool.store[:, 0].transpose(0, 1)

    @property
    def values(self) -> torch.Tensor:
        return self.pool.store[:, 1].transpose(0, 1)

    @property
    def table(self) -> torch.Tensor:
        """(B, W) int32 each row's blocks (W: the most any row holds; the rest padded with 0)."""
        if self._table is None:
            width = max(map(len, self.tables), default=0)
            self._table = torch.tensor([t + [0] * (width - len(t)) for t in self.tables], dtype=torch.int32,
                                       device=self.pool.store.device).view(len(self.tables), width)
        return self._table

    @property
    def batch_size(self) -> int:
        return len(self.held)

    @property
    def longest(self) -> int:
        """The committed length of the longest row (0 without rows)."""
        return max(self.held, default=0)

    def regroup(self, keep: list[int], joining: "KVCache | None" = None, empty: int = 0,
                promises: list[int] | None = None) -> None:
        """Make the rows: rows `keep` of this cache (in that order), then every row of `joining` (a
        staging cache over the same pool, emptied), then `empty` rows of length 0 (promised
        `promises` blocks each, default none). Rows left out give their blocks back; nothing is copied."""
        kept = set(keep)
        for b, table in enumerate(self.tables):
            if b not in kept:
                self.pool.release(table)
                self.pool.promised -= self.promises[b]
        held = [self.held[b] for b in keep] + [0] * empty
        tables = [self.tables[b] for b in keep] + [[] for _ in range(empty)]
        owed = [self.promises[b] for b in keep] + (promises or [0] * empty)
        if joining is not None:
            if joining.pool is not self.pool:
                raise SpecdecError("rows join a cache from a staging cache of the same pool")
            n = len(keep)
            held[n:n], tables[n:n], owed[n:n] = joining.held, joining.tables, joining.promises
            joining._set([], [], [])
        self._set(held, tables, owed)

    def staging(self, rows: int, promises: list[int] | None = None) -> "KVCache":
        """An empty cache of `rows` rows over the same pool, to prefill joining rows in before
        `regroup` takes them."""
        if self.joining is None:
            self.joining = KVCache(self.pool, self.max_len)
        self.joining.regroup([], empty=rows, promises=promises)
        return self.joining

    def share(self, b: int, tokens: list[int]) -> int:
        """Map into row b (new, empty) the registered blocks that hold the leading full blocks of
        `tokens`, its length set after them; returns that length (positions not to prefill)."""
        if self.held[b]:
            raise SpecdecError("only an empty row maps shared blocks")
        found = self.pool.lookup(tokens)
        for block in found:
            self.pool.hold(block)
        self.pool.shared_hits += len(found)
        self.tables[b] = found
        self.held[b] = len(found) * BLOCK
        self._changed()
        return self.held[b]

    def register(self, b: int, tokens: list[int]) -> None:
        """Register row b's full blocks of committed positions, which hold `tokens`."""
        self.pool.register(tokens[:self.held[b]], self.tables[b])

    def row(self, b: int) -> "KVCache":
        """Row b alone: a cache of one row over the same pool; `put_row` takes it back."""
        alone = KVCache(self.pool, self.max_len)
        alone._set(self.held[b:b + 1], self.tables[b:b + 1], self.promises[b:b + 1])
        return alone

    def put_row(self, b: int, alone: "KVCache") -> None:
        self.held[b], self.tables[b], self.promises[b] = alone.held[0], alone.tables[0], alone.promises[0]
        self._changed()

    def reserve(self, num_new: int) -> None:
        """Lend every row the blocks its next `num_new` positions need (its promise first)."""
        needed = self.longest + num_new
        if needed > self.max_len:
            raise SpecdecError(
                f"KV cache overflow: {needed} positions needed but a row holds at most {self.max_len}. "
                "Shorten the prompt or max_new_tokens (<= the model's context).")
        for b, (n, table) in enumerate(zip(self.held, self.tables)):
            for _ in range(blocks_for(n + num_new) - len(table)):
                promised = self.promises[b] > 0
                table.append(self.pool.take(promised))
                self.promises[b] -= promised
                self._table = None

    def slots(self, num_new: int) -> Slots:
        """Where the next `num_new` tokens of each row go (their blocks lent)."""
        self.reserve(num_new)
        index = self.lengths[:, None] + torch.arange(num_new, device=self.lengths.device)  # (B, T)
        return Slots(self.table.long().gather(1, index // BLOCK), index % BLOCK)

    def write(self, layer: int, slots: Slots, k: torch.Tensor, v: torch.Tensor, span: int):
        """Store k, v (B, T, H_kv, D) at `slots` (rounded to the cache's dtype); return the layer's
        first `span` positions of every row (B, H_kv, S, D), gathered through the tables, zero past
        what each row holds (a block's unwritten memory may hold anything, NaN included)."""
        store = self.pool.store
        # advanced indices split by slices put the indexed dims first: the target is (B, T, H_kv, D)
        store[slots.block, 0, layer, :, slots.offset] = k.to(store.dtype)
        store[slots.block, 1, layer, :, slots.offset] = v.to(store.dtype)
        keys, values = self.gathered(layer, span)
        unwritten = (torch.arange(span, device=self.lengths.device) >= self.lengths[:, None] + k.shape[1])[:, None, :, None]
        return keys.masked_fill(unwritten, 0), values.masked_fill(unwritten, 0)

    def gathered(self, layer: int, span: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer`'s keys and values of every row's first `span` positions, (B, H_kv, S, D) each,
        copied out of its blocks in position order."""
        store = self.pool.store
        blocks = self.table[:, :blocks_for(span)].long()                       # (B, n)
        B, n = blocks.shape
        rows = store[blocks, :, layer]                                          # (B, n, 2, H_kv, BLOCK, D)
        rows = rows.permute(2, 0, 3, 1, 4, 5).reshape(2, B, store.shape[3], n * BLOCK, store.shape[5])
        return rows[0, :, :, :span], rows[1, :, :, :span]

    def advance(self, num_new: int) -> None:
        if self._lengths is not None:
            self._lengths += num_new
        self.held = [n + num_new for n in self.held]

    def compact(self, starts: list[int], paths: list[list[int]]) -> None:
        """Keep a verified tree's accepted path: row b's window began at position starts[b] (the
        root), node i's entry is at starts[b] + 1 + i, and path node j moves to starts[b] + 1 + j, so
        the kept entries follow each other as if the path alone had been fed (tree.py). Rows whose
        path is already in place move nothing. Set the lengths with `rollback` after."""
        moved = [(self.tables[b][(start + 1 + j) // BLOCK], (start + 1 + j) % BLOCK,
                  self.tables[b][(start + 1 + i) // BLOCK], (start + 1 + i) % BLOCK)
                 for b, (start, path) in enumerate(zip(starts, paths)) for j, i in enumerate(path) if i != j]
        if moved:
            dst_block, dst, src_block, src = torch.tensor(moved, device=self.lengths.device).unbind(1)
            store = self.pool.store
            # every row at once; the right side is gathered (a copy) before anything is written
            store[dst_block, :, :, :, dst] = store[src_block, :, :, :, src]

    def rollback(self, lengths: list[int] | int) -> None:
        """Set every row's committed length (O(1): entries past it become invisible), given on the
        host: a list (one per row) or one int for every row."""
        if isinstance(lengths, torch.Tensor):
            lengths = lengths.tolist()  # a read from the device: callers keep their lengths on the host
        held = [lengths] * len(self.held) if isinstance(lengths, int) else [int(n) for n in lengths]
        if held == self.held:
            return
        self.held = held
        if self._lengths is not None:
            self._lengths.copy_(torch.tensor(held, dtype=torch.long), non_blocking=True)


def cache_for(num_layers: int, num_kv_heads: int, head_dim: int, rows: int, max_len: int,
              dtype: torch.dtype, device: str | torch.device, tokens: int | None = None) -> KVCache:
    """A cache of `rows` empty rows, of at most `max_len` positions, over a pool of its own: `tokens`
    positions in all (default rows x max_len; only what rows write is ever touched)."""
    blocks = blocks_for(tokens) if tokens is not None else rows * blocks_for(max_len)
    cache = KVCache(Pool(num_layers, num_kv_heads, head_dim, max(blocks, 1), dtype, device), max_len)
    cache.regroup([], empty=rows)
    return cache


def budget_blocks(budget: str | None, block_bytes: int, available_bytes: int | None = None) -> tuple[int, str]:
    """The pool's blocks for a budget given as tokens ("20000") or GiB ("1.5GiB", "2G"); None: half
    of the memory the machine has free, less 1 GiB. Returns (blocks, how it was decided)."""
    if budget is None:
        free = available_memory() if available_bytes is None else available_bytes
        spare = max(free - 2 ** 30, 0) // 2
        return max(spare // block_bytes, 1), f"half the free memory less 1 GiB ({free / 2 ** 30:.1f} GiB free)"
    text = budget.strip().lower().replace(" ", "")
    for suffix, scale in (("gib", 2 ** 30), ("gb", 10 ** 9), ("g", 2 ** 30), ("mib", 2 ** 20), ("m", 2 ** 20)):
        if text.endswith(suffix):
            try:
                size = float(text[:-len(suffix)]) * scale
            except ValueError:
                break
            return max(int(size // block_bytes), 1), f"--kv-budget {budget}"
    else:
        if text.isdigit() and int(text) > 0:
            return blocks_for(int(text)), f"--kv-budget {budget} tokens"
    raise SpecdecError(f"--kv-budget takes a number of tokens (20000) or a size (1.5GiB, 800MiB), got {budget!r}")


def available_memory() -> int:
    """Bytes the system can give without swapping (MemAvailable), or 4 GiB where it does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 * 2 ** 30


def describe(pool: Pool) -> str:
    tokens = pool.blocks * BLOCK
    return (f"KV cache: up to {tokens:,} positions ({pool.blocks * pool.block_bytes / 2 ** 30:.2f} GiB of "
            f"{str(pool.store.dtype).removeprefix('torch.')}, blocks of {BLOCK}), memory taken as rows grow")

