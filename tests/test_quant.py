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
import pytest
import torch

from specdec import kernels
from specdec.cli import main
from specdec.decoding.engine import plain_generate, speculative_generate
from specdec.decoding.sampling import SamplingConfig, probabilities
from specdec.decoding.stopping import StopRule
from specdec.errors import SpecdecError
from specdec.kernels import blocks
from specdec.lm.checkpoint import quantize_model
from specdec.lm.model import Linear, store_matrices
from specdec.api import Loaded
from specdec.proposers import DRAFTERS, build_drafter, build_proposer

from .conftest import TINY, tiny_model
from .spec_helpers import tiny_llama
from .test_engine_sampling import accept_always, distribution_test, passes

FORMATS = blocks.QUANTIZED
GGUF_TYPES = {"q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_0": gguf.GGMLQuantizationType.Q4_0,
              "q4_1": gguf.GGMLQuantizationType.Q4_1}
RUNS = os.environ.get("SPECDEC_KERNELS") != "0" and kernels.compiled() is not None
ISAS = (["avx2"] + (["avx512"] if kernels.compiled().isa() == "avx512" else [])) if RUNS else []
needs_kernels = pytest.mark.skipif(not RUNS, reason="the CPU kernels do not run here")


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
            proposer = build_proposer("self", target=target) if name == "self" else build_proposer("ngram")
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
    rows, metrics = speculative_generate(TARGET, build_proposer("self", target=TARGET), [PROMPT] * N, rule, sampling,
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
    proposer = build_proposer("self", target=TARGET)
    draft = proposer.model
    formats = {name: m.stored.format for name, m in draft.named_modules() if getattr(m, "stored", None) is not None}
    assert formats.pop("lm_head") == "q8_0" and set(formats.values()) == {"q4_1"} and len(formats) == 4
    assert TARGET.lm_head.stored is None  # the target itself is left as it was
    assert (draft.lm_head.weight - TARGET.lm_head.weight).abs().max() < 0.1


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

