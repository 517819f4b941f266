"""llama.cpp as a peer: the GGUF conversion read back with gguf's own reader (names, shapes,
dtypes, metadata, vocabulary), the rotary reordering checked on the arithmetic it must preserve,
and — when llama-cpp-python is installed — llama.cpp's logits and greedy tokens against
specdec's on the same weights and the same token ids."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from specdec.api import load
from specdec.bench import llamacpp, llamacpp_native
from specdec.bench.plain import bench_plain, format_plain, llama_cpp_peers
from specdec.decoding.engine import plain_generate
from specdec.decoding.sampling import SamplingConfig
from specdec.decoding.stopping import StopRule
from specdec.errors import SpecdecError
from specdec.lm.checkpoint import save_model, sha256
from specdec.lm.window import apply_rotary, rotary

from ..conftest import TINY, tiny_model

gguf = pytest.importorskip("gguf", reason="the gguf package converts to GGUF: pip install -e '.[test]'")
needs_llama_cpp = pytest.mark.skipif(llamacpp.available() is None,
                                     reason=f"llama-cpp-python is not installed ({llamacpp.INSTALL_HINT})")
CFG = dataclasses.replace(TINY, max_position_embeddings=2048)  # HumanEval prompts are long in a 384-token BPE


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tokenizer_file):
    """The tiny model stored in bf16, as the shipped models are."""
    path = tmp_path_factory.mktemp("llamacpp") / "tiny-bf16"
    save_model(tiny_model(0, CFG), path, tokenizer_file=tokenizer_file, dtype=torch.bfloat16)
    return path


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("gguf-cache")


def test_permute_rotary_pairs_each_dimension_with_its_half_partner():
    # one head of dimension 4: rows [x0, x1, y0, y1] (rotated as halves) -> [x0, y0, x1, y1] (as pairs)
    w = torch.arange(8.0).view(4, 2)
    assert llamacpp.permute_rotary(w, 1)[:, 0].tolist() == [0.0, 4.0, 2.0, 6.0]
    two_heads = torch.arange(8.0).view(8, 1)
    assert llamacpp.permute_rotary(two_heads, 2)[:, 0].tolist() == [0, 2, 1, 3, 4, 6, 5, 7]


def rotate_pairs(x, positions, inv_freq):
    """llama.cpp's Llama rotary: dimensions (2i, 2i+1) rotate together by angle pos * inv_freq[i]."""
    angle = positions[:, None].float() * inv_freq  # (T, D/2)
    cos, sin = angle.cos()[:, None], angle.sin()[:, None]
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)


def test_permuted_projections_give_the_same_attention_scores_under_pairwise_rotary():
    torch.manual_seed(0)
    heads, d, c, T = 3, 8, 16, 5
    wq, wk, x = torch.randn(heads * d, c), torch.randn(heads * d, c), torch.randn(T, c)
    positions, inv_freq = torch.arange(T), 1.0 / 10000.0 ** (torch.arange(0, d, 2).float() / d)
    cos, sin = rotary(positions[None], inv_freq, torch.float32)  # (1, T, 1, D)
    q = apply_rotary((x @ wq.T).view(1, T, heads, d), cos, sin)[0]
    k = apply_rotary((x @ wk.T).view(1, T, heads, d), cos, sin)[0]
    q_cpp = rotate_pairs((x @ llamacpp.permute_rotary(wq, heads).T).view(T, heads, d), positions, inv_freq)
    k_cpp = rotate_pairs((x @ llamacpp.permute_rotary(wk, heads).T).view(T, heads, d), positions, inv_freq)
    scores = torch.einsum("thd,shd->hts", q, k)
    torch.testing.assert_close(torch.einsum("thd,shd->hts", q_cpp, k_cpp), scores, rtol=1e-5, atol=1e-4)
    # and without the reordering the scores are wrong: the test can fail
    q_bad = rotate_pairs((x @ wq.T).view(T, heads, d), positions, inv_freq)
    k_bad = rotate_pairs((x @ wk.T).view(T, heads, d), positions, inv_freq)
    assert (torch.einsum("thd,shd->hts", q_bad, k_bad) - scores).abs().max() > 1.0


