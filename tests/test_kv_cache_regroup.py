"""KVCache.regroup: rows that stay keep their committed entries, in the order asked, joining rows
follow with theirs, empty rows start at length 0; storage is allocated once (two buffers)."""
from __future__ import annotations

import pytest
import torch

from specdec.errors import SpecdecError
from specdec.lm.kv_cache import KVCache


def filled(rows: int, lengths: list[int], seed: int, capacity: int = 6) -> KVCache:
    cache = KVCache(2, capacity, 2, 4, 16)
    cache.regroup([], empty=rows)
    g = torch.Generator().manual_seed(seed)
    cache.keys.copy_(torch.randn(cache.keys.shape, generator=g))
    cache.values.copy_(torch.randn(cache.values.shape, generator=g))
    cache.rollback(lengths)
    return cache


def test_rows_stay_in_the_order_asked_and_joining_rows_follow():
    cache, joining = filled(3, [3, 5, 2], seed=0), filled(2, [4, 1], seed=1)
    before = [(cache.keys[:, b, :, :n].clone(), cache.values[:, b, :, :n].clone(), n) for b, n in enumerate([3, 5, 2])]
    joined = [(joining.keys[:, b, :, :n].clone(), joining.values[:, b, :, :n].clone(), n) for b, n in enumerate([4, 1])]
    buffers = {cache.buffer.data_ptr()}
    cache.regroup([2, 0], joining, empty=1)
    assert cache.lengths.tolist() == [2, 3, 4, 1, 0] and cache.keys.shape[1] == 5 and cache.keys.is_contiguous()
    for row, (k, v, n) in enumerate([before[2], before[0], *joined]):
        assert torch.equal(cache.keys[:, row, :, :n], k) and torch.equal(cache.values[:, row, :, :n], v)
    assert torch.equal(cache.k[1], cache.keys[1])  # the per-layer views follow the new layout
    cache.regroup([4, 1])
    cache.regroup([1, 0], empty=3)
    buffers |= {cache.buffer.data_ptr()}
    assert len(buffers) == 2 and cache.lengths.tolist() == [3, 0, 0, 0, 0]
    assert torch.equal(cache.keys[:, 0, :, :3], before[0][0])


def test_more_rows_than_the_capacity_is_a_clear_error():
    cache = filled(2, [1, 1], seed=0, capacity=3)
    with pytest.raises(SpecdecError, match="at most 3 rows"):
        cache.regroup([0, 1], empty=2)
