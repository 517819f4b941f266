"""KVCache.regroup: rows that stay keep their committed entries, in the order asked, joining rows
follow with theirs, empty rows start at length 0; storage is allocated once, and only rows that
change place are copied (the engine's `compacted` orders the staying rows so that the fewest do)."""
from __future__ import annotations

import pytest
import torch

from specdec.errors import SpecdecError
from specdec.decoding.engine import compacted
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
    buffers = {cache.store.data_ptr()}
    cache.regroup([2, 0], joining, empty=1)
    assert cache.lengths.tolist() == [2, 3, 4, 1, 0] and cache.keys.shape[1] == 5
    assert all(k.is_contiguous() for k in cache.k)  # each layer's rows one block, as the kernels read them
    for row, (k, v, n) in enumerate([before[2], before[0], *joined]):
        assert torch.equal(cache.keys[:, row, :, :n], k) and torch.equal(cache.values[:, row, :, :n], v)
    assert torch.equal(cache.k[1], cache.keys[1])  # the per-layer views follow the new layout
    cache.regroup([4, 1])
    cache.regroup([1, 0], empty=3)
    buffers |= {cache.store.data_ptr()}
    assert len(buffers) == 1 and cache.lengths.tolist() == [3, 0, 0, 0, 0]
    assert torch.equal(cache.keys[:, 0, :, :3], before[0][0])


def test_more_rows_than_the_capacity_is_a_clear_error():
    cache = filled(2, [1, 1], seed=0, capacity=3)
    with pytest.raises(SpecdecError, match="at most 3 rows"):
        cache.regroup([0, 1], empty=2)


@pytest.mark.parametrize("staying, order", [
    ([True, True, True], [0, 1, 2]),
    ([True, False, True, True], [0, 3, 2]),
    ([False, False, True, True, False, True], [3, 5, 2]),
    ([False, True], [1]),
    ([False, False], []),
])
def test_compacted_keeps_rows_in_place_and_fills_holes_from_above(staying, order):
    assert compacted(staying) == order


def test_a_row_that_keeps_its_place_is_not_copied():
    cache = filled(4, [3, 5, 2, 4], seed=0)
    stale = cache.keys[:, 0, :, 3:].clone()  # row 0's entries past its length: nothing reads them
    kept = [(cache.keys[:, b, :, :n].clone(), n) for b, n in enumerate([3, 5, 2, 4])]
    cache.regroup(compacted([True, False, True, True]))  # row 1 leaves; row 3 moves into its place
    assert cache.lengths.tolist() == [3, 4, 2]
    assert torch.equal(cache.keys[:, 0, :, 3:], stale)  # untouched, even where uncommitted
    for row, b in enumerate([0, 3, 2]):
        k, n = kept[b]
        assert torch.equal(cache.keys[:, row, :, :n], k)