@pytest.mark.parametrize("dtype, matrix_type", [("bf16", "BF16"), ("f32", "F32")])
def test_gguf_reads_back_with_llama_names_shapes_and_metadata(checkpoint, cache, tokenizer_file, dtype, matrix_type):
    path = llamacpp.convert(checkpoint, dtype, cache)
    assert path.parent.parent == cache and path.parent.name == sha256(checkpoint / "model.safetensors")
    assert llamacpp.convert(checkpoint, dtype, cache) == path  # the second call reads the cache
    reader = gguf.GGUFReader(path)
    tensors = {t.name: t for t in reader.tensors}
    c, kv = CFG, CFG.num_key_value_heads * CFG.head_dim
    expected = {"token_embd.weight": (c.vocab_size, c.hidden_size), "output.weight": (c.vocab_size, c.hidden_size),
                "output_norm.weight": (c.hidden_size,)}
    for i in range(c.num_hidden_layers):
        expected |= {f"blk.{i}.attn_norm.weight": (c.hidden_size,), f"blk.{i}.ffn_norm.weight": (c.hidden_size,),
                     f"blk.{i}.attn_q.weight": (c.num_attention_heads * c.head_dim, c.hidden_size),
                     f"blk.{i}.attn_k.weight": (kv, c.hidden_size), f"blk.{i}.attn_v.weight": (kv, c.hidden_size),
                     f"blk.{i}.attn_output.weight": (c.hidden_size, c.num_attention_heads * c.head_dim),
                     f"blk.{i}.ffn_gate.weight": (c.intermediate_size, c.hidden_size),
                     f"blk.{i}.ffn_up.weight": (c.intermediate_size, c.hidden_size),
                     f"blk.{i}.ffn_down.weight": (c.hidden_size, c.intermediate_size)}
    assert {name: tuple(int(n) for n in reversed(t.shape)) for name, t in tensors.items()} == expected
    for name, t in tensors.items():
        assert t.tensor_type.name == ("F32" if len(expected[name]) == 1 else matrix_type), name

    def field(key):
        f = reader.fields[key]
        return f.contents()

    assert field("general.architecture") == "llama"
    assert (field("llama.block_count"), field("llama.embedding_length"), field("llama.feed_forward_length")) == \
        (c.num_hidden_layers, c.hidden_size, c.intermediate_size)
    assert (field("llama.attention.head_count"), field("llama.attention.head_count_kv"),
            field("llama.rope.dimension_count")) == (c.num_attention_heads, c.num_key_value_heads, c.head_dim)
    assert field("llama.context_length") == c.max_position_embeddings
    assert field("llama.rope.freq_base") == pytest.approx(c.rope_theta)
    assert field("llama.attention.layer_norm_rms_epsilon") == pytest.approx(c.rms_norm_eps)
    tok = json.loads(tokenizer_file.read_text())
    tokens = field("tokenizer.ggml.tokens")
    assert field("tokenizer.ggml.model") == "gpt2" and len(tokens) == c.vocab_size
    assert tokens[:3] == ["<|pad|>", "<|bos|>", "<|endoftext|>"]
    assert all(tokens[i] == t for t, i in tok["model"]["vocab"].items())
    assert field("tokenizer.ggml.token_type")[:4] == [gguf.TokenType.CONTROL] * 3 + [gguf.TokenType.NORMAL]
    assert len(field("tokenizer.ggml.merges")) == len(tok["model"]["merges"])
    assert (field("tokenizer.ggml.bos_token_id"), field("tokenizer.ggml.eos_token_id")) == (1, 2)

    # the stored q matrix is the checkpoint's, reordered for pairwise rotary
    q = torch.from_numpy(np.array(tensors["blk.0.attn_q.weight"].data))
    q = (q.view(torch.bfloat16) if dtype == "bf16" else q).float().view(expected["blk.0.attn_q.weight"])
    hf = load(checkpoint).model.hf_state_dict()["model.layers.0.self_attn.q_proj.weight"].float()
    assert torch.equal(q, llamacpp.permute_rotary(hf, c.num_attention_heads))


def test_unknown_gguf_dtype_is_refused(checkpoint, cache):
    with pytest.raises(SpecdecError, match="choose one of bf16, f32"):
        llamacpp.convert(checkpoint, "q4_0", cache)


def prompt_ids(target, n: int = 3) -> list[list[int]]:
    texts = ["def add(a, b):\n    return", "import json\n\nclass Encoder:", "x = [i * i for i in range(10)]"]
    return [[2] + target.tokenizer.encode(t) for t in texts[:n]]


