"""The formats read from GGUF files as stored (kernels/blocks.py's AS_STORED: Q5_0, Q5_1, the K-quants;
quant.h, kquant.h), each described once (blocks.BLOCK_FORMATS, checked against gguf's sizes): the
blocks hold exactly what gguf.quants dequantizes (blocks gguf quantizes, Q5_0 and Q5_1, or built here
following GGUF's layout, the K-quants; and blocks of random bytes: every code and scale), the kernels compute
blocks.linear's very bits at every row count on each instruction set, blocks.linear is the product of
the quantized activations and the weights, and a GGUF file in these types runs every matrix as
stored, as a target and as a draft model, with speculative greedy equal to plain greedy."""
from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf.quants import IQ4_NL, dequantize

from specdec import kernels
from specdec.api import load, load_drafter
from specdec.decoding.engine import plain_generate
from specdec.decoding.engine import speculative_generate
from specdec.decoding.sampling import SamplingConfig
from specdec.decoding.stopping import StopRule
from specdec.kernels import LANES, blocks
from specdec.lm import gguf
from specdec.lm.gguf_blocks import FORMATS
from specdec.lm.model import Linear
from specdec.proposers.draft_model import DraftModelProposer
from specdec.proposers.drafters import DraftModelOptions

from ..gguf_helpers import Q, byte_level_tokenizer, hf_model, quantize_any, write_gguf
from ..lm.test_quant import RUNS, assert_speculation_equals_plain_on_each_isa, needs_kernels, on_each_isa

TYPES = {f: Q[blocks.BLOCK_FORMATS[f].gguf] for f in blocks.AS_STORED}
SCALE_BYTES = {"q5_0": [(0, 2)], "q5_1": [(0, 2), (2, 4)], "q4_k": [(0, 2), (2, 4)], "q5_k": [(0, 2), (2, 4)],
               "q6_k": [(208, 210)], "iq4_nl": [(0, 2)], "iq4_xs": [(0, 2)], "q3_k": [(108, 110)],
               "q2_k": [(80, 82), (82, 84)]}  # fp16 scales (and mins) in a GGUF block


def test_each_format_is_described_once():
    """blocks.BLOCK_FORMATS is the one description the reader, the packing and the kernels' ids derive
    from: its block sizes are gguf's, its kernel ids distinct, and the kernels' own table (types.h) says
    the same bytes and blocks of each format, and of no other."""
    for name, f in blocks.BLOCK_FORMATS.items():
        assert GGML_QUANT_SIZES[Q[f.gguf]] == (f.size, f.bytes), name
        assert blocks.PANEL_BLOCK_BYTES[name] * f.size == LANES * f.bytes * blocks.BLOCK
        assert kernels.KERNEL_FORMAT[name] == f.kernel and FORMATS[f.gguf] == name
    assert blocks.LEVELS["iq4_nl"] == IQ4_NL.kvalues and blocks.LEVELS["iq4_xs"] == IQ4_NL.kvalues
    ids = list(kernels.KERNEL_FORMAT.values()) + [kernels.MIXED]
    assert len(set(ids)) == len(ids) and max(ids) < kernels.FINE
    assert set(TYPES) | set(blocks.QUANTIZED) == set(blocks.BLOCK_FORMATS) == set(SCALE_BYTES) | set(blocks.QUANTIZED)
    if RUNS:
        table = kernels.compiled().format_table()
        assert {f.kernel: (blocks.PANEL_BLOCK_BYTES[name], f.size) for name, f in blocks.BLOCK_FORMATS.items()} == {
            kernel: entry for kernel, entry in enumerate(table) if entry[0] > 0}


def stored(format: str, N: int, K: int, seed: int) -> tuple[blocks.Blocks, np.ndarray]:
    """Weights (N, K) ~ N(0, 0.05) quantized in `format` as GGUF blocks: (Blocks, the raw bytes)."""
    w = (np.random.default_rng(seed).standard_normal((N, K)) * 0.05).astype(np.float32)
    raw = quantize_any(w, TYPES[format])
    return blocks.from_gguf(raw, format, (N, K)), raw


