"""A GGUF file's F16, BF16 and F32 matrices run as stored (kernels.FLOAT_FORMATS; isa.h's float panels):
the panels hold the file's values bit for bit in as many bytes, the kernels compute the fp32 FMA chain
over k in order (`fma_chain`, an exact reference in PyTorch) over gguf's own dequantization of the
file's bytes, at every row count on each instruction set, and a file in these types runs every matrix
as stored (no conversion to bf16, no warning), with speculative greedy equal to plain greedy."""
from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from gguf.quants import dequantize, quantize

from specdec import kernels
from specdec.api import load
from specdec.lm import device, gguf
from specdec.lm.gguf_blocks import FORMATS
from specdec.lm.model import Linear, stored_formats

from ..gguf_helpers import Q, byte_level_tokenizer, hf_model, write_gguf
from ..lm.test_quant import assert_speculation_equals_plain_on_each_isa, needs_kernels, on_each_isa

TYPES = {name: Q[f.gguf] for name, f in kernels.FLOAT_FORMATS.items()}


def fma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """fp32 a b + c rounded once (the FMA instruction's result), exactly: the product is exact in
    float64 (48 bits); where the float64 sum was rounded (its error e, from TwoSum, not 0) and lies on a
    midpoint between two fp32 values, the exact sum is on e's side of it."""
    p, c64 = a.double() * b.double(), c.double()
    s = p + c64
    t = s - p
    e = (p - (s - t)) + (c64 - t)
    r = s.float()  # to nearest, ties to even
    d = s - r.double()  # exact: r is the fp32 value nearest s
    toward = torch.nextafter(r, torch.where(d > 0, torch.full_like(r, torch.inf), torch.full_like(r, -torch.inf)))
    midpoint = (d != 0) & ((toward.double() - r.double()).abs() == 2 * d.abs())
    return torch.where(midpoint & (e != 0) & ((e > 0) == (d > 0)), toward, r)