@needs_llama_cpp
@pytest.mark.parametrize("dtype, tolerance", [("f32", 1e-4), ("bf16", 5e-2), ("q8_0", 0.25)])
def test_llama_cpp_logits_equal_specdecs(checkpoint, cache, dtype, tolerance):
    # f32: the same arithmetic (to rounding); bf16: llama.cpp rounds activations to bf16 for its
    # matrix products and keeps an f16 KV cache, ~1% of these logits' range (about 3); q8_0:
    # llama.cpp's own 8-bit quantization of the bf16 file, weights rounded to 1/127 of each block's range
    target = load(checkpoint)  # fp32 arithmetic on the bf16 weights
    model = llamacpp.LlamaCppModel(llamacpp.convert(checkpoint, dtype, cache), 1, 256,
                                   **llamacpp.PEER_SETTINGS[dtype])
    try:
        for ids in prompt_ids(target):
            with torch.inference_mode():
                ours = target.model(torch.tensor([ids])).logits[0].numpy()
            theirs = model.logits(ids)
            assert np.abs(theirs - ours).max() <= tolerance, (dtype, np.abs(theirs - ours).max())
    finally:
        model.close()


@needs_llama_cpp
def test_a_file_llama_cpp_cannot_load_is_one_clear_error_with_its_reason(tmp_path):
    bad = tmp_path / "truncated.gguf"
    bad.write_bytes(b"GGUF" + bytes(12))
    with pytest.raises(SpecdecError, match=r"llama.cpp could not load .*truncated.gguf \(.+\); delete the file"):
        llamacpp.LlamaCppModel(bad, 1, 256)


@needs_llama_cpp
def test_llama_cpp_greedy_tokens_equal_specdecs(checkpoint, cache):
    target = load(checkpoint)
    model = llamacpp.LlamaCppModel(llamacpp.convert(checkpoint, "f32", cache), 1, 256, **llamacpp.PEER_SETTINGS["f32"])
    try:
        for ids in prompt_ids(target):
            rows, _ = plain_generate(target.model, [ids], StopRule(24), SamplingConfig())
            tokens, prefill_seconds, decode_seconds = model.generate(ids, 24)
            assert tokens == rows[0].tokens and prefill_seconds > 0 and decode_seconds > 0
    finally:
        model.close()


def test_bench_plain_says_why_llama_cpp_did_not_run(checkpoint):
    r = bench_plain(checkpoint, n_prompts=2, repeats=1, max_new_tokens=3, llama_cpp=False)
    assert r["llama_cpp"]["status"] == "skipped" and r["llama_cpp"]["reason"] == "--no-llamacpp"
    assert r["conditions"]["software"]["llama_cpp"] == (llamacpp.available() or "absent")
    assert "llama.cpp peer skipped: --no-llamacpp" in format_plain(r)
    assert set(r["decode_tokens_per_s"]) == {"specdec"} and r["speedup_vs_llama_cpp"] == {}
    json.loads(json.dumps(r))


def test_without_llama_cpp_the_peer_is_skipped_with_the_install_command(checkpoint, monkeypatch):
    monkeypatch.setattr(llamacpp, "available", lambda: None)
    models, info = llama_cpp_peers(load(checkpoint), [[2, 5, 9]], enabled=True)
    assert models == {} and info["status"] == "skipped" and info["version"] == "absent"
    assert "pip install -e '.[llamacpp]'" in info["reason"]


