"""lm/kv_cache.py: keys and values in blocks lent by a pool. Rows keep their entries through
regroups without a copy, give their blocks back when they leave (and the memory to the system),
promises hold a row's worst case, full prompt blocks are shared by their tokens' hash, and a row
computes bit for bit the same logits wherever its blocks lie and whatever it shares."""
from __future__ import annotations

import pytest
import torch

from specdec.decoding.engine import Engine, Request, compacted
from specdec.decoding.stopping import StopRule
from specdec.errors import SpecdecError
from specdec.lm.interface import admit
from specdec.lm.kv_cache import BLOCK, KVCache, KVCacheFull, Pool, budget_blocks, cache_for
from specdec.lm.model import store_matrices
from specdec.proposers import NgramProposer

from ..conftest import TINY, tiny_model


def filled(lengths: list[int], seed: int, pool: Pool | None = None) -> KVCache:
    """A cache whose rows hold `lengths` random entries."""
    cache = KVCache(pool or Pool(2, 2, 4, 32, torch.float32), 256)
    cache.regroup([], empty=len(lengths))
    cache.reserve(max(lengths))
    g = torch.Generator().manual_seed(seed)
    cache.pool.store.copy_(torch.randn(cache.pool.store.shape, generator=g))
    cache.rollback(lengths)
    return cache


def entries(cache: KVCache, b: int) -> torch.Tensor:
    """Row b's committed keys and values of every layer: (L, 2, H_kv, n, D)."""
    n = cache.held[b]
    return torch.stack([torch.stack([kv[b, :, :n] for kv in cache.gathered(layer, max(cache.held))])
                        for layer in range(cache.pool.store.shape[2])])


def test_rows_keep_their_entries_in_the_order_asked_and_joining_rows_follow_without_a_copy():
    cache = filled([3, 21, 40], seed=0)
    joining = cache.staging(2)
    joining.reserve(17)
    joining.rollback([17, 5])
    before = [entries(cache, b) for b in range(3)] + [entries(joining, b) for b in range(2)]
    store = cache.pool.store.clone()
    used = cache.pool.in_use
    cache.regroup([2, 0], joining, empty=1)
    assert cache.held == [40, 3, 17, 5, 0] and joining.held == []
    assert torch.equal(cache.pool.store, store)  # nothing moved: tables changed hands
    for row, b in enumerate([2, 0, 3, 4]):
        assert torch.equal(entries(cache, row), before[b])
    assert cache.pool.in_use == used - 3  # row 1 gave back the 3 blocks it was lent


def test_rows_take_blocks_as_they_grow_and_keep_them_through_a_rollback():
    cache = KVCache(Pool(1, 1, 4, 8, torch.float32), 128)
    cache.regroup([], empty=2)
    cache.reserve(BLOCK + 1)
    assert [len(t) for t in cache.tables] == [2, 2] and cache.pool.in_use == 4
    cache.advance(BLOCK + 1)
    cache.rollback([3, 1])
    assert [len(t) for t in cache.tables] == [2, 2]  # a rollback is a length: the blocks stay
    cache.reserve(BLOCK)
    assert [len(t) for t in cache.tables] == [2, 2]
    cache.regroup([1])
    assert cache.pool.in_use == 2


def test_an_exhausted_pool_is_a_clear_error_and_a_row_past_its_length_too():
    cache = KVCache(Pool(1, 1, 4, 3, torch.float32), 4 * BLOCK)
    cache.regroup([], empty=2)
    cache.reserve(BLOCK)
    with pytest.raises(KVCacheFull, match="--kv-budget"):
        cache.reserve(2 * BLOCK)
    alone = KVCache(Pool(1, 1, 4, 8, torch.float32), 2 * BLOCK)
    alone.regroup([], empty=1)
    with pytest.raises(SpecdecError, match="at most 32"):
        alone.reserve(2 * BLOCK + 1)


def test_a_promise_holds_blocks_for_its_row_and_is_returned_when_the_row_leaves():
    pool = Pool(1, 1, 4, 10, torch.float32)
    assert pool.promise(6) and not pool.promise(5) and pool.available == 4
    cache = KVCache(pool, 10 * BLOCK)
    cache.regroup([], empty=1, promises=[6])
    other = cache.staging(1)
    other.reserve(4 * BLOCK)  # what nobody was promised: the 4 left
    with pytest.raises(KVCacheFull):
        other.reserve(5 * BLOCK)
    cache.reserve(6 * BLOCK)  # the promised row grows into its 6 blocks, whatever the other took
    assert pool.promised == 0 and pool.available == 0
    cache.regroup([])
    assert pool.available == 6 and pool.promise(6)


def test_full_prompt_blocks_are_shared_by_the_hash_of_their_tokens_and_everything_before():
    pool = Pool(1, 1, 4, 16, torch.float32, keep_idle=2)
    cache = KVCache(pool, 16 * BLOCK)
    cache.regroup([], empty=1)
    tokens = list(range(3 * BLOCK + 5))
    cache.reserve(len(tokens))
    cache.advance(len(tokens))
    cache.register(0, tokens)
    first = list(cache.tables[0])
    assert pool.lookup(tokens) == first[:3]              # only full blocks
    assert pool.lookup(tokens[:2 * BLOCK + 3]) == first[:2]
    assert pool.lookup([99] + tokens[1:]) == []          # a block's hash covers every token before it
    joining = cache.staging(1)
    assert joining.share(0, tokens + [7]) == 3 * BLOCK and joining.tables[0] == first[:3]
    assert [pool.refs[b] for b in first] == [2, 2, 2, 1]
    cache.regroup([], joining)
    assert [pool.refs[b] for b in first] == [1, 1, 1, 0]
    cache.regroup([])                                     # nobody holds them: two stay cached (keep_idle)
    assert pool.lookup(tokens) == first[:2] and len(pool.idle) == 2 and pool.in_use == 0  # the tail went first
    assert pool.available == pool.blocks


