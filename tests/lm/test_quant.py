"""Quantized matrices (kernels/blocks.py, quant.h): each format's kernel computes exactly the PyTorch
reference of its arithmetic (blocks.linear) at every row count and on both instruction sets; the
blocks are llama.cpp's (gguf.quants quantizes and dequantizes them the same way; a GGUF file's
tensors as stored: test_gguf_blocks.py); a quantized target's speculative greedy output equals its plain greedy
output; the self-draft (the target quantized to 4 bits) is lossless under sampling."""
from __future__ import annotations

import dataclasses
import itertools
import json
import os

import gguf
import numpy as np
import pytest
import torch

from specdec import kernels
from specdec.cli import main
from specdec.decoding.engine import Engine, Request, plain_generate, speculative_generate
from specdec.decoding.sampling import SamplingConfig, probabilities
from specdec.decoding.stopping import StopRule
from specdec.errors import SpecdecError
from specdec.kernels import blocks
from specdec.lm.checkpoint import quantize_model
from specdec.lm.interface import admit
from specdec.lm.model import Embedding, Linear, requantize, store_matrices
from specdec.api import Loaded
from specdec.proposers import DRAFTERS, NgramProposer, SelfDraftProposer, build_drafter

from ..conftest import TINY, tiny_model
from ..spec_helpers import tiny_llama
from ..decoding.test_engine_sampling import accept_always, distribution_test, passes

FORMATS = blocks.QUANTIZED
GGUF_TYPES = {"q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_0": gguf.GGMLQuantizationType.Q4_0,
              "q4_1": gguf.GGMLQuantizationType.Q4_1}
RUNS = os.environ.get("SPECDEC_KERNELS") != "0" and kernels.compiled() is not None
ISAS = (["avx2"] + (["avx512"] if kernels.compiled().isa() == "avx512" else [])) if RUNS else []
needs_kernels = pytest.mark.skipif(not RUNS, reason="the CPU kernels do not run here")


def assert_speculation_equals_plain_on_each_isa(target) -> None:
    """On every instruction set here: the self-draft (k=3) and n-gram lookup (k=2) over two prompts,
    greedy, emit plain decoding's tokens exactly, having drafted."""
    prompts, rule, greedy = [[5, 9, 2, 5, 9], list(range(20, 37))], StopRule(max_new_tokens=24), SamplingConfig()
    for isa in on_each_isa():
        plain, _ = plain_generate(target, prompts, rule, greedy)
        for proposer, k in [(SelfDraftProposer(target=target), 3), (NgramProposer(), 2)]:
            rows, metrics = speculative_generate(target, proposer, prompts, rule, greedy, k)
            assert [r.tokens for r in rows] == [r.tokens for r in plain] and metrics.proposed > 0, isa


def on_each_isa():
    """Yields each instruction set the kernels can run on here, set, and restores the first."""
    before = kernels.isa()
    try:
        for name in ISAS:
            kernels.compiled().set_isa(name)
            yield name
    finally:
        kernels.compiled().set_isa(before)


@needs_kernels
@pytest.mark.parametrize("format", FORMATS)
def test_each_row_of_the_kernel_equals_the_pytorch_reference_exactly(format):
    """Odd shapes (N not a multiple of 16, one to five blocks), rows 1..16 in every split, bias and
    residual, both instruction sets: the same bits as blocks.linear."""
    g = torch.Generator().manual_seed(1)
    for N, K in [(1, 32), (37, 64), (16, 96), (53, 160)]:
        w = torch.randn(N, K, generator=g)
        matrix = kernels.Matrix.store(w, format)
        x = torch.randn(16, K, generator=g) * 4
        x[3, :32] = 0  # a block of zeros: scale 0
        bias, add = torch.randn(N, generator=g), torch.randn(16, N, generator=g)
        reference = blocks.linear(x, matrix.blocks(), bias)
        for isa in on_each_isa():
            for rows in range(1, 17):
                parts = [kernels.compiled().linear(x[i:i + rows], matrix.data, kernels.FORMATS.index(format), N,
                                                   add[i:i + rows], bias) for i in range(0, 16, rows)]
                assert torch.equal(torch.cat(parts), add + reference), (isa, N, K, rows)


