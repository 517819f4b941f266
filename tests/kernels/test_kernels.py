"""specdec.kernels: the compiled CPU kernels compute what PyTorch computes (float64 references,
SDPA, F.rms_norm), and each output row is computed alone — bit-identical whatever else shares the
call. Through the model this makes speculative greedy decoding equal plain decoding token for
token, with no near-tie allowance at all."""
from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from specdec import kernels
from specdec.decoding.engine import Engine, Request, plain_generate, speculative_generate
from specdec.decoding.sampling import SamplingConfig
from specdec.decoding.stopping import StopRule
from specdec.lm.checkpoint import load_model, save_model
from specdec.lm.device import placement
from specdec.lm.interface import admit
from specdec.lm.model import Linear, store_matrices
from specdec.proposers import DraftModelProposer, NgramProposer

from ..conftest import TINY, tiny_model


@pytest.fixture(autouse=True, scope="module")
def built():
    if os.environ.get("SPECDEC_KERNELS") == "0":
        pytest.skip("the kernels are turned off (SPECDEC_KERNELS=0)")
    if not {"avx2", "fma"} <= set(open("/proc/cpuinfo").read().split()):
        pytest.skip("this CPU has no AVX2 + FMA: the kernels do not run here (PyTorch operators do)")
    assert kernels.compiled() is not None, "the CPU kernels did not build here (g++ is needed)"


def has_avx512() -> bool:
    flags = open("/proc/cpuinfo").read().split()
    return all(f in flags for f in ("avx512f", "avx512bw", "avx512dq", "avx512vl"))


ISAS = [pytest.param("avx512", marks=pytest.mark.skipif(not has_avx512(), reason="this CPU has no AVX-512")),
        "avx2"]


@pytest.fixture(params=ISAS)
def isa(request):
    """Run a test on one instruction set, then restore the one the kernels had."""
    before = kernels.isa()
    kernels.compiled().set_isa(request.param)
    yield request.param
    kernels.compiled().set_isa(before)


def test_linear_matches_a_float64_reference(isa):
    g = torch.Generator().manual_seed(0)
    for M, K, N in [(1, 8, 1), (3, 24, 7), (4, 20, 64), (5, 384, 33), (9, 64, 128), (17, 40, 5), (32, 96, 200)]:
        x = torch.randn(M, K, generator=g)
        w = torch.randn(N, K, generator=g).bfloat16()
        ref = x.double() @ w.double().T
        got = kernels.linear(x, w, kernels.Matrix.store(w))
        assert got.dtype == torch.float32 and got.shape == (M, N)
        # fp32 summation of K products: error well under 1e-6 per unit of sum |x w|
        bound = 1e-6 * (x.double().abs() @ w.double().abs().T) + 1e-7
        assert ((got.double() - ref).abs() <= bound).all(), (M, K, N)


