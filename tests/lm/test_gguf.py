"""GGUF files (written here by tests/gguf_helpers.py as llama.cpp writes them: a llama and a qwen2 and
a qwen3 architecture, F32/F16/BF16/Q8_0/Q4_0/Q4_1 tensors) run as stored by default, their config,
tokenizer and chat template read from the metadata in memory, nothing written to disk; converted
(asked for: `quantize="bf16"`, a dtype, a folder for transformers) they hold what transformers' own
GGUF loading reads (modeling_gguf_pytorch_utils.load_gguf_checkpoint: the same tensors, bf16-rounded,
the same config) and compute what transformers computes on those weights; they tokenize as the
tokenizer they were written from; a folder is converted once into the cache, which keeps the most
recently used; a broken file is one clear error and leaves nothing in the cache."""
from __future__ import annotations

import json

import pytest
import torch
import transformers
from gguf import GGUFWriter
from safetensors.torch import load_file
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

from specdec import api
from specdec.api import load, load_drafter
from specdec.cli import main
from specdec.decoding.reference import reference_generate
from specdec.decoding.sampling import SamplingConfig
from specdec.decoding.stopping import StopRule
from specdec.errors import SpecdecError
from specdec.lm import gguf
from specdec.lm.checkpoint import sha256
from specdec.lm.tokenizer import template
from specdec.lm.tokenizer import Tokenizer

from ..gguf_helpers import CHATML, SPECIALS, Q, byte_level_tokenizer, hf_model, write_gguf
from ..train.test_train import JSON_PKG

FAMILIES = {"llama": {"tie_word_embeddings": True}, "qwen2": {"tie_word_embeddings": False},
            "qwen3": {"head_dim": 32, "tie_word_embeddings": False}}


@pytest.fixture(scope="module")
def tok():
    return byte_level_tokenizer()


@pytest.fixture(scope="module", params=list(FAMILIES))
def written(request, tmp_path_factory, gguf_cache, tok):
    """(family, the transformers model written, the .gguf file, its converted folder)."""
    family = request.param
    model = hf_model(family, **FAMILIES[family])
    path = write_gguf(tmp_path_factory.mktemp(family) / f"{family}.gguf", model, tok, family)
    return family, model, path, gguf.folder(path)


def transformers_gguf(path, family: str):
    """transformers' own reading of the file: its config, and a model holding its dequantized tensors
    (transformers reads no head_dim from a qwen3 file: Qwen3Config's default, 128, is given the file's)."""
    parsed = load_gguf_checkpoint(str(path), return_tensors=False)
    keys = {k: v for k, v in parsed["config"].items() if k not in ("model_type", "_model_name_or_path")}
    if family == "qwen3":
        keys["head_dim"] = FAMILIES["qwen3"]["head_dim"]
    keys.setdefault("pad_token_id", None)  # Phi3Config's default, 32000, lies outside a small vocabulary
    config = getattr(transformers, {"llama": "LlamaConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config",
                                    "phi3": "Phi3Config"}[family])(**keys)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    return parsed["config"], model, tensors


def test_tensors_and_config_are_transformers_gguf_reading(written):
    family, _, path, folder = written
    config, _, tensors = transformers_gguf(path, family)
    ours = load_file(folder / "model.safetensors")
    assert set(ours) == set(tensors) - ({"lm_head.weight"} if config["tie_word_embeddings"] else set())
    for name, value in ours.items():
        assert value.dtype == (torch.bfloat16 if value.dim() > 1 else torch.float32), name
        assert torch.equal(value, tensors[name].to(value.dtype)), name
    mine = json.loads((folder / "config.json").read_text())
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "max_position_embeddings", "vocab_size", "tie_word_embeddings", "bos_token_id"):
        assert mine[key] == config[key], key
    assert mine["eos_token_id"][0] == config["eos_token_id"]  # then the other ends llama.cpp finds (<|endoftext|>)
    assert mine["rms_norm_eps"] == pytest.approx(config["rms_norm_eps"], rel=1e-6)
    assert mine["rope_parameters"]["rope_theta"] == config["rope_theta"]