@needs_kernels
@pytest.mark.parametrize("format", FORMATS)
def test_fine_activations_are_the_reference_exactly_and_a_hundred_times_closer_to_the_exact_product(format):
    """A matrix multiplying fine activations (each row and its rounding residual): blocks.fine_linear's
    bits at every row count, with bias and residual, on both instruction sets, a tiny block and a
    block of zeros among the rows; and its error against the float64 product of the same weights
    below 1/100 of the int8 rows' error (a wrong residual, say x - q alone, fails this)."""
    g = torch.Generator().manual_seed(2)
    N, K = 53, 160
    w = torch.randn(N, K, generator=g)
    fine, coarse = kernels.Matrix.store(w, format, fine=True), kernels.Matrix.store(w, format)
    assert fine.kernel_format == coarse.kernel_format | kernels.FINE and torch.equal(fine.data, coarse.data)
    x = torch.randn(8, K, generator=g) * 4
    x[3, :32], x[5, 32:64] = 0, x[5, 32:64] * 1e-30
    bias, add = torch.randn(N, generator=g), torch.randn(8, N, generator=g)
    reference = blocks.fine_linear(x, fine.blocks(), bias)
    assert torch.equal(fine.reference(x, bias), reference)
    for isa in on_each_isa():
        for rows in range(1, 9):
            parts = [kernels.compiled().linear(x[i:i + rows], fine.data, fine.kernel_format, N, add[i:i + rows], bias)
                     for i in range(0, 8, rows)]
            assert torch.equal(torch.cat(parts), add + reference), (isa, rows)
    exact = x.double() @ fine.dense().double().T + bias.double()
    error = lambda y: (y.double() - exact).abs().max().item()
    assert error(reference) < error(blocks.linear(x, coarse.blocks(), bias)) / 100


@needs_kernels
def test_fine_activations_are_refused_for_a_bf16_matrix_and_inside_a_stack_of_layers():
    with pytest.raises(ValueError, match="quantized matrix"):
        kernels.Matrix.store(torch.randn(16, 32), "bf16", fine=True)
    model = tiny_model(2)
    given = {name: kernels.Matrix.store(m.weight, "q8_0", fine=name.endswith("layers.0.mlp.down_proj"))
             for name, m in model.named_modules() if isinstance(m, Linear)}
    with pytest.raises(RuntimeError, match="fine activations"):
        store_matrices(model, None, given)