def test_linear_rows_alone_and_both_instruction_sets_give_the_same_bits():
    """Every row count 1..32 (each tile shape the kernel has) on every instruction set gives each
    row the bits it gets alone, on AVX2."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(32, 200, generator=g)
    w = torch.randn(333, 200, generator=g).bfloat16()
    packed = kernels.Matrix.store(w)
    before = kernels.isa()
    try:
        kernels.compiled().set_isa("avx2")
        alone = torch.cat([kernels.linear(x[m:m + 1], w, packed) for m in range(32)])
        for name in ["avx2"] + (["avx512"] if has_avx512() else []):
            kernels.compiled().set_isa(name)
            for M in range(1, 33):
                start = (7 * M) % (33 - M)  # rows from different places
                assert torch.equal(kernels.linear(x[start:start + M], w, packed), alone[start:start + M]), (name, M)
    finally:
        kernels.compiled().set_isa(before)
    # a non-contiguous input gives the same values
    assert torch.equal(kernels.linear(x.T.contiguous().T, w, packed), alone)


def test_rms_norm_matches_pytorch(isa):
    g = torch.Generator().manual_seed(2)
    for C in (40, 64, 100):
        x, w = torch.randn(3, 5, C, generator=g), torch.randn(C, generator=g)
        torch.testing.assert_close(kernels.rms_norm(x, w, 1e-5), F.rms_norm(x, (C,), w, 1e-5), rtol=1e-5, atol=1e-6)


ZERO_ROWS = """
import torch
from specdec import kernels
for isa in ["avx2"] + (["avx512"] if kernels.isa() == "avx512" else []):
    kernels.compiled().set_isa(isa)
    for format in kernels.FORMATS:
        m = kernels.Matrix.store(torch.randn(40, 64), format)
        y = kernels.compiled().linear(torch.empty(0, 64), m.data, kernels.FORMATS.index(format), 40, torch.empty(0),
                                      torch.randn(40))
        assert y.shape == (0, 40), (format, y.shape)
        assert kernels.linear(torch.empty(2, 0, 64), m.dense(), m).shape == (2, 0, 40)
    assert kernels.rms_norm(torch.empty(3, 0), torch.empty(0), 1e-5).shape == (3, 0)
    assert kernels.rms_norm(torch.empty(0, 64), torch.ones(64), 1e-5).shape == (0, 64)