def test_freed_blocks_give_their_memory_back_to_the_system():
    def resident() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    pool = Pool(4, 8, 128, 2048, torch.bfloat16)  # 256 MiB, reserved, not touched
    cache = KVCache(pool, 2048 * BLOCK)
    base = resident()
    cache.regroup([], empty=8)
    cache.reserve(256 * BLOCK - 1)
    for table in cache.tables:
        pool.store[torch.tensor(table)] = 1
    grown = resident() - base
    assert grown > 200 * 2 ** 20
    cache.regroup([])
    assert resident() - base < 0.1 * grown


@pytest.mark.parametrize("budget, blocks", [("20000", 1250), ("1GiB", 2 ** 30 // 4096), ("512MiB", 2 ** 29 // 4096),
                                            ("2G", 2 ** 31 // 4096)])
def test_a_budget_is_tokens_or_a_size(budget, blocks):
    assert budget_blocks(budget, 4096)[0] == blocks


def test_a_budget_without_a_number_is_refused_and_the_default_is_half_the_free_memory():
    for bad in ("lots", "-5", "0", "1.5xb"):
        with pytest.raises(SpecdecError, match="--kv-budget takes"):
            budget_blocks(bad, 4096)
    assert budget_blocks(None, 2 ** 20, available_bytes=9 * 2 ** 30)[0] == 4 * 1024


@torch.no_grad()
def test_a_row_computes_the_same_logits_wherever_its_blocks_lie():
    """Bit for bit, on the kernels: a row prefilled in a fresh pool, and the same row in blocks 1, 3
    and 5 of a pool whose memory holds noise, beside another row."""
    model = store_matrices(tiny_model(5))
    if model.stack is None:
        pytest.skip("the kernels do not run here")
    g = torch.Generator().manual_seed(1)
    prompt, new = torch.randint(0, TINY.vocab_size, (1, 40), generator=g), torch.randint(0, TINY.vocab_size, (1, 3),
                                                                                        generator=g)
    fresh = model.new_cache(1, 64)
    model(prompt, cache=fresh)
    want = model(new, cache=fresh).logits
    scattered = model.new_cache(4, 64)
    scattered.pool.store.normal_(generator=g)
    lent = [scattered.pool.take(promised=False) for _ in range(5)]  # blocks 0..4, held by nobody's row
    scattered.pool.release([lent[1], lent[3]])
    scattered.regroup([], empty=2)
    model(torch.cat([prompt, torch.randint(0, TINY.vocab_size, (1, 40), generator=g)]), cache=scattered)
    assert scattered.tables[0] == [1, 3, 5]
    got = model(torch.cat([new, new]), cache=scattered).logits[:1]
    assert torch.equal(got, want)


def test_a_shared_prefix_is_prefilled_once_and_the_rows_decode_what_they_decode_alone():
    """Requests that begin with the same 48 tokens, one after another through the engine: the later
    ones map the first one's blocks (3 shared, nothing prefilled there) and emit the tokens they emit
    with sharing turned off."""
    admitted = admit(tiny_model(0))
    preamble = [int(t) for t in torch.randint(3, TINY.vocab_size, (48,), generator=torch.Generator().manual_seed(2))]
    prompts = [preamble + [5, 6, 7], preamble + [9], preamble[:40] + [8, 8]]
    outputs = {}
    for share in (True, False):
        engine = Engine(admitted, NgramProposer(max_n=3, min_n=1), 3, capacity=2, max_len=96, share_prefixes=share)
        requests = []
        for prompt in prompts:  # one at a time: each joins after the one before has been prefilled
            requests.append(Request(prompt, StopRule(12)))
            engine.submit(requests[-1])
            engine.step()
        while engine.busy:
            engine.step()
        outputs[share] = [r.row.tokens for r in requests]
        assert engine.cache.pool.shared_hits == (3 + 2 if share else 0)  # the third shares 2 full blocks of 40
    assert outputs[True] == outputs[False]


def test_a_request_waits_for_memory_and_one_that_can_never_fit_is_refused():
    admitted = admit(tiny_model(0))
    engine = Engine(admitted, None, 0, capacity=4, max_len=64, kv_tokens=3 * BLOCK)
    with pytest.raises(SpecdecError, match="whole cache holds 48"):
        engine.submit(Request(list(range(3, 40)), StopRule(20)))  # fits the context (64), not the cache
    requests = [Request([3, 4, 5], StopRule(2 * BLOCK)) for _ in range(3)]  # 3 blocks each: one at a time
    for r in requests:
        engine.submit(r)
    rows = []
    while engine.busy:
        engine.step()
        rows.append(len(engine.requests))
    assert max(rows) == 1 and all(len(r.row.tokens) == 2 * BLOCK for r in requests)
    assert engine.cache.pool.in_use == 0 and engine.cache.pool.promised == 0


@pytest.mark.parametrize("staying, order", [
    ([True, True, True], [0, 1, 2]),
    ([True, False, True, True], [0, 3, 2]),
    ([False, False, True, True, False, True], [3, 5, 2]),
    ([False, True], [1]),
    ([False, False], []),
])
def test_compacted_keeps_rows_in_place_and_fills_holes_from_above(staying, order):
    assert compacted(staying) == order


def test_a_cache_for_a_model_starts_with_its_empty_rows():
    cache = cache_for(2, 2, 8, 3, 100, torch.float32, "cpu")
    assert cache.held == [0, 0, 0] and cache.pool.blocks == 3 * 7 and cache.keys.shape == (2, 21, 2, BLOCK, 8)
