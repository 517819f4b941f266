"""specdec.kernels: the compiled CPU kernels compute what PyTorch computes (float64 references,
SDPA, F.rms_norm), and each output row is computed alone — bit-identical whatever else shares the
call. Through the model this makes speculative greedy decoding equal plain decoding token for
token, with no near-tie allowance at all."""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from specdec import kernels
from specdec.checkpoint import load_model, save_model
from specdec.decode import plain_generate
from specdec.engine import speculative_generate
from specdec.model import compute_dtype, store_matrices_bf16
from specdec.proposers import build_proposer
from specdec.sampling import SamplingConfig
from specdec.stopping import StopRule

from .conftest import TINY, tiny_model


@pytest.fixture(autouse=True, scope="module")
def built():
    if os.environ.get("SPECDEC_KERNELS") == "0":
        pytest.skip("the kernels are turned off (SPECDEC_KERNELS=0)")
    assert kernels.compiled() is not None, "the CPU kernels did not build here (AVX2 and g++ are needed)"


def test_linear_matches_a_float64_reference():
    g = torch.Generator().manual_seed(0)
    for M, K, N in [(1, 8, 1), (3, 24, 7), (4, 20, 64), (5, 384, 33), (9, 64, 128), (17, 40, 5)]:
        x = torch.randn(M, K, generator=g)
        w = torch.randn(N, K, generator=g).bfloat16()
        ref = x.double() @ w.double().T
        got = kernels.linear(x, w)
        assert got.dtype == torch.float32 and got.shape == (M, N)
        # fp32 summation of K products: error well under 1e-6 per unit of sum |x w|
        bound = 1e-6 * (x.double().abs() @ w.double().abs().T) + 1e-7
        assert ((got.double() - ref).abs() <= bound).all(), (M, K, N)


def test_linear_rows_do_not_depend_on_each_other():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 7, 48, generator=g)
    w = torch.randn(40, 48, generator=g).bfloat16()
    whole = kernels.linear(x, w)
    assert whole.shape == (2, 7, 40)
    flat = x.reshape(14, 48)
    for rows in ([0], [3, 4], [1, 5, 9], [2, 6, 10, 13], list(range(11))):
        assert torch.equal(kernels.linear(flat[rows], w), whole.reshape(14, 40)[rows]), rows
    # a non-contiguous input gives the same values
    assert torch.equal(kernels.linear(x.transpose(0, 1).contiguous().transpose(0, 1), w), whole)


def test_rms_norm_matches_pytorch():
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(3, 5, 40, generator=g), torch.randn(40, generator=g)
    torch.testing.assert_close(kernels.rms_norm(x, w, 1e-5), F.rms_norm(x, (40,), w, 1e-5), rtol=1e-5, atol=1e-6)


def attention_inputs(seed, B=2, H=2, G=3, T=4, S=29, D=16, cache_len=40):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, G * T, D, generator=g)
    k_cache, v_cache = (torch.randn(B, H, cache_len, D, generator=g) for _ in range(2))
    visible = torch.rand(B, 1, T, S, generator=g) < 0.7
    visible[..., 0] = True  # every query sees at least one key
    mask = torch.zeros(B, 1, T, S).masked_fill_(~visible, float("-inf"))
    return q, k_cache, v_cache, mask


def test_attention_matches_sdpa():
    q, k_cache, v_cache, mask = attention_inputs(3)
    B, _, T, S = mask.shape
    k, v = k_cache[:, :, :S], v_cache[:, :, :S]
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, :, None].expand(B, 1, 3, T, S).reshape(B, 1, 3 * T, S))
    torch.testing.assert_close(kernels.cached_attention(q, k, v, mask, 3), ref, rtol=1e-5, atol=1e-6)
    one = q[:, :, :1]  # one token, no mask: every cached key is visible
    torch.testing.assert_close(kernels.cached_attention(one, k, v, None, 1),
                               F.scaled_dot_product_attention(one, k, v), rtol=1e-5, atol=1e-6)


def test_attention_rows_do_not_depend_on_the_span_or_other_rows():
    q, k_cache, v_cache, mask = attention_inputs(4, T=1, G=2)
    S = mask.shape[-1]
    base = kernels.cached_attention(q, k_cache[:, :, :S], v_cache[:, :, :S], mask, 2)
    # a longer span whose extra keys are masked (later drafts of the same step) changes nothing
    for extra in (1, 5, 11):
        longer = torch.cat([mask, torch.full(mask.shape[:-1] + (extra,), float("-inf"))], -1)
        got = kernels.cached_attention(q, k_cache[:, :, :S + extra], v_cache[:, :, :S + extra], longer, 2)
        assert torch.equal(got, base), extra
    # each query row alone equals the same row among all
    for r in range(q.shape[2]):
        alone = kernels.cached_attention(q[:, :, r:r + 1].contiguous(), k_cache[:, :, :S], v_cache[:, :, :S], mask, 1)
        assert torch.equal(alone, base[:, :, r:r + 1])


def test_kernels_step_aside_for_gradients_and_other_dtypes():
    w = torch.randn(6, 16).bfloat16()
    x = torch.randn(2, 16, requires_grad=True)
    kernels.linear(x, w).sum().backward()  # autograd through the PyTorch fallback
    torch.testing.assert_close(x.grad, w.float().sum(0).expand(2, 16))
    xb = torch.randn(2, 16).bfloat16()
    assert kernels.linear(xb, w).dtype == torch.bfloat16


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory, tokenizer_file):
    path = tmp_path_factory.mktemp("bf16") / "tiny"
    save_model(tiny_model(5), path, tokenizer_file=tokenizer_file, dtype=torch.bfloat16)
    return path


def test_a_bf16_checkpoint_computes_in_fp32_on_its_bf16_matrices(bf16_checkpoint):
    model = load_model(bf16_checkpoint)
    assert compute_dtype(model) == torch.float32
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
    proposer = (build_proposer("draft-model", model=bf16_draft()) if name == "draft-model"
                else build_proposer("ngram", max_n=3, min_n=1))
    rule, greedy = StopRule(max_new_tokens=40), SamplingConfig()
    plain, _ = plain_generate(target, PROMPTS, rule, greedy)
    for group in (PROMPTS, [PROMPTS[1]]):
        rows, metrics = speculative_generate(target, proposer, group, rule, greedy, k)
        expected = plain if len(group) == 3 else [plain[1]]
        assert [r.tokens for r in rows] == [r.tokens for r in expected]  # no near-tie exceptions
        assert metrics.proposed > 0


def bf16_draft():
    """Another model of the target's vocabulary, bf16 matrices and fp32 arithmetic: it agrees sometimes."""
    return store_matrices_bf16(tiny_model(6))