print("empty results")
"""


def test_zero_rows_give_an_empty_result_on_every_format_and_instruction_set():
    """Run in a process of its own: a kernel that divides by the row count dies of SIGFPE there."""
    run = subprocess.run([sys.executable, "-c", ZERO_ROWS], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and run.stdout.strip() == "empty results", (run.returncode, run.stderr[-3000:])


def test_kernels_step_aside_for_gradients_and_other_dtypes():
    w = torch.randn(6, 16).bfloat16()
    packed = kernels.Matrix.store(w)
    x = torch.randn(2, 16, requires_grad=True)
    kernels.linear(x, w, packed).sum().backward()  # autograd through the PyTorch fallback
    torch.testing.assert_close(x.grad, w.float().sum(0).expand(2, 16))
    xb = torch.randn(2, 16).bfloat16()
    assert kernels.linear(xb, w, packed).dtype == torch.bfloat16


def test_the_measured_fma_peak_is_a_rate():
    assert kernels.compiled().fma_peak(1, 0.05) > 1.0  # GFLOP/s


def pytorch_twin(seed=5):
    """tiny_bf16(seed) computing through PyTorch operators: bf16 matrices, no packing, no stacks."""
    model = tiny_model(seed)
    for m in model.modules():
        if isinstance(m, Linear):
            m.weight = torch.nn.Parameter(m.weight.detach().bfloat16(), requires_grad=False)
    return model


def tiny_bf16(seed=5):
    return store_matrices(tiny_model(seed))


@torch.no_grad()
def test_the_stack_computes_what_pytorch_computes(isa):
    model = tiny_bf16()
    assert model.stack is not None and model.lm_head.stored is not None
    twin = pytorch_twin()
    assert twin.stack is None and twin.lm_head.stored is None
    g = torch.Generator().manual_seed(3)
    prompts = torch.randint(0, TINY.vocab_size, (3, 17), generator=g)
    new = torch.randint(0, TINY.vocab_size, (3, 5), generator=g)
    tree = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 0, 1, 1, 0], [1, 1, 0, 0, 1]],
                        dtype=torch.bool).expand(3, 5, 5)
    for mask in (None, tree):
        outs = []
        for m in (model, twin):
            cache = m.new_cache(3, 40)
            m(prompts[:, :9], cache=cache)
            cache.rollback(torch.tensor([9, 4, 7]))  # ragged rows
            positions = cache.lengths[:, None] + torch.arange(5)
            outs.append(m(new, positions=positions, cache=cache, attention_mask=mask, output_layers=(0,)))
        torch.testing.assert_close(outs[0].logits, outs[1].logits, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(outs[0].layers[0], outs[1].layers[0], rtol=1e-4, atol=1e-4)


@torch.no_grad()
def test_the_stack_reads_rows_through_their_block_tables_after_a_regroup(isa):
    """Rows that left and rows that moved into their places (engine.compacted): each row's entries
    stay in the blocks it was lent, wherever they lie in the pool, and the kernels read them there;
    a row computes bit for bit what it computes alone."""
    model, twin = tiny_bf16(), pytorch_twin()
    g = torch.Generator().manual_seed(6)
    prompts = torch.randint(0, TINY.vocab_size, (4, 11), generator=g)
    new = torch.randint(0, TINY.vocab_size, (2, 3), generator=g)
    outs = []
    for m in (model, twin):
        cache = m.new_cache(5, 40)
        cache.regroup([], empty=4)
        m(prompts, cache=cache)
        cache.rollback([11, 6, 9, 8])
        cache.regroup([3, 1])  # rows 0 and 2 leave, row 3 moves to place 0 (engine.compacted's order)
        assert cache.lengths.tolist() == [8, 6] and cache.tables[0][0] > cache.tables[1][0]  # not in pool order
        outs.append(m(new, cache=cache).logits)
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-4, atol=1e-4)
    alone = model.new_cache(1, 40)
    model(prompts[3:, :8], cache=alone)
    torch.testing.assert_close(model(new[:1], cache=alone).logits, outs[0][:1], rtol=0, atol=0)


@torch.no_grad()
def test_a_bf16_kv_cache_holds_the_keys_rounded_and_the_stack_computes_what_pytorch_computes(isa):
    """A bf16 cache (new_cache's dtype): the kernels store each key and value rounded to nearest (as
    PyTorch converts) and attend over them in fp32, as the PyTorch operators do over the same cache."""
    model, twin = tiny_bf16(), pytorch_twin()
    g = torch.Generator().manual_seed(7)
    prompts = torch.randint(0, TINY.vocab_size, (3, 13), generator=g)
    new = torch.randint(0, TINY.vocab_size, (3, 4), generator=g)
    caches, outs = {}, {}
    for name, m, dtype in (("fp32", model, None), ("bf16", model, torch.bfloat16), ("twin", twin, torch.bfloat16)):
        cache = caches[name] = m.new_cache(4, 40, dtype)
        cache.regroup([], empty=3)
        m(prompts, cache=cache)
        cache.rollback([13, 7, 10])
        outs[name] = m(new, cache=cache).logits
    assert caches["bf16"].keys.dtype == torch.bfloat16
    # layer 0's keys and values do not depend on the cache: the bf16 ones are the fp32 ones rounded
    for fp32, bf16 in zip(caches["fp32"].gathered(0, 13), caches["bf16"].gathered(0, 13)):
        assert torch.equal(bf16[0], fp32[0].bfloat16())
    torch.testing.assert_close(outs["bf16"], outs["twin"], rtol=1e-4, atol=1e-4)
    assert not torch.equal(outs["bf16"], outs["fp32"])  # the rounding reaches the logits


@torch.no_grad()
def test_a_token_gets_the_same_logits_alone_in_any_window_and_on_any_instruction_set():
    """Decoded alone, verified among up to 31 others, batched, or on the other instruction set:
    bit-identical logits (what makes greedy speculative decoding exact)."""
    model = tiny_bf16()
    g = torch.Generator().manual_seed(4)
    prompt = torch.randint(0, TINY.vocab_size, (2, 12), generator=g)
    new = torch.randint(0, TINY.vocab_size, (2, 32), generator=g)
    before = kernels.isa()
    try:
        for name in ["avx2"] + (["avx512"] if has_avx512() else []):
            kernels.compiled().set_isa(name)
            single = model.new_cache(1, 64)
            model(prompt[:1], cache=single)
            alone = torch.cat([model(new[:1, t:t + 1], cache=single).logits for t in range(32)], 1)
            if name == "avx2":
                reference = alone
            assert torch.equal(alone, reference), name
            for T in range(1, 33):
                cache = model.new_cache(2, 64)
                model(prompt, cache=cache)
                window = model(new[:, :T], cache=cache).logits  # batch of 2, T tokens
                assert torch.equal(window[0], reference[0, :T]), (name, T)
    finally:
        kernels.compiled().set_isa(before)


@pytest.mark.parametrize("format", ["bf16", "q8_0", "q4_1"])
@torch.no_grad()
def test_the_threads_split_of_the_layers_leaves_every_bit_as_one_thread_computes_it(format):
    """On two threads (layers of over a megabyte: a second thread is used) a token decoded alone (each
    thread then computes the norms and activations itself, isa.h's each_row) and a window of tokens
    (they split them) give the bits of one thread, and of each other."""
    cfg = replace(TINY, hidden_size=256, intermediate_size=2048, num_attention_heads=8, head_dim=32)
    model = store_matrices(tiny_model(7, cfg), format)
    assert model.stack is not None
    g = torch.Generator().manual_seed(8)
    prompt, new = torch.randint(0, cfg.vocab_size, (1, 9), generator=g), torch.randint(0, cfg.vocab_size, (1, 6),
                                                                                         generator=g)
    results = []
    before = torch.get_num_threads()
    try:
        for n in (1, 2):
            kernels.set_threads(n)
            alone, window = model.new_cache(1, 32), model.new_cache(1, 32)
            model(prompt, cache=alone)
            model(prompt, cache=window)
            results.append((torch.cat([model(new[:, t:t + 1], cache=alone).logits for t in range(6)], 1),
                            model(new, cache=window).logits))
    finally:
        kernels.set_threads(None)
        torch.set_num_threads(before)
    (one_alone, one_window), (two_alone, two_window) = results
    assert torch.equal(two_alone, one_alone) and torch.equal(two_window, one_window)
    assert torch.equal(one_alone, one_window)


@torch.no_grad()
def test_a_tree_node_gets_the_logits_of_its_path_decoded_alone():
    model = tiny_bf16()
    g = torch.Generator().manual_seed(6)
    prompt = torch.randint(0, TINY.vocab_size, (1, 10), generator=g)
    #  node:     0  1  2  3  4  5   parents: 1 <- 0, 2 <- 0, 3 <- 2, 4 <- 1, 5 <- 3
    parents = [-1, 0, 0, 2, 1, 3]
    nodes = torch.randint(0, TINY.vocab_size, (1, 6), generator=g)
    tree = torch.zeros(1, 6, 6, dtype=torch.bool)
    depth = []
    for i, p in enumerate(parents):
        tree[0, i] = tree[0, p] if p >= 0 else False
        tree[0, i, i] = True
        depth.append(depth[p] + 1 if p >= 0 else 0)
    cache = model.new_cache(1, 32)
    model(prompt, cache=cache)
    positions = 10 + torch.tensor([depth])
    together = model(nodes, positions=positions, cache=cache, attention_mask=tree).logits
    for i in range(6):
        path = [j for j in range(6) if tree[0, i, j]]  # ancestors in window order, then i
        cache.rollback(10)
        alone = model(nodes[:, path], cache=cache).logits[:, -1]
        assert torch.equal(alone, together[:, i]), i


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory, tokenizer_file):
    path = tmp_path_factory.mktemp("bf16") / "tiny"
    save_model(tiny_model(5), path, tokenizer_file=tokenizer_file, dtype=torch.bfloat16)
    return path


def test_a_bf16_checkpoint_computes_in_fp32_on_its_bf16_matrices(bf16_checkpoint):
    model = load_model(bf16_checkpoint)
    assert placement(model).dtype == torch.float32
    assert model.lm_head.weight.dtype == torch.bfloat16 and model.model.norm.weight.dtype == torch.float32
    upcast = load_model(bf16_checkpoint)  # the same weights, every matrix converted to fp32
    with torch.no_grad():
        for p in upcast.parameters():
            p.data = p.data.float()
    tokens = torch.randint(0, TINY.vocab_size, (2, 30))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens).logits, upcast(tokens).logits, rtol=1e-4, atol=1e-4)
    assert load_model(bf16_checkpoint, dtype=torch.bfloat16).lm_head.weight.dtype == torch.bfloat16


@torch.no_grad()
def test_verifying_several_tokens_gives_each_the_logits_of_decoding_it_alone(bf16_checkpoint):
    model = load_model(bf16_checkpoint)
    prompts = torch.randint(0, TINY.vocab_size, (3, 20))
    new = torch.randint(0, TINY.vocab_size, (3, 6))
    cache = model.new_cache(3, 64)
    model(prompts, cache=cache)
    together = model(new, cache=cache).logits
    for split in ([1] * 6, [2, 4], [5, 1], [3, 1, 2]):
        cache.rollback(20)
        parts, i = [], 0
        for n in split:
            parts.append(model(new[:, i:i + n], cache=cache).logits)
            i += n
        assert torch.equal(torch.cat(parts, 1), together), split
    # and each row equals the same row decoded in a batch of one
    for b in range(3):
        alone = model.new_cache(1, 64)
        model(prompts[b:b + 1], cache=alone)
        assert torch.equal(model(new[b:b + 1], cache=alone).logits, together[b:b + 1])


PROMPTS = [[5, 9, 2], [7, 1, 2, 3, 1, 2, 3, 1, 2], list(range(20, 37))]


@pytest.mark.parametrize("k", [1, 3, 6])
@pytest.mark.parametrize("name", ["draft-model", "ngram"])
def test_speculative_greedy_equals_plain_decoding_exactly(bf16_checkpoint, name, k):
    target = load_model(bf16_checkpoint)
    proposer = (DraftModelProposer(model=bf16_draft()) if name == "draft-model"
                else NgramProposer(max_n=3, min_n=1))
    rule, greedy = StopRule(max_new_tokens=40), SamplingConfig()
    plain, _ = plain_generate(target, PROMPTS, rule, greedy)
    for group in (PROMPTS, [PROMPTS[1]]):
        rows, metrics = speculative_generate(target, proposer, group, rule, greedy, k)
        expected = plain if len(group) == 3 else [plain[1]]
        assert [r.tokens for r in rows] == [r.tokens for r in expected]  # no near-tie exceptions
        assert metrics.proposed > 0


@pytest.mark.parametrize("k", [0, 3])
def test_an_engine_with_a_bf16_kv_cache_speculates_losslessly_as_rows_join_and_leave(bf16_checkpoint, k):
    """The engine's kv_dtype: its cache in bf16; speculative greedy output equals plain decoding on
    that cache, token for token, in a batch of 2 rows that 4 requests pass through."""
    admitted = admit(load_model(bf16_checkpoint))
    outputs = {}
    for kv, drafted in ((torch.bfloat16, k), (torch.bfloat16, 0), (None, 0)):
        engine = Engine(admitted, NgramProposer(max_n=3, min_n=1) if drafted else None, drafted, 2, 64, kv_dtype=kv)
        assert engine.cache.keys.dtype == (kv or torch.float32)
        requests = [Request(p, StopRule(30)) for p in PROMPTS + [[3, 3, 4]]]
        engine.run(requests)
        outputs[kv, drafted] = [r.row.tokens for r in requests]
    assert outputs[torch.bfloat16, k] == outputs[torch.bfloat16, 0]
    assert outputs[torch.bfloat16, 0] != outputs[None, 0]  # the rounded cache did reach the tokens


def bf16_draft():
    """Another model of the target's vocabulary, bf16 matrices and fp32 arithmetic: it agrees sometimes."""
    return store_matrices(tiny_model(6))