@torch.no_grad()
def test_logits_and_greedy_tokens_equal_transformers_on_the_dequantized_weights(written):
    family, _, path, folder = written
    _, model, tensors = transformers_gguf(path, family)
    model.load_state_dict({k: v.bfloat16().float() if v.dim() > 1 else v for k, v in tensors.items()}, strict=False)
    model.tie_weights()
    target = load(path, quantize="bf16")
    assert target.path == path and target.name == family and api.weights_format(target) == "bf16"
    ids = torch.randint(3, 300, (1, 24), generator=torch.Generator().manual_seed(1))
    assert (target.model(ids).logits - model(ids).logits).abs().max().item() <= 1e-4
    model.generation_config.eos_token_id = None
    expected = model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0)[0, 24:].tolist()
    assert reference_generate(target.model, ids[0].tolist(), StopRule(12), SamplingConfig()).tokens == expected


def test_float_tensors_come_back_exactly_with_llamas_permutation_undone(tmp_path, gguf_cache, tok):
    model = hf_model("llama")
    path = write_gguf(tmp_path / "f32.gguf", model, tok, "llama", types=(Q.F32,))
    ours = load_file(gguf.folder(path) / "model.safetensors")
    for name, value in model.state_dict().items():
        if name in ours:
            assert torch.equal(ours[name], value.to(ours[name].dtype)), name


@torch.no_grad()
def test_llama_31_rotary_scaling_stored_as_factors_is_read_back(tmp_path, gguf_cache, tok):
    """llama.cpp writes Llama 3.1's llama3 rope scaling as a rope_freqs tensor of per-frequency
    factors (convert_hf_to_gguf.py); the converted model computes what transformers computes with
    the original rope_parameters."""
    rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    model = hf_model("llama", rope_parameters=rope)
    inv = model.model.rotary_emb.inv_freq
    plain = 1.0 / (rope["rope_theta"] ** (torch.arange(0, 16, 2).float() / 16))
    factors = (plain / inv).numpy()  # the factors llama.cpp stores
    path = write_gguf(tmp_path / "llama31.gguf", model, tok, "llama", types=(Q.BF16,),
                      extra=lambda w: w.add_tensor("rope_freqs.weight", factors))
    target = load(path)
    assert target.model.config.rope_scaling == {k: v for k, v in rope.items() if k != "rope_theta"}
    ids = torch.randint(3, 300, (1, 40), generator=torch.Generator().manual_seed(2))
    assert (target.model(ids).logits - model(ids).logits).abs().max().item() <= 1e-4


@torch.no_grad()
def test_phi3_with_fused_projections_partial_rotary_and_a_window_computes_as_transformers(tmp_path, gguf_cache, tok):
    """Phi-3 as llama.cpp writes it: q/k/v and gate/up fused (attn_qkv, ffn_up), the rotary dims and
    the sliding window in the metadata (transformers' own GGUF reading drops both)."""
    model = hf_model("phi3", tie_word_embeddings=False, partial_rotary_factor=0.5, sliding_window=128, pad_token_id=0,
                     bos_token_id=1, eos_token_id=2)
    path = write_gguf(tmp_path / "phi3.gguf", model, tok, "phi3", types=(Q.BF16, Q.F32))
    target = load(path)
    assert target.model.config.max_position_embeddings == 128 and target.model.config.partial_rotary_factor == 0.5
    _, _, tensors = transformers_gguf(path, "phi3")
    ours = load_file(gguf.folder(path) / "model.safetensors")
    assert all(torch.equal(v, tensors[k].to(v.dtype)) for k, v in ours.items())
    ids = torch.randint(3, 300, (1, 40), generator=torch.Generator().manual_seed(3))
    assert (target.model(ids).logits - model(ids).logits).abs().max().item() <= 1e-4