@needs_kernels
@pytest.mark.parametrize("format", FORMATS)
def test_every_code_of_a_format_multiplies_exactly(format):
    """Blocks no quantizer makes (a GGUF file may hold them): every code, Q8_0's -128 included, and
    scales and mins of any sign."""
    g = torch.Generator().manual_seed(4)
    N, K = 40, 128
    top = 256 if format == "q8_0" else 16
    codes = torch.randint(0, top, (N, K), generator=g, dtype=torch.uint8)
    codes[0] = torch.arange(K) % top
    scales = (torch.randn(N, K // 32, generator=g) * 0.01).half()
    mins = (torch.randn(N, K // 32, generator=g) * 0.05).half() if format == "q4_1" else None
    matrix = kernels.Matrix.from_blocks(blocks.Blocks(format, codes, scales, mins))
    x = torch.randn(5, K, generator=g)
    reference = blocks.linear(x, matrix.blocks())
    for isa in on_each_isa():
        assert torch.equal(kernels.linear(x, matrix.dense(), matrix), reference), isa


@needs_kernels
def test_activation_rows_are_quantized_as_the_reference_quantizes_them():
    x = torch.randn(7, 96) * torch.tensor([1e-3, 1.0, 30.0]).repeat_interleave(32)
    x[0, 5] = 0.5 * x[0].abs()[:32].max()  # halves land on .5 ties in some blocks
    for got, want in zip(kernels.compiled().quantize_rows(x), blocks.quantize_rows(x)):
        assert torch.equal(got, want)


@needs_kernels
def test_tiny_and_denormal_blocks_quantize_as_if_scaled_up_and_as_the_reference_does():
    """Blocks whose largest magnitude is below 2^-64 (1 / dx overflows below ~3.7e-37; denormal
    values; a denormal dx): their q are those of the block scaled up by a power of two, on both
    instruction sets and in blocks.quantize_rows, bit for bit, and so is a quantized matrix times them."""
    g = torch.Generator().manual_seed(6)
    x = torch.randn(6, 160, generator=g)
    x[0, :32] = torch.randint(-1000, 1001, (32,), generator=g) * 2.0 ** -135  # exact, max 2.3e-38
    x[1, 32:64] *= 1e-44  # denormals (a few multiples of 2^-149)
    x[2, 64:96] *= 2e-36  # dx denormal, 1 / dx finite
    x[3, 96:128] = 0
    x[4] *= 2.0 ** -100
    x[5, 128:] = torch.randint(-127, 128, (32,), generator=g) * 2.0 ** -149  # denormal values only
    up = x.clone()
    up[0, :32] *= 2.0 ** 100
    up[5, 128:] *= 2.0 ** 70
    up[5, 128:] *= 2.0 ** 70  # (2^140 itself is no float32)
    ref, ref_up = blocks.quantize_rows(x), blocks.quantize_rows(up)
    assert torch.equal(ref[0][0, :32], ref_up[0][0, :32]) and torch.equal(ref[0][5, 128:], ref_up[0][5, 128:])
    assert ref[0][0, :32].abs().max() == 127 and torch.equal(ref[0][3, 96:128], torch.zeros(32, dtype=torch.int8))
    matrices = [kernels.Matrix.store(torch.randn(37, 160, generator=g), format) for format in FORMATS]
    for isa in on_each_isa():
        for got, want in zip(kernels.compiled().quantize_rows(x), ref):
            assert torch.equal(got, want), isa
        for m in matrices:
            assert torch.equal(kernels.linear(x, m.dense(), m), blocks.linear(x, m.blocks())), (isa, m.format)


@needs_kernels
@pytest.mark.parametrize("format", FORMATS)
def test_an_activation_that_is_not_finite_makes_its_row_nan_and_leaves_the_others(format):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(4, 96, generator=g)
    x[1, 40], x[2, 3] = float("inf"), float("nan")
    m = kernels.Matrix.store(torch.randn(20, 96, generator=g), format)
    want = blocks.linear(x, m.blocks())
    assert want[1:3].isnan().all() and not want[[0, 3]].isnan().any()
    for isa in on_each_isa():
        got = kernels.linear(x, m.dense(), m)
        assert got[1:3].isnan().all() and torch.equal(got[[0, 3]], want[[0, 3]]), isa


def test_a_weight_block_too_small_for_the_reciprocal_of_its_scale_gets_the_codes_of_zeros():
    """llama.cpp's quantizers compute 1 / d, infinite for such a block (fp16 keeps its scale as 0 anyway):
    codes of zeros, the dequantized values gguf.quants gives (zeros, Q4_1's min)."""
    w = torch.randn(3, 64, generator=torch.Generator().manual_seed(8))
    w[1, :32] *= 2.0 ** -130
    for format, qtype in GGUF_TYPES.items():
        b = blocks.quantize(w, format)
        assert (b.codes[1, :32].int() == (0 if format == "q4_1" else blocks.OFFSET[format])).all(), format
        with np.errstate(over="ignore", invalid="ignore"):  # gguf.quants' own 1 / d overflows there
            raw = gguf.quants.quantize(w.numpy(), qtype)
        assert torch.equal(b.dense(), torch.from_numpy(gguf.quants.dequantize(raw, qtype))), format


def test_the_reference_is_the_product_of_the_dequantized_values():
    """blocks.linear is the dot product of the quantized activations and weights (up to fp32 rounding)."""
    g = torch.Generator().manual_seed(2)
    w, x = torch.randn(24, 64, generator=g), torch.randn(3, 64, generator=g)
    for format in FORMATS:
        b = blocks.quantize(w, format)
        q, d, _ = blocks.quantize_rows(x)
        xq = (q.double().reshape(3, 2, 32) * d.double()[..., None]).reshape(3, 64)
        torch.testing.assert_close(blocks.linear(x, b).double(), xq @ b.dense().double().T, rtol=1e-5, atol=1e-5)
        assert torch.equal(blocks.unpack(blocks.pack(b), format, b.shape).codes, b.codes)


def test_quantize_rounds_as_llama_cpp_and_gguf_blocks_load_as_stored():
    """Our quantizer gives the blocks gguf.quants (llama.cpp's reference rounding) gives, and a GGUF
    tensor's raw blocks (from_gguf) hold exactly the values gguf.quants dequantizes."""
    w = (torch.randn(20, 96, generator=torch.Generator().manual_seed(3)) * 0.05).numpy()
    for format, qtype in GGUF_TYPES.items():
        raw = gguf.quants.quantize(w, qtype)  # (20, bytes per row)
        stored = blocks.from_gguf(raw, format, w.shape)
        assert torch.equal(stored.dense(), torch.from_numpy(gguf.quants.dequantize(raw, qtype)))
        ours = blocks.quantize(torch.from_numpy(w), format)
        assert torch.equal(ours.dense(), stored.dense()), format


def test_a_row_length_that_does_not_cut_into_blocks_is_refused_naming_the_matrix():
    model = tiny_model(0, dataclasses.replace(TINY, intermediate_size=80))
    with pytest.raises(SpecdecError, match=r"model\.layers\.\d\.mlp\.down_proj .*blocks of 32"):
        quantize_model(model, "q4_0")


def test_weights_that_are_not_finite_are_refused_naming_the_matrix():
    model = tiny_model(0)
    with torch.no_grad():
        model.model.layers[1].self_attn.o_proj.weight[3, 7] = float("inf")
    with pytest.raises(SpecdecError, match=r"quantize model\.layers\.1\.self_attn\.o_proj \(\d+ x \d+\) to q8_0: 1 of "
                                           r"its weights are not finite \(the first at \(3, 7\): inf\)"):
        quantize_model(model, "q8_0")
    b = blocks.quantize(tiny_model(0).model.layers[0].mlp.down_proj.weight, "q4_1")
    b.scales[2, 1] = float("nan")  # a file's block
    with pytest.raises(SpecdecError, match=r"run model\.layers\.0\.mlp\.down_proj .* as stored \(q4_1\): "
                                           r".*block scales"):
        store_matrices(tiny_model(0), None, {"model.layers.0.mlp.down_proj": kernels.Matrix.from_blocks(b)})


@needs_kernels
def test_requantize_stores_each_wider_matrix_anew_from_its_values_and_never_widens_one():
    """A model in Q8_0 requantized to Q4_0: each matrix is blocks.quantize of its exact values (the
    very blocks quantizing the dense values gives), its layers stacked anew, a tied embedding reading
    the new blocks; asked for Q8_0 again nothing changes (no matrix reads more than Q8_0 would). A
    model computing in bf16 is refused."""
    model = quantize_model(tiny_model(3, dataclasses.replace(TINY, tie_word_embeddings=True)), "q8_0")
    values = {name: m.dense() for name, m in model.named_modules() if isinstance(m, Linear)}
    assert requantize(model, "q8_0") == 0
    assert requantize(model, "q4_0") == len(values) and model.stack is not None
    for name, m in model.named_modules():
        if isinstance(m, Linear):
            assert m.stored.format == "q4_0" and m.weight is None
            assert torch.equal(m.dense(), blocks.quantize(values[name], "q4_0").dense()), name
    assert model.model.embed_tokens.stored is model.lm_head.stored
    fresh = tiny_model(3, dataclasses.replace(TINY, tie_word_embeddings=True))
    with torch.no_grad():
        for name, m in fresh.named_modules():
            if isinstance(m, Linear):
                m.weight.copy_(values[name])
    tokens = torch.tensor([[5, 9, 2, 7, 1]])  # the layers' one kernel call reads the new blocks, not the old
    assert torch.equal(model(tokens).logits, quantize_model(fresh, "q4_0")(tokens).logits)
    with pytest.raises(SpecdecError, match="run on the CPU in float32"):
        requantize(tiny_model(3).to(torch.bfloat16), "q4_0")


PROMPTS = [[5, 9, 2], [7, 1, 2, 3, 1, 2, 3, 1, 2], list(range(20, 37))]


@needs_kernels
@pytest.mark.parametrize("format", FORMATS)
def test_a_quantized_targets_speculative_greedy_equals_its_plain_greedy(format):
    """Every batch size and draft length, drafters of each kind (a self-draft, n-gram), both
    instruction sets: token for token, no near-tie allowance."""
    target = quantize_model(tiny_model(5), format)
    assert target.stack is not None and f"{format}-stored" in target.abilities.backend
    rule, greedy = StopRule(max_new_tokens=30), SamplingConfig()
    for isa in on_each_isa():
        plain, _ = plain_generate(target, PROMPTS, rule, greedy)
        for name, k in [("self", 3), ("ngram", 1), ("self", 6)]:
            proposer = SelfDraftProposer(target=target) if name == "self" else NgramProposer()
            for group, expected in [(PROMPTS, plain), ([PROMPTS[1]], [plain[1]])]:
                rows, metrics = speculative_generate(target, proposer, group, rule, greedy, k)
                assert [r.tokens for r in rows] == [r.tokens for r in expected], (isa, name, k)
                assert metrics.proposed > 0


# ---- the self-draft under sampling: the first three tokens' joint distribution is the target's ----

V, N = 16, 40_000  # fewer samples than test_engine_sampling: the bound and the p-value account for N
TARGET = tiny_llama(0, vocab=V, layers=1, hidden=32, heads=2, kv_heads=1, context=32, std=0.4)
PROMPT = [2, 4, 2]


@torch.no_grad()
def exact_joint(sampling: SamplingConfig) -> torch.Tensor:
    """(V^3,) float64: P(t1, t2, t3 | PROMPT) under TARGET."""
    seqs = torch.tensor([PROMPT + list(c) for c in itertools.product(range(V), repeat=3)])
    P = len(PROMPT)
    probs = probabilities(TARGET(seqs).logits[:, P - 1:P + 2], sampling).double()
    return probs.gather(2, seqs[:, P:, None]).squeeze(2).prod(1)


def self_draft_counts(sampling: SamplingConfig, k: int, sampled_verify=None):
    rule, generator = StopRule(max_new_tokens=max(3, k + 1)), torch.Generator().manual_seed(1234)
    extra = {} if sampled_verify is None else {"sampled_verify": sampled_verify}
    rows, metrics = speculative_generate(TARGET, SelfDraftProposer(target=TARGET), [PROMPT] * N, rule, sampling,
                                         k, generator, **extra)
    first3 = torch.tensor([row.tokens[:3] for row in rows])
    return torch.bincount(first3[:, 0] * V * V + first3[:, 1] * V + first3[:, 2], minlength=V ** 3).double(), metrics


def test_the_self_draft_samples_the_targets_distribution():
    sampling = SamplingConfig(temperature=0.7, top_k=8, top_p=0.9)
    counts, metrics = self_draft_counts(sampling, 3)
    assert passes(distribution_test(counts, exact_joint(sampling)))
    assert metrics.accepted > 0.3 * N  # the 4-bit copy agrees with its target: drafts are accepted


def test_the_same_test_fails_for_a_verifier_that_keeps_every_draft():
    sampling = SamplingConfig(temperature=0.7, top_k=8, top_p=0.9)
    counts, _ = self_draft_counts(sampling, 3, accept_always)
    assert not passes(distribution_test(counts, exact_joint(sampling)))


def test_the_self_draft_is_the_target_in_4_bits():
    proposer = SelfDraftProposer(target=TARGET)
    draft = proposer.model
    formats = {name: m.stored.format for name, m in draft.named_modules() if getattr(m, "stored", None) is not None}
    assert formats.pop("lm_head") == "q8_0" and set(formats.values()) == {"q4_1"} and len(formats) == 4
    assert draft.lm_head.stored.fine and not any(m.stored.fine for name, m in draft.named_modules()
                                                 if getattr(m, "stored", None) is not None and name != "lm_head")
    assert TARGET.lm_head.stored is None  # the target itself is left as it was
    assert (draft.lm_head.dense() - TARGET.lm_head.weight).abs().max() < 0.1


def test_the_self_draft_reads_the_targets_cache_and_feeds_only_its_newest_token_and_drafts():
    """No cache and no prefill of its own: the draft attends to the engine's cache, each of its
    forwards feeds one token per row (the newest committed one, then its drafts), even after a
    prompt of 12 tokens and steps that accept several drafts; greedy output equals plain decoding's,
    and the engine's cache is left as the engine keeps it (its host lengths)."""
    target, rule = tiny_llama(3), StopRule(max_new_tokens=24)
    proposer = SelfDraftProposer(target=target)
    widths = []
    forward = proposer.model.forward
    proposer.model.forward = lambda tokens, *a, **kw: widths.append(tokens.shape[1]) or forward(tokens, *a, **kw)
    engine = Engine(admit(target), proposer, 3, capacity=2, max_len=64)
    assert engine.drafting.state.cache is engine.cache
    requests = [Request(list(range(20, 32)), rule), Request([5, 9, 2], rule)]
    for request in requests:
        engine.submit(request)
    while engine.busy:
        engine.step()
        assert engine.cache.held == engine.cached
    assert widths and max(widths) == 1 and engine.metrics.accepted > engine.metrics.steps
    plain, _ = plain_generate(target, [r.prompt for r in requests], rule, SamplingConfig())
    assert [r.row.tokens for r in requests] == [row.tokens for row in plain]


def test_a_self_draft_of_another_shape_refuses_the_targets_cache():
    with pytest.raises(SpecdecError, match="do not have the target's shapes"):
        Engine(admit(tiny_llama(3)), SelfDraftProposer(target=tiny_llama(3, layers=3)), 3, capacity=1, max_len=32)


def test_a_quantized_tables_lookups_are_its_rows_whether_kept_or_unpacked_and_few_are_kept(monkeypatch):
    """An embedding held as Q8_0 blocks (a tied unembedding's: the self-draft's, a Q8_0 target's):
    every lookup equals the blocks' rows exactly, unpacked (a first lookup) or kept (a repeated one,
    no unpacking); at most KEPT_BYTES of rows are kept, the newest."""
    table = Embedding(64, 32)
    table.store(kernels.Matrix.store(torch.randn(64, 32, generator=torch.Generator().manual_seed(0)), "q8_0"))
    dense = table.stored.dense()
    monkeypatch.setattr(type(table), "KEPT_BYTES", 4 * table.embedding_dim * 4)  # four fp32 rows
    unpacked = []
    row_blocks = kernels.Matrix.row_blocks
    monkeypatch.setattr(kernels.Matrix, "row_blocks", lambda self, ids: unpacked.append(ids.tolist()) or
                        row_blocks(self, ids))
    ids = torch.tensor([[3, 5, 3], [7, 1, 5]])
    with torch.inference_mode():
        assert torch.equal(table(ids), dense[ids]) and torch.equal(table(ids), dense[ids])
        assert unpacked == [[3, 5, 7, 1]] and list(table.kept) == [3, 5, 7, 1]
        assert torch.equal(table(torch.tensor([9, 5])), dense[[9, 5]])
        assert list(table.kept) == [7, 1, 9, 5] and unpacked[-1] == [9]  # 3 was the oldest
        assert torch.equal(table(torch.tensor([3])), dense[[3]]) and unpacked[-1] == [3]


def test_a_self_draft_with_a_bf16_head_drafts_over_a_draft_vocabulary():
    # its unembedding held as a bf16 matrix (no parameter beside it): the vocabulary's rows are its values
    counts = torch.arange(V, 0, -1)  # id 0 the most frequent
    proposer = SelfDraftProposer(target=TARGET, head_format="bf16", draft_vocab=V // 2, token_counts=counts)
    assert proposer.model.lm_head.weight is None and proposer.model.lm_head.stored.format == "bf16"
    assert torch.equal(proposer.vocab.unembedding.weight, proposer.model.lm_head.dense()[:V // 2].float())
    rows, _ = speculative_generate(TARGET, proposer, [PROMPT], StopRule(max_new_tokens=6), SamplingConfig(), 2)
    assert rows[0].tokens == plain_generate(TARGET, [PROMPT], StopRule(max_new_tokens=6), SamplingConfig())[0][0].tokens


def test_a_self_drafts_vocabulary_keeps_its_heads_fine_activations():
    counts = torch.arange(V, 0, -1)
    proposer = SelfDraftProposer(target=TARGET, draft_vocab=V // 2, token_counts=counts)
    unembedding = proposer.vocab.unembedding.stored
    assert unembedding.fine and unembedding.format == "q8_0" and unembedding.shape[0] == V // 2
    rows, _ = speculative_generate(TARGET, proposer, [PROMPT], StopRule(max_new_tokens=6), SamplingConfig(), 2)
    assert rows[0].tokens == plain_generate(TARGET, [PROMPT], StopRule(max_new_tokens=6), SamplingConfig())[0][0].tokens


def test_generate_quantized_with_the_self_draft_names_the_format(capsys, tiny_checkpoint):
    args = ["generate", "--model", str(tiny_checkpoint), "--prompt", "def f(x):", "--max-new-tokens", "12",
            "--temperature", "0", "--quantize", "q4_0", "--json"]
    assert main(args) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main([*args, "--draft", "self", "-k", "3"]) == 0
    drafted = json.loads(capsys.readouterr().out)
    assert plain["stats"]["weights"] == drafted["stats"]["weights"] == "q4_0"
    assert "q4_0-stored" in plain["stats"]["backend"] and drafted["tokens"] == plain["tokens"]


@needs_kernels
def test_a_matrix_in_no_kernel_format_keeps_its_layers_on_pytorch_operators():
    """A GGUF file's F16 matrix, say: the others run as stored, the layers holding it on PyTorch
    operators (named in `unstacked`), and the model still decodes."""
    model = tiny_model(3)
    given = {name: kernels.Matrix.store(m.weight, "q8_0") for name, m in model.named_modules()
             if isinstance(m, Linear) and not name.endswith("layers.1.mlp.down_proj")}
    store_matrices(model, None, given)
    assert model.stack is None and "layers.1.mlp.down_proj" in model.unstacked
    assert model.model.layers[0].stack is not None and model.model.layers[1].stack is None
    rows, _ = plain_generate(model, PROMPTS, StopRule(max_new_tokens=5), SamplingConfig())
    assert all(len(r.tokens) == 5 for r in rows)


def test_a_self_draft_that_cannot_quantize_the_target_says_so_before_reading_a_weight(tmp_path):
    """A hidden size of 48 does not cut into blocks of 32: the registry refuses the self-draft with the
    reason (bench skips it by that reason) instead of failing inside the quantizer."""
    target = Loaded(tiny_llama(0, hidden=48, heads=4, kv_heads=2), None, tmp_path)
    reason = DRAFTERS["self"].misfit(target)
    assert reason is not None and "blocks of 32" in reason and "hidden size" in reason
    with pytest.raises(SpecdecError, match="another drafter"):
        build_drafter("self", target)
    assert DRAFTERS["self"].misfit(Loaded(tiny_llama(0), None, tmp_path)) is None