def random_blocks(format: str, N: int, K: int, seed: int) -> tuple[blocks.Blocks, np.ndarray]:
    """GGUF blocks of random bytes (every code, every sub-block scale, Q6_K's -128 too), their fp16
    scales random of either sign: blocks no quantizer makes, which a file may hold."""
    rng = np.random.default_rng(seed)
    size = blocks.BLOCK_FORMATS[format].size
    raw = rng.integers(0, 256, (N, K // size, blocks.GGUF_BLOCK_BYTES[format]), dtype=np.uint8)
    for a, b in SCALE_BYTES[format]:
        raw[..., a:b] = (rng.standard_normal((N, K // size, 1)) * 0.01).astype(np.float16).view(np.uint8)
    raw = raw.reshape(N, -1)
    return blocks.from_gguf(raw, format, (N, K)), raw


@pytest.mark.parametrize("format", TYPES)
def test_blocks_hold_what_gguf_dequantizes(format):
    for make in (stored, random_blocks):
        held, raw = make(format, 24, 512, 1)
        assert torch.equal(held.dense(), torch.from_numpy(dequantize(raw, TYPES[format]))), make.__name__
    w = (np.random.default_rng(1).standard_normal((24, 512)) * 0.05).astype(np.float32)
    error = np.abs(stored(format, 24, 512, 1)[0].dense().numpy() - w).max()
    assert error < {"q3_k": 0.04, "q2_k": 0.07}.get(format, 0.02)  # a quantization of w (3 and 2 bits: coarser)


@pytest.mark.parametrize("format", TYPES)
def test_the_packed_layout_holds_the_blocks_exactly(format):
    held, _ = random_blocks(format, 37, 768, 2)  # N not a multiple of 16
    data = blocks.pack(held)
    assert data.numel() == -(-37 // 16) * (768 // 32) * blocks.PANEL_BLOCK_BYTES[format]
    again = blocks.unpack(data, format, held.shape)
    for name, a, b in zip(held._fields[1:], held[1:], again[1:]):
        assert (a is None and b is None) or torch.equal(a, b), name
    picked = kernels.Matrix.from_blocks(held).rows(torch.tensor([3, 0, 36]))  # a draft vocabulary's rows
    assert torch.equal(picked.dense(), held.dense()[[3, 0, 36]])


@pytest.mark.parametrize("format", TYPES)
def test_the_packed_layout_takes_the_files_bytes(format):
    """A format runs as stored in memory: its packed panels hold what the file's blocks hold, in as
    many bytes (Q4_K's and Q5_K's sub-block scales and Q6_K's codes keep their 6 bits, Q5_x's codes 5)."""
    held, raw = random_blocks(format, 64, 512, 9)
    assert blocks.pack(held).numel() == raw.nbytes


def test_q5_0_is_packed_in_exactly_the_files_bytes():
    """Q5_0 runs in memory in the file's 5.5 bits a weight: 16 x 22 bytes per panel block of 16 outputs x
    32 k (16 fp16 scales, the codes' low 4 bits as nibbles, their fifth bits in one plane), not a byte a code."""
    assert blocks.PANEL_BLOCK_BYTES["q5_0"] == LANES * blocks.GGUF_BLOCK_BYTES["q5_0"] == 352
    held, raw = random_blocks("q5_0", 64, 512, 9)
    assert blocks.pack(held).numel() == kernels.Matrix.from_blocks(held).nbytes == raw.nbytes
    assert kernels.Matrix.from_gguf(raw, "q5_0", (64, 512)).nbytes == raw.nbytes


@needs_kernels
def test_q5_0_runs_in_its_own_format_with_the_q8_0_kernels_bits():
    """Q5_0's own kernel (codes held in 5 bits) gives the very bits of the Q8_0 kernel over the same
    weights (the codes u - 16 as Q8_0's, the same scales): the path Q5_0 ran before, a byte a code.
    Blocks of random codes and the extremes (every code 31, or 0, against activations all +-127: the
    largest integer sums AVX2's int16 lanes hold), every row count to 16, N not a multiple of 16, each
    instruction set."""
    g = torch.Generator().manual_seed(11)
    for seed, (N, K) in enumerate([(1, 32), (37, 512), (53, 896)]):
        held, _ = random_blocks("q5_0", N, K, 20 + seed)
        codes = held.codes.clone()
        codes[0, :64] = 31
        if N > 1:
            codes[1, :64] = 0
        held = blocks.Blocks("q5_0", codes, held.scales, None)
        matrix = kernels.Matrix.from_blocks(held)
        as_q8_0 = kernels.Matrix.from_blocks(blocks.Blocks("q8_0", (codes + 112).to(torch.uint8), held.scales, None))
        assert matrix.kernel_format not in (kernels.KERNEL_FORMAT["q8_0"], as_q8_0.kernel_format)
        x = torch.randn(16, K, generator=g) * 4
        x[0, :64], x[1, :64] = 1.0, -1.0  # q = 127, -127 in the first two blocks
        x[3, :32] = 0  # a block of zeros: scale 0
        bias, add = torch.randn(N, generator=g), torch.randn(16, N, generator=g)
        for isa in on_each_isa():
            for rows in range(1, 17):
                got, want = ([kernels.compiled().linear(x[i:i + rows], m.data, m.kernel_format, N, add[i:i + rows],
                                                        bias) for i in range(0, 16, rows)] for m in (matrix, as_q8_0))
                assert torch.equal(torch.cat(got), torch.cat(want)), (isa, N, K, rows)


@pytest.mark.parametrize("format", TYPES)
def test_a_files_tensor_packed_a_slice_of_rows_at_a_time_is_packed_exactly(format, monkeypatch):
    held, raw = random_blocks(format, 37, 512, 4)
    monkeypatch.setattr(kernels, "SLICE", 16)  # 3 slices, the last of 5 rows
    matrix = kernels.Matrix.from_gguf(raw, format, (37, 512))
    assert torch.equal(matrix.data, blocks.pack(held))
    ids = torch.tensor([36, 0, 17, 17, 5])  # rows looked up from their panels only (an embedding's)
    assert torch.equal(matrix.row_blocks(ids).dense(), held.dense()[ids])


@pytest.mark.parametrize("format", TYPES)
def test_the_reference_is_the_product_of_the_quantized_activations_and_weights(format):
    """blocks.linear is, to fp32 rounding, the product of the quantized activations and the weights as
    gguf.quants dequantizes the file's blocks."""
    held, raw = random_blocks(format, 20, 512, 3)
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(3))
    width = blocks.activation_block(format)  # the K-quants' activations per super-block of 256, the others' per 32
    q, d, _ = blocks.quantize_rows(x, width)
    xq = (q.double().reshape(3, 512 // width, width) * d.double()[..., None]).reshape(3, 512)
    exact = xq @ torch.from_numpy(dequantize(raw, TYPES[format])).double().reshape(20, 512).T
    torch.testing.assert_close(blocks.linear(x, held).double(), exact, rtol=1e-5, atol=1e-4)
    wrong = blocks.Blocks(format, held.codes.roll(1, dims=1), *held[2:])  # codes one k off: another product
    assert (blocks.linear(x, wrong).double() - exact).abs().max() > 0.1


@needs_kernels
def test_rows_are_quantized_per_super_block_for_the_k_quants_as_the_reference_does():
    """The K-quants' activations (llama.cpp's Q8_K: one scale per 256): q, dx and the sums of q per 16 on
    both instruction sets, bit for bit those of blocks.quantize_rows(x, 256), with a super-block of tiny
    values, one of zeros and one holding inf (q 0, dx NaN); one scale for the 256, not eight."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(5, 768, generator=g) * torch.tensor([1e-3, 1.0, 30.0]).repeat_interleave(256)
    x[0, 5] = 0.5 * x[0].abs()[:256].max()  # a .5 tie
    x[1, 256:512] *= 2.0 ** -140  # largest magnitude below 2^-64
    x[2, :256] = 0
    x[3, 600] = float("inf")
    q, d, sums = blocks.quantize_rows(x, 256)
    assert d.shape == (5, 3) and (q[4].reshape(3, 256).abs().amax(-1) == 127).all()
    assert torch.isnan(d[3, 2]) and (q[3, 512:] == 0).all() and d[2, 0] == 0
    for isa in on_each_isa():
        got_q, got_d, got_sums = kernels.compiled().quantize_rows(x, 256)
        assert torch.equal(got_q, q) and torch.equal(got_d.isnan(), d.isnan()), isa
        assert torch.equal(got_d.nan_to_num(), d.nan_to_num()), isa
        assert torch.equal(got_sums.int(), q.int().reshape(5, 48, 16).sum(-1)), isa


@needs_kernels
@pytest.mark.parametrize("format", TYPES)
def test_each_row_of_the_kernel_equals_the_reference_exactly(format):
    """N not a multiple of 16, one to three super-blocks, rows 1..16 in every split, bias and residual,
    blocks of every code, and the extremes (the first 256 k of an output all the largest code, or all 0,
    against activations all +-127: the largest integer sums AVX2's int16 lanes and the super-blocks' int32
    sums hold), both instruction sets: the same bits as blocks.linear."""
    g = torch.Generator().manual_seed(4)
    for seed, (N, K) in enumerate([(1, 256), (37, 512), (53, 768)]):
        for make in (stored, random_blocks):
            held, _ = make(format, N, K, seed)
            codes = held.codes.clone()
            codes[0, :256] = held.codes.max()
            if N > 1:
                codes[1, :256] = 0
            held = blocks.Blocks(format, codes, *held[2:])
            matrix = kernels.Matrix.from_blocks(held)
            x = torch.randn(16, K, generator=g) * 4
            x[0, :256], x[1, :256] = 1.0, -1.0  # q = 127, -127 in the first super-block
            x[3, :32] = 0  # a block of zeros: scale 0 (per block of 32)
            x[4, :256] = 0  # a super-block of zeros
            bias, add = torch.randn(N, generator=g), torch.randn(16, N, generator=g)
            reference = blocks.linear(x, held, bias)
            for isa in on_each_isa():
                for rows in range(1, 17):
                    parts = [kernels.compiled().linear(x[i:i + rows], matrix.data, matrix.kernel_format, N,
                                                       add[i:i + rows], bias) for i in range(0, 16, rows)]
                    assert torch.equal(torch.cat(parts), add + reference), (isa, N, K, rows, make.__name__)


@needs_kernels
def test_runs_of_several_formats_compute_each_runs_reference_exactly():
    """A fused matrix whose parts are stored in different types (Q4_K_M's q, k in Q4_K and v in Q6_K):
    runs, run by run the bits of each part's blocks.linear."""
    parts = [random_blocks("q4_k", 32, 512, 5)[0], random_blocks("q4_k", 16, 512, 6)[0],
             random_blocks("q5_0", 16, 512, 7)[0], random_blocks("q6_k", 21, 512, 8)[0]]
    matrix = kernels.Matrix.from_runs(parts)
    assert matrix.format == "q4_k+q5_0+q6_k" and matrix.shape == (85, 512) and len(matrix.runs) == 3
    assert torch.equal(matrix.dense(), torch.cat([p.dense() for p in parts]))
    g = torch.Generator().manual_seed(5)
    x, bias, add = torch.randn(7, 512, generator=g), torch.randn(85, generator=g), torch.randn(7, 85, generator=g)
    reference = torch.cat([blocks.linear(x, p) for p in parts], dim=-1) + bias
    assert torch.equal(matrix.reference(x, bias), reference)
    for isa in on_each_isa():
        for rows in (1, 2, 3, 7):
            got = torch.cat([kernels.compiled().linear(x[i:i + rows], matrix.data, matrix.kernel_format, 85,
                                                       add[i:i + rows], bias) for i in range(0, 7, rows)])
            assert torch.equal(got, add + reference), (isa, rows)
    with pytest.raises(ValueError, match="no rows to pick"):  # only an unembedding's rows are picked: never runs
        matrix.rows(torch.tensor([84, 3]))
    with pytest.raises(ValueError, match="multiple of 16"):
        kernels.Matrix.from_runs([parts[3], parts[2]])  # a run of 21 outputs before another


def test_a_k_quant_needs_rows_of_whole_super_blocks():
    assert "blocks of 256" in blocks.blocking_error("q4_k", 288)
    assert blocks.blocking_error("q6_k", 512) is None and blocks.blocking_error("q5_0", 288) is None
    with pytest.raises(ValueError, match="read from a GGUF file as stored"):
        blocks.quantize(torch.randn(4, 256), "q4_k")


# ---- GGUF files in these types (Q4_K_M's, Q5_K_M's, IQ4's, the low-bit K-quants'), every matrix as stored ----

# cycled over the matrices as written (the embedding, then q, k, v, o, gate, up, down of each layer):
# the embedding, v and down in Q6_K, q/k and gate/up in Q4_K (Q5_K, IQ4_XS), o in Q5_0 (Q5_1, IQ4_NL) (q, k,
# v fused: runs); the formats the model then holds
FILES = {"Q4_K_M": ((Q.Q6_K, Q.Q4_K, Q.Q4_K, Q.Q6_K, Q.Q5_0, Q.Q4_K, Q.Q4_K), {"q4_k", "q6_k", "q5_0", "q4_k+q6_k"}),
         "Q5_K_M": ((Q.Q6_K, Q.Q5_K, Q.Q5_K, Q.Q6_K, Q.Q5_1, Q.Q5_K, Q.Q5_K), {"q5_k", "q6_k", "q5_1", "q5_k+q6_k"}),
         "IQ4": ((Q.Q6_K, Q.IQ4_XS, Q.IQ4_XS, Q.IQ4_NL, Q.IQ4_NL, Q.IQ4_XS, Q.IQ4_XS),
                 {"iq4_xs", "q6_k", "iq4_nl", "iq4_xs+iq4_nl"}),
         "Q3_K_M/Q2_K": ((Q.Q6_K, Q.Q3_K, Q.Q3_K, Q.Q5_K, Q.Q4_K, Q.Q2_K, Q.Q2_K),
                         {"q6_k", "q3_k+q5_k", "q4_k", "q2_k"})}


@pytest.fixture(scope="module", params=FILES)
def k_quant_file(request, tmp_path_factory, gguf_cache):
    """(a qwen2 model (rows of 256 and 512: whole super-blocks) written in FILES' types, tied
    embeddings; the formats it runs in)."""
    model = hf_model("qwen2", tie_word_embeddings=True, hidden_size=256, intermediate_size=512)
    types, formats = FILES[request.param]
    return write_gguf(tmp_path_factory.mktemp("kquant") / "kq.gguf", model, byte_level_tokenizer(), "qwen2",
                      types=types), formats


@needs_kernels
@torch.no_grad()
def test_a_files_k_quants_run_as_stored_near_the_exact_product(k_quant_file):
    path, held = k_quant_file
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        target = load(path, quantize="gguf").model
    assert not [w for w in said if "not as stored" in str(w.message)]
    formats = {name: m.stored.format for name, m in target.named_modules() if isinstance(m, Linear)}
    assert set(formats.values()) == held and target.stack is not None  # all in the kernels
    raws = {raw.name: raw for raw in gguf.raw_tensors(path)}
    down = raws["model.layers.1.mlp.down_proj.weight"]
    assert torch.equal(target.model.layers[1].mlp.down_proj.stored.dense(),
                       torch.from_numpy(dequantize(down.data, Q.Q6_K)).reshape(down.shape))
    ids = torch.randint(3, 300, (2, 10), generator=torch.Generator().manual_seed(1))
    ours = target(ids).logits
    with torch.no_grad():  # the same weights with exact (fp32) activations: within int8 activation rounding
        for m in target.modules():
            if isinstance(m, Linear):
                m.weight, m.stored = torch.nn.Parameter(m.dense()), None
        target.stack = None
        for layer in target.model.layers:
            layer.stack = None
        exact = target(ids).logits
    assert (ours - exact).abs().max() < 0.1 * exact.abs().max()


@needs_kernels
def test_speculative_greedy_equals_plain_greedy_in_k_quants(k_quant_file):
    target = load(k_quant_file[0], quantize="gguf").model
    assert_speculation_equals_plain_on_each_isa(target)


@needs_kernels
def test_a_gguf_draft_model_runs_as_stored_when_its_target_does(k_quant_file):
    """The file as its own draft: as stored (the target's very arithmetic, so every draft is accepted);
    by default (draft_quantize auto) its matrices wider than Q4_0 requantized to it, still lossless;
    beside a target run as its bf16 conversion (asked for), the draft is that conversion too."""
    path, held = k_quant_file
    target = load(path)  # the default: as stored
    full = dict(draft_vocab="full")  # its formats are the subject here, not its draft vocabulary (test_gguf_blocks)
    proposer = load_drafter(target, "draft-model", path, DraftModelOptions(draft_quantize=None, **full))
    assert {m.stored.format for m in proposer.model.modules() if isinstance(m, Linear)} == held
    prompts, rule, greedy = [[5, 9, 2, 5, 9], list(range(20, 37))], StopRule(max_new_tokens=16), SamplingConfig()
    plain, _ = plain_generate(target.model, prompts, rule, greedy)
    rows, metrics = speculative_generate(target.model, proposer, prompts, rule, greedy, 3)
    assert [r.tokens for r in rows] == [r.tokens for r in plain] and metrics.accepted == metrics.proposed > 0
    fours = load_drafter(target, "draft-model", path, DraftModelOptions(**full)).model
    q4_0 = blocks.BLOCK_FORMATS["q4_0"]
    stored = {name: m.stored for name, m in proposer.model.named_modules() if isinstance(m, Linear)}
    for name, m in fours.named_modules():
        if isinstance(m, Linear):  # as stored where that reads no more than Q4_0 would, else Q4_0
            small = stored[name].nbytes <= m.out_features * m.in_features * q4_0.bytes / q4_0.size
            assert m.stored.format == (stored[name].format if small else "q4_0"), name
    assert any(m.stored.format == "q4_0" for m in fours.modules() if isinstance(m, Linear))
    rows, metrics = speculative_generate(target.model, DraftModelProposer(fours), prompts, rule, greedy, 3)
    assert [r.tokens for r in rows] == [r.tokens for r in plain] and metrics.proposed > 0
    unquantized = load(path, quantize="bf16")
    draft = load_drafter(unquantized, "draft-model", path, DraftModelOptions(**full)).model
    assert {m.stored.format for m in draft.modules() if isinstance(m, Linear) and m.stored} <= {"bf16"}