@pytest.mark.parametrize("held", ["in memory", "in the converted folder"])
def test_tokenizer_bos_eos_and_chat_template_come_from_the_metadata(written, tok, held):
    _, _, path, folder = written
    ours = gguf.tokenizer(path) if held == "in memory" else Tokenizer.load(folder)
    text = "def f(x):\n    return json.dumps(x)  # é\n"
    assert ours.encode(text) == tok.encode(text).ids
    # the file names <|im_end|> its EOS; llama.cpp also ends at the vocabulary's <|endoftext|>
    assert ours.prefix == [] and ours.eos_ids == (tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>"))
    messages = [{"role": "user", "content": "hi <|im_end|>"}]
    if held == "in memory":  # one vocabulary held until a chat asks for the template's own copy
        assert ours.has_chat_template and ours.chat.copy is None and ours.chat.source.backend_tokenizer is ours.tok
    chat = ours.chat_template()
    assert chat.tokenizer.chat_template == CHATML and ours.has_chat_template
    if held == "in memory":
        assert chat.tokenizer.backend_tokenizer is not ours.tok
    ids = chat.ids(messages)
    assert ids[0] == tok.token_to_id("<|im_start|>") and ids.count(tok.token_to_id("<|im_end|>")) == 1
    assert ids == template(folder).ids(messages) and chat.stops == template(folder).stops


def test_a_gguf_runs_as_stored_and_writes_nothing(tmp_path, gguf_cache, tok):
    """The default: each matrix the file's blocks, the config, tokenizer and chat template from its
    metadata; a generation (a chat too) writes nothing; its tokenizer is the converted folder's."""
    model = hf_model("qwen2", seed=5)
    path = write_gguf(tmp_path / "stored.gguf", model, tok, "qwen2", types=(Q.Q8_0,))
    before = sorted(gguf_cache.rglob("*"))
    target = load(path)
    assert target.path == path and target.name == "stored" and target.model.config.num_hidden_layers == 2
    assert api.weights_format(target) == "q8_0"
    messages = [{"role": "user", "content": "hi"}]
    assert api.generate(target, messages=messages, max_new_tokens=4).tokens[0]
    assert sorted(gguf_cache.rglob("*")) == before and sorted(tmp_path.iterdir()) == [path]
    folder = Tokenizer.load(gguf.folder(path))  # asked for: converted now
    assert folder.tok.to_str() == target.tokenizer.tok.to_str()
    assert (folder.prefix, folder.eos_ids) == (target.tokenizer.prefix, target.tokenizer.eos_ids)


def test_a_conversion_is_what_was_asked_for(tmp_path, gguf_cache, tok):
    """bf16 (the file's values in bf16, fp32 arithmetic), a bfloat16 dtype, q8_0 at load: each in memory,
    nothing written; as stored with another dtype is refused by name."""
    path = write_gguf(tmp_path / "asked.gguf", hf_model("llama", seed=6), tok, "llama", types=(Q.Q4_0,))
    before = sorted(gguf_cache.rglob("*"))
    assert api.weights_format(load(path, quantize="bf16")) == "bf16"
    assert load(path, dtype=torch.bfloat16).admitted.dtype == torch.bfloat16
    assert api.weights_format(load(path, quantize="q8_0")) == "q8_0"
    with pytest.raises(SpecdecError, match="--quantize gguf runs the file's blocks as stored, on the CPU in float32"):
        load(path, dtype=torch.bfloat16, quantize="gguf")
    assert sorted(gguf_cache.rglob("*")) == before and sorted(tmp_path.iterdir()) == [path]


def test_the_cache_keeps_the_most_recently_used_files(tmp_path, tok, monkeypatch):
    """Each conversion marks its file's entry used; the cache keeps the KEEP most recent, older FORMATs
    first out."""
    root = tmp_path / "cache"
    monkeypatch.setattr(gguf, "cache_root", lambda: root)
    monkeypatch.setattr(gguf, "KEEP", 2)
    (root / f"0123456789abcdef-v{gguf.FORMAT - 1}" / "old").mkdir(parents=True)
    paths = [write_gguf(tmp_path / f"m{i}.gguf", hf_model("llama", seed=10 + i), tok, "llama", types=(Q.F32,))
             for i in range(3)]
    entries = [gguf.folder(p).parent for p in paths[:2]]
    assert sorted(root.iterdir()) == sorted(entries)  # the older FORMAT's entry went first
    gguf.folder(paths[0])  # used again: now the most recent
    third = gguf.folder(paths[2]).parent
    assert sorted(root.iterdir()) == sorted([entries[0], third])


def test_the_conversions_weights_hash_is_known_without_writing_it(tmp_path, tok, monkeypatch):
    """What a head trained for a .gguf target records (its conversion's model.safetensors sha256) is
    computed in memory where no folder is cached and remembered in the cache's index: the same hash."""
    path = write_gguf(tmp_path / "h.gguf", hf_model("qwen2", seed=7), tok, "qwen2")
    monkeypatch.setattr(gguf, "cache_root", lambda: tmp_path / "a")
    written = sha256(gguf.folder(path) / "model.safetensors")
    monkeypatch.setattr(gguf, "cache_root", lambda: tmp_path / "b")
    assert gguf.weights_sha256(path) == written
    assert [p.name for p in (tmp_path / "b").iterdir()] == [gguf.INDEX]
    assert gguf.weights_sha256(path) == written == gguf.read_index()[sha256(path)]


def vocabulary_file(path, tokens: list[str], **named: str):
    """A GGUF file of a vocabulary and the special tokens `named` by kind (eos=..., fim_pad=...), no tensors."""
    w = GGUFWriter(str(path), "qwen2")
    w.add_token_list(tokens)
    for kind, text in named.items():
        w.add_uint32(f"tokenizer.ggml.{kind}_token_id", tokens.index(text))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return gguf.open_file(path)


QWEN_CODER = ["def", "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|fim_prefix|>", "<|fim_middle|>",
              "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"]


@pytest.mark.parametrize("tokens, named, ends", [
    # Qwen2.5-Coder: the file names <|im_end|>; llama.cpp also ends at <|endoftext|> and the FIM pad,
    # repo and file-separator tokens, not at the other FIM tokens
    (QWEN_CODER, {"eos": "<|im_end|>"}, ["<|im_end|>", "<|endoftext|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"]),
    # SmolLM2: <reponame> is its FIM repo token; <repo_name> and <file_sep> are not llama.cpp's
    (["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<repo_name>", "<reponame>", "<file_sep>"], {"eos": "<|im_end|>"},
     ["<|im_end|>", "<|endoftext|>", "<reponame>"]),
    # Llama 3.1: the end of a turn, of a message and of the text
    (["<|begin_of_text|>", "<|end_of_text|>", "<|eom_id|>", "<|eot_id|>", "x"], {"eos": "<|eot_id|>"},
     ["<|eot_id|>", "<|end_of_text|>", "<|eom_id|>"]),
    # Phi-3: the named EOS and end of turn first
    (["<unk>", "<s>", "</s>", "<|end|>", "<|endoftext|>"], {"eos": "<|endoftext|>", "eot": "<|end|>"},
     ["<|endoftext|>", "<|end|>", "</s>"]),
    # a FIM pad the metadata names, whatever its text
    (["a", "<pad_here>", "</s>"], {"eos": "</s>", "fim_pad": "<pad_here>"}, ["</s>", "<pad_here>"]),
    # gpt-oss: <|return|> and <|call|> end a turn, so <|end|> does not
    (["<|start|>", "<|end|>", "<|return|>", "<|call|>", "<|endoftext|>"], {"eos": "<|return|>"},
     ["<|return|>", "<|call|>", "<|endoftext|>"]),
], ids=["qwen2.5-coder", "smollm2", "llama3.1", "phi3", "named-fim", "gpt-oss"])
def test_the_end_of_generation_set_is_llama_cpps(tmp_path, tokens, named, ends):
    got = gguf.end_ids(vocabulary_file(tmp_path / "vocab.gguf", tokens, **named))
    assert [tokens[i] for i in ([got] if isinstance(got, int) else got)] == ends


def test_a_converted_file_ends_at_each_id_of_its_set(tmp_path, gguf_cache):
    """A vocabulary with <|endoftext|>, <|im_end|> and <|fim_pad|>, the file's EOS only <|im_end|>:
    the converted folder's tokenizer ends at all three, the named EOS first."""
    raw = byte_level_tokenizer()
    raw.add_special_tokens(["<|fim_prefix|>", "<|fim_pad|>"])
    path = write_gguf(tmp_path / "coder.gguf", hf_model("qwen2", vocab_size=raw.get_vocab_size()), raw, "qwen2")
    ends = Tokenizer.load(gguf.folder(path)).eos_ids
    assert ends == tuple(raw.token_to_id(t) for t in ("<|im_end|>", "<|endoftext|>", "<|fim_pad|>"))
    assert gguf.tokenizer(path).eos_ids == ends


def test_expert_counts_of_zero_are_a_dense_model_and_others_are_refused(tmp_path, gguf_cache, tok):
    model = hf_model("llama")
    zero = write_gguf(tmp_path / "zero.gguf", model, tok, "llama", extra=lambda w: w.add_expert_count(0))
    assert gguf.config_of(gguf.open_file(zero), "zero.gguf")["num_hidden_layers"] == 2
    moe = write_gguf(tmp_path / "moe.gguf", model, tok, "llama", extra=lambda w: w.add_expert_count(8))
    with pytest.raises(SpecdecError, match="GGUF key 'llama.expert_count' = 8 is refused"):
        gguf.folder(moe)


def test_a_bos_is_added_where_the_file_says_so(tmp_path, gguf_cache, tok):
    path = write_gguf(tmp_path / "bos.gguf", hf_model("llama"), tok, "llama", add_bos=True)
    assert Tokenizer.load(gguf.folder(path)).prefix == [tok.token_to_id("<|endoftext|>")]
    assert gguf.tokenizer(path).prefix == [tok.token_to_id("<|endoftext|>")]


def test_converted_once_keyed_by_the_files_hash(tmp_path, gguf_cache, tok, capsys):
    path = write_gguf(tmp_path / "once.gguf", hf_model("qwen2", seed=3), tok, "qwen2")
    first = gguf.folder(path)
    assert "converting once.gguf" in capsys.readouterr().err
    assert gguf.folder(path) == first and "converting" not in capsys.readouterr().err
    write_gguf(path, hf_model("qwen2", seed=4), tok, "qwen2")
    assert gguf.folder(path) != first


def test_raw_tensors_are_the_stored_blocks_in_transformers_order(tmp_path, gguf_cache, tok):
    model = hf_model("llama")
    path = write_gguf(tmp_path / "raw.gguf", model, tok, "llama")
    raws = {r.name: r for r in gguf.raw_tensors(path)}
    converted = load_file(gguf.folder(path) / "model.safetensors")
    assert {r.type for r in raws.values()} == {"Q8_0", "Q4_0", "Q4_1", "F16", "BF16", "F32"}
    for name, raw in raws.items():
        assert raw.shape == tuple(model.state_dict()[name].shape), name
        if raw.type.startswith("Q"):  # (rows, bytes per row) of blocks
            assert raw.data.dtype.name == "uint8" and raw.data.shape[0] == raw.shape[0], name
        assert torch.equal(gguf.dequantized(raw), converted[name]), name


def broken(kind: str, tmp_path, tok):
    model = hf_model("llama")
    path = tmp_path / f"{kind}.gguf"
    if kind == "truncated":
        write_gguf(path, model, tok, "llama")
        path.write_bytes(path.read_bytes()[:-1000])
    elif kind == "not-gguf":
        path.write_bytes(b"PK\x03\x04" + bytes(100))
    elif kind == "architecture":
        write_gguf(path, model, tok, "gemma2")
    elif kind == "key":
        write_gguf(path, model, tok, "llama", extra=lambda w: w.add_uint32("llama.attention.sliding_window", 64))
    elif kind == "type":
        write_gguf(path, model, tok, "llama", extra=lambda w: w.add_tensor("rope_freqs.weight",
                                                                              torch.ones(8, dtype=torch.int32).numpy()))
    elif kind == "tensor":
        write_gguf(path, model, tok, "llama", extra=lambda w: w.add_tensor("blk.0.attn_sinks.weight",
                                                                              torch.ones(4).numpy()))
    elif kind == "rope":
        write_gguf(path, model, tok, "llama", extra=lambda w: w.add_tensor("rope_freqs.weight",
                                                                              torch.linspace(1, 3, 8).numpy()))
    return path


@pytest.mark.parametrize("kind, message", [
    ("truncated", "is not a readable GGUF file (truncated or corrupt"),
    ("not-gguf", "is not a readable GGUF file"),
    ("architecture", "GGUF architecture 'gemma2' is not supported"),
    ("key", "GGUF key 'llama.attention.sliding_window' = 64 is refused"),
    ("type", "the tensor type(s) I32 (e.g. rope_freqs.weight) cannot be read"),
    ("tensor", "GGUF tensor 'blk.0.attn_sinks.weight' is refused: specdec's llama has no such weight"),
    ("rope", "GGUF tensor 'rope_freqs.weight' holds rotary frequency factors that are not Llama 3.1's"),
])
def test_a_broken_or_unsupported_file_is_one_clear_error_and_leaves_nothing(kind, message, tmp_path, tok,
                                                                             monkeypatch, capsys):
    root = tmp_path / "cache"
    monkeypatch.setattr(gguf, "cache_root", lambda: root)
    path = broken(kind, tmp_path, tok)
    with pytest.raises(SpecdecError) as e:
        gguf.folder(path)
    assert message in str(e.value) and "\n" not in str(e.value)
    assert not any(p.is_file() for p in root.rglob("*"))
    code = main(["generate", "--model", str(path), "--prompt", "x", "--max-new-tokens", "2"])
    assert code != 0 and message in capsys.readouterr().err


def test_generate_takes_a_gguf_file_on_the_command_line(written, capsys):
    _, _, path, _ = written
    assert main(["generate", "--model", str(path), "--prompt", "def f(x):", "--max-new-tokens", "5", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["tokens"]) <= 5


def test_special_token_ids_are_the_files(tok):
    assert [tok.token_to_id(t) for t in SPECIALS] == [317, 318, 319]


def test_train_takes_a_gguf_target(tmp_path, gguf_cache, tok):
    """`specdec train --target FILE.gguf`: the head is trained for the converted folder and loads for the
    file run as stored."""
    path = write_gguf(tmp_path / "target.gguf", hf_model("qwen2", tie_word_embeddings=False), tok, "qwen2")
    out = tmp_path / "eagle"
    assert main(["train", "--preset", "tiny", "--objective", "eagle", "--target", str(path), "--corpus", str(JSON_PKG),
                 "--steps", "2", "--save-every", "2", "--eval-every", "2", "--eagle-steps", "2", "--draft-vocab", "64",
                 "--out", str(out)]) == 0
    heads = next(out.rglob("heads.json")).parent
    target = load(path)
    assert load_drafter(target, "eagle", heads).head.config.hidden_size == target.model.config.hidden_size


def test_a_head_of_another_shape_is_refused_before_any_hash(tmp_path, gguf_cache, tok):
    """A head trained for another target (the shipped 22M target's EAGLE head) beside a .gguf target:
    refused by the shape its metadata records, before the file's conversion is hashed."""
    path = write_gguf(tmp_path / "other.gguf", hf_model("qwen2", seed=8), tok, "qwen2")
    target = load(path)
    with pytest.raises(SpecdecError, match=r"belongs to a target of hidden_size 384, but .*other\.gguf has 64"):
        load_drafter(target, "eagle", api.MODELS / "eagle")
    assert sha256(path) not in gguf.read_index()