@needs_llama_cpp
def test_bench_plain_runs_llama_cpp_beside_specdec(checkpoint, cache, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    r = bench_plain(checkpoint, n_prompts=2, repeats=1, max_new_tokens=4)
    assert r["llama_cpp"]["status"] == "ran"
    assert set(r["speedup_vs_llama_cpp"]) == {"llama.cpp bf16", "llama.cpp f32"}
    assert r["identical_outputs"]["llama.cpp f32"] == "2/2"
    assert r["llama_cpp"]["models"]["llama.cpp f32"]["max_abs_logit_diff_vs_specdec"] <= 1e-4
    assert "| llama.cpp f32 |" in format_plain(r)


# --- llama.cpp's own programs (bench/llamacpp_native.py) ------------------------------------------

def test_the_speculative_programs_statistics_are_read_and_a_missing_figure_is_named():
    printed = ("\n\nencoded   42 tokens in    0.120 seconds, speed:  350.000 t/s\n"
               "decoded  128 tokens in    2.500 seconds, speed:   51.200 t/s\n\n"
               "n_draft   = 5\nn_predict = 128\nn_drafted = 110\nn_accept  = 77\naccept    = 70.000%\n")
    spec = llamacpp_native.parse_speculative(printed)
    assert (spec.decoded, spec.seconds, spec.drafted, spec.accepted) == (128, 2.5, 110, 77)
    assert spec.tokens_per_s == pytest.approx(51.2)
    with pytest.raises(SpecdecError, match="printed no drafted, accepted"):
        llamacpp_native.parse_speculative(printed.split("n_draft ")[0])


def test_a_missing_llama_cpp_build_says_how_to_make_one(tmp_path, monkeypatch):
    monkeypatch.delenv(llamacpp_native.ENV, raising=False)
    with pytest.raises(SpecdecError, match="GGML_NATIVE=ON"):
        llamacpp_native.binaries()
    with pytest.raises(SpecdecError, match="has no llama-bench"):
        llamacpp_native.binaries(tmp_path)


def program(folder: Path, name: str, usage: str) -> Path:
    """An executable that prints `usage`, as a llama.cpp program answers --help."""
    path = folder / name
    path.write_text(f"#!/bin/sh\ncat <<'EOF'\n{usage}\nEOF\n")
    path.chmod(0o755)
    return path


def test_drafts_are_asked_for_as_the_programs_version_spells_it(tmp_path):
    new = program(tmp_path, "new", "--spec-type TYPE\n--spec-draft-n-max N   number of tokens to draft")
    old = program(tmp_path, "old", "--draft-max, --draft, --draft-n N   number of tokens to draft")
    assert llamacpp_native.draft_flags(new, 5, "draft-simple") == ["--spec-type", "draft-simple",
                                                                  "--spec-draft-n-max", "5"]
    assert llamacpp_native.draft_flags(new, 5) == ["--spec-draft-n-max", "5"]  # llama-lookup: no draft model
    assert llamacpp_native.draft_flags(old, 3, "draft-simple") == ["--draft-max", "3"]


def test_the_build_is_named_from_its_cmake_cache(tmp_path):
    (tmp_path / "bin").mkdir()
    assert llamacpp_native.build(tmp_path / "bin").startswith("unknown build")
    (tmp_path / "CMakeCache.txt").write_text("GGML_NATIVE:BOOL=ON\nGGML_AVX2:BOOL=OFF\n")
    assert "native build" in llamacpp_native.build(tmp_path / "bin")
    (tmp_path / "CMakeCache.txt").write_text("GGML_NATIVE:BOOL=OFF\nGGML_AVX:BOOL=ON\nGGML_AVX2:BOOL=ON\n"
                                             "GGML_AVX512:BOOL=OFF\n")
    assert llamacpp_native.build(tmp_path / "bin").endswith("built for AVX AVX2")


def test_a_peer_that_crashes_runs_again_without_repacking_and_the_crash_is_kept():
    fallback, calls = llamacpp_native.Fallback(), []

    def crashing(extra):
        calls.append(extra)
        if not extra:
            raise llamacpp_native.ProgramFailed("llama-speculative-simple failed (exit status -11): ...", -11)
        return "ran"

    assert fallback("llama-speculative-simple", crashing) == "ran"
    assert fallback("llama-speculative-simple", crashing) == "ran"  # straight to the flag
    assert calls == [(), ("--no-repack",), ("--no-repack",)]
    assert "exit status -11" in fallback.failures["llama-speculative-simple"]

    def failing(extra):  # an error that is no crash is not retried
        raise llamacpp_native.ProgramFailed("llama-lookup failed (exit status 1): bad flag", 1)
    with pytest.raises(SpecdecError, match="bad flag"):
        fallback("llama-lookup", failing)
    assert "llama-lookup" not in fallback.failures


def test_a_failing_program_is_an_error_with_its_exit_status(tmp_path):
    with pytest.raises(SpecdecError, match=r"false failed \(exit status 1\)"):
        llamacpp_native.run(Path("/bin/false"), [])