def fma_chain(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x (M, K) fp32 times w (N, K) fp32 transposed as the float kernels compute it: output (m, n) is
    fma(x[m][k], w[n][k], .) over k = 0..K-1 in order, from 0."""
    acc = torch.zeros(x.shape[0], w.shape[0])
    for k in range(x.shape[1]):
        acc = fma(x[:, k:k + 1], w[:, k][None, :], acc)
    return acc


def test_the_fma_reference_rounds_once():
    """fma against exact rational arithmetic on values chosen to land on fp32 midpoints after a float64
    rounding, and on random values."""
    from fractions import Fraction
    g = torch.Generator().manual_seed(0)
    a = torch.randn(4000, generator=g)
    b = torch.randn(4000, generator=g)
    c = torch.randn(4000, generator=g) * torch.pow(2.0, torch.randint(-40, 40, (4000,), generator=g).float())
    a[:2], b[:2] = 1 + 2.0 ** -23, 1 + 2.0 ** -23  # a b = 1 + 2^-22 + 2^-46: a float64 midpoint case with c below
    c[:2] = torch.tensor([2.0 ** -24 - 2.0 ** -22, -(2.0 ** -22)])
    got = fma(a, b, c)
    for i in range(4000):
        exact = Fraction(float(a[i])) * Fraction(float(b[i])) + Fraction(float(c[i]))
        below = torch.tensor(float(exact), dtype=torch.float32)  # a candidate; the nearest fp32 is it or a neighbour
        near = [below] + [torch.nextafter(below, torch.tensor(side)) for side in (torch.inf, -torch.inf)]
        best = min(near, key=lambda v: (abs(Fraction(float(v)) - exact), int(v.view(torch.int32)) & 1))
        assert float(got[i]) == float(best), (i, float(a[i]), float(b[i]), float(c[i]))


def file_tensor(format: str, N: int, K: int, seed: int) -> tuple[np.ndarray, torch.Tensor]:
    """Weights (N, K) ~ N(0, 1), a few of them tiny (f16's subnormals), as gguf writes them in `format`:
    (the raw tensor, gguf's dequantization of it in fp32)."""
    w = np.random.default_rng(seed).standard_normal((N, K)).astype(np.float32)
    w[0, :8] = [1e-6, -3e-7, 6e-8, 0.0, -0.0, 65504.0, 1e-40, 3.3e-5]
    raw = quantize(w, TYPES[format])
    return raw, torch.from_numpy(dequantize(raw, TYPES[format]).astype(np.float32)).reshape(N, K)


@pytest.mark.parametrize("format", TYPES)
def test_the_panels_hold_the_files_values_in_its_bytes(format):
    raw, values = file_tensor(format, 37, 96, 1)
    matrix = kernels.Matrix.from_gguf(raw, format, (37, 96))
    assert matrix.data.dtype == kernels.FLOAT_FORMATS[format].dtype and FORMATS[TYPES[format].name] == format
    assert torch.equal(matrix.dense().float(), values) and matrix.nbytes == -(-37 // 16) * 16 * raw.nbytes // 37
    assert torch.equal(matrix.rows(torch.tensor([36, 0, 5])).dense().float(), values[[36, 0, 5]])
    if format == "f16":  # the file's half floats, not their bf16 rounding
        assert not torch.equal(values, values.bfloat16().float())


@needs_kernels
@pytest.mark.parametrize("format", TYPES)
def test_each_row_of_the_kernel_is_the_fma_chain_over_ggufs_values(format):
    """N not a multiple of 16, K not a multiple of 32, rows 1..16 in every split, bias and residual, both
    instruction sets: the fma_chain over gguf's dequantization, bit for bit."""
    g = torch.Generator().manual_seed(2)
    for seed, (N, K) in enumerate([(1, 8), (37, 96), (53, 200)]):
        raw, values = file_tensor(format, N, K, seed)
        matrix = kernels.Matrix.from_gguf(raw, format, (N, K))
        x = torch.randn(16, K, generator=g)
        bias, add = torch.randn(N, generator=g), torch.randn(16, N, generator=g)
        reference = add + (fma_chain(x, values) + bias)  # the kernels' order: the sum, the bias, then the residual
        for isa in on_each_isa():
            for rows in range(1, 17):
                parts = [kernels.compiled().linear(x[i:i + rows], matrix.data, matrix.kernel_format, N,
                                                   add[i:i + rows], bias) for i in range(0, 16, rows)]
                assert torch.equal(torch.cat(parts), reference), (isa, format, N, K, rows)


# ---- a GGUF file in these types, every matrix as stored ----

@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def float_file(request, tmp_path_factory, gguf_cache):
    """A qwen2 model (untied: its own embedding in F16; tied: the embedding, in F16, unembeds too) with every
    matrix in F16, BF16 or F32, cycled (a fused q/k/v of several: f32 panels), its matrices' values not
    bf16's (hf_model's, moved by ~3e-4)."""
    model = hf_model("qwen2", tie_word_embeddings=request.param)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 3e-4)
    return write_gguf(tmp_path_factory.mktemp("floats") / "floats.gguf", model, byte_level_tokenizer(), "qwen2",
                      types=(Q.F16, Q.BF16, Q.F32))


@needs_kernels
@torch.no_grad()
def test_a_files_float_matrices_run_as_stored(float_file):
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        target = load(float_file, quantize="gguf").model
    assert not [w for w in said if "not as stored" in str(w.message)]
    held = {name: m for name, m in target.named_modules() if isinstance(m, Linear)}
    assert {m.stored.format for m in held.values()} == {"f16", "bf16", "f32"} and target.stack is not None
    assert all(m.weight is None for m in held.values())  # the panels alone, no second copy
    embedding = next(raw for raw in gguf.raw_tensors(float_file) if raw.name == "model.embed_tokens.weight")
    assert torch.equal(target.model.embed_tokens.weight, torch.from_numpy(np.array(dequantize(embedding.data, Q.F16))))
    for raw in gguf.raw_tensors(float_file):
        if raw.name.endswith("proj.weight") and raw.name.startswith("model.layers.1.mlp.down"):
            values = torch.from_numpy(np.array(dequantize(raw.data, Q[raw.type]))).reshape(raw.shape)
            assert torch.equal(held["model.layers.1.mlp.down_proj"].dense().float(), values)
    ids = torch.randint(3, 300, (2, 10), generator=torch.Generator().manual_seed(1))
    default = load(float_file).model  # the default: as stored, the very same panels
    assert all(torch.equal(m.dense(), held[name].dense()) for name, m in default.named_modules()
               if isinstance(m, Linear))
    assert torch.equal(default(ids).logits, target(ids).logits)
    converted = load(float_file, quantize="bf16").model  # the bf16 conversion: another model where F16 or F32
    assert (target(ids).logits - converted(ids).logits).abs().max() > 0


@needs_kernels
def test_speculative_greedy_equals_plain_greedy_in_float_formats(float_file):
    target = load(float_file, quantize="gguf").model
    assert_speculation_equals_plain_on_each_isa(target)


@needs_kernels
def test_the_conditions_name_the_quantized_kernels_only_where_a_matrix_is_quantized(float_file):
    target = load(float_file, quantize="gguf").model
    said = device.backend(torch.device("cpu"), torch.float32, target.stack, stored=stored_formats(target))
    assert "f16" in said and "bf16" in said and "quantized:" not in said
    assert "quantized:" in device.backend(torch.device("cpu"), torch.float32, target.stack, stored="f16 + q4_k")
