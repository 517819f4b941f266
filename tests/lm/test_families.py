"""Checkpoints of each supported family (small configs built here with transformers, random weights,
saved with save_pretrained, nothing downloaded) load into specdec and compute what transformers
computes: logits on the CPU kernels and on the PyTorch path within 1e-4 (fp32), greedy tokens equal
to transformers' generate, and speculative greedy (n-gram, a smaller draft of the family) equal to
plain decoding. A head_dim the kernels cannot run falls back to PyTorch and says so."""
from __future__ import annotations

import copy
import json
import warnings

import pytest
import torch
import transformers

from specdec import kernels
from specdec.decoding.engine import speculative_generate
from specdec.decoding.reference import reference_generate
from specdec.decoding.sampling import SamplingConfig
from specdec.decoding.stopping import StopRule
from specdec.errors import SpecdecError
from specdec.lm.checkpoint import load_model
from specdec.proposers import DraftModelProposer, NgramProposer

TOL = 1e-4
VOCAB = 96
SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128, bos_token_id=1, eos_token_id=2)

# family -> (transformers config class, its model class, keys beyond SMALL)
FAMILIES = {
    "llama3": ("LlamaConfig", "LlamaForCausalLM", dict(
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
        eos_token_id=[2, 3], tie_word_embeddings=True)),
    "llama-bias-linear": ("LlamaConfig", "LlamaForCausalLM", dict(
        attention_bias=True, mlp_bias=True, rope_parameters={"rope_type": "linear", "rope_theta": 10000.0,
                                                             "factor": 2.0})),
    "llama-yarn": ("LlamaConfig", "LlamaForCausalLM", dict(
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 32})),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=96)),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(head_dim=32)),
    # a local layer (window 8, rotary base 10000) then a global one (linear scaling), a query scale of its
    # own, soft-capped logits
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        head_dim=32, sliding_window=8, layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=24,
        final_logit_softcapping=5.0, rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0}})),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(partial_rotary_factor=0.5, pad_token_id=0)),
    "phi3-longrope": ("Phi3Config", "Phi3ForCausalLM", dict(pad_token_id=0, max_position_embeddings=256, rope_parameters={
        "rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 64, "partial_rotary_factor": 1.0,
        "short_factor": [1.0, 1.2, 1.5, 2.0, 2.5, 3.0, 4.0, 6.0], "long_factor": [8.0] * 8})),
}

# families whose decoder layers the kernels' layer does not compute: on PyTorch operators, the reason said
LAYERS_ON_TORCH = {"gemma3": "(Gemma 3's)"}


def hf_model(family: str, seed: int = 0, **changes) -> transformers.PreTrainedModel:
    """A transformers model of the family with every parameter random (biases and norm weights
    too: zero biases or unit norms would hide a missing one), rounded to bf16 values."""
    config_class, model_class, extra = FAMILIES[family]
    keys = {**SMALL, **extra, **changes}
    if "layer_types" in keys:  # one per layer (a draft of fewer layers keeps the first ones')
        keys["layer_types"] = keys["layer_types"][:keys["num_hidden_layers"]]
    cfg = getattr(transformers, config_class)(**keys)
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn_like(p) * (0.3 if "norm" in name or "bias" in name else 0.08)
            p.copy_((noise + (1.0 if "norm" in name and family != "gemma" else 0.0)).bfloat16().float())
    return model


def save(model: transformers.PreTrainedModel, path, dtype: torch.dtype, **kwargs):
    """A copy saved: casting the model itself would round its rotary buffers too."""
    copy.deepcopy(model).to(dtype).save_pretrained(path, **kwargs)
    return path


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(family, transformers model, specdec on the kernels, specdec on PyTorch operators)."""
    hf = hf_model(request.param)
    root = tmp_path_factory.mktemp(request.param)
    on_kernels = load_model(save(hf, root / "bf16", torch.bfloat16))  # bf16 stored: the kernels run it
    on_torch = load_model(save(hf, root / "fp32", torch.float32))     # the same values stored in fp32
    assert on_torch.stack is None
    if kernels.can_store_bf16() and request.param in LAYERS_ON_TORCH:  # its matrices on the kernels, said
        assert on_kernels.stack is None and LAYERS_ON_TORCH[request.param] in on_kernels.abilities.backend
    elif kernels.can_store_bf16():
        assert on_kernels.stack is not None and "kernels" in on_kernels.abilities.backend
    return request.param, hf, on_kernels, on_torch


def tokens(B: int, T: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, VOCAB, (B, T), generator=torch.Generator().manual_seed(seed))


def cached_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """(B, T, V) through the KV cache: a prefill of most of ids, then one token at a time (where
    the kernels run the decoder layers as one call)."""
    cache = model.new_cache(ids.shape[0], ids.shape[1])
    parts = [model(ids[:, :-4], cache=cache).logits]
    parts += [model(ids[:, t:t + 1], cache=cache).logits for t in range(ids.shape[1] - 4, ids.shape[1])]
    return torch.cat(parts, 1)


@torch.no_grad()
def test_logits_equal_transformers_on_the_kernels_and_on_pytorch(family):
    name, hf, on_kernels, on_torch = family
    ids = tokens(2, 40)
    expected = hf(ids).logits
    for model in (on_kernels, on_torch):
        assert (model(ids).logits - expected).abs().max().item() <= TOL, name
        assert (cached_logits(model, ids) - expected).abs().max().item() <= TOL, name


@torch.no_grad()
def test_greedy_tokens_equal_transformers_generate(family):
    name, hf, on_kernels, _ = family
    prompt = tokens(1, 12, seed=2)
    hf.generation_config.eos_token_id = None  # 20 tokens whatever they are, as StopRule(20)
    expected = hf.generate(prompt, max_new_tokens=20, do_sample=False, pad_token_id=0)[0, 12:].tolist()
    assert reference_generate(on_kernels, prompt[0].tolist(), StopRule(20), SamplingConfig()).tokens == expected, name


def test_speculative_greedy_equals_plain_with_ngram_and_a_smaller_draft_of_the_family(family, tmp_path):
    name, hf, target, _ = family
    draft = load_model(save(hf_model(name, seed=5, num_hidden_layers=1), tmp_path / "draft", torch.bfloat16))
    prompts = [tokens(1, 10, seed=3)[0].tolist(), (tokens(1, 4, seed=4)[0].tolist() * 3)]
    rule = StopRule(16)
    plain = [reference_generate(target, p, rule, SamplingConfig()).tokens for p in prompts]
    for proposer in (NgramProposer(max_n=3, min_n=1), DraftModelProposer(model=draft)):
        rows, _ = speculative_generate(target, proposer, prompts, rule, SamplingConfig(), k=3)
        assert [r.tokens for r in rows] == plain, (name, proposer.name)


def test_a_sharded_checkpoint_loads(tmp_path):
    hf = hf_model("qwen2")
    path = save(hf, tmp_path / "sharded", torch.float32, max_shard_size="40KB")
    assert (path / "model.safetensors.index.json").exists() and not (path / "model.safetensors").exists()
    ids = tokens(1, 20)
    with torch.no_grad():
        assert (load_model(path)(ids).logits - hf(ids).logits).abs().max().item() <= TOL


def test_a_missing_shard_is_refused_by_name(tmp_path):
    path = save(hf_model("qwen2"), tmp_path / "sharded", torch.float32, max_shard_size="40KB")
    shard = sorted(path.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(SpecdecError, match=shard.name):
        load_model(path)


def test_mistral_runs_no_context_beyond_its_sliding_window(family):
    name, _, model, _ = family
    if name != "mistral":
        pytest.skip("mistral only")
    assert model.config.max_position_embeddings == 96  # the window, not the config's 128
    with pytest.raises(ValueError, match="context of 96"):
        model(tokens(1, 97))


def test_a_head_dim_the_kernels_cannot_run_falls_back_to_pytorch_and_says_so(tmp_path):
    if not kernels.can_store_bf16():
        pytest.skip("no CPU kernels here")
    hf = hf_model("llama3", head_dim=24)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = load_model(save(hf, tmp_path / "m", torch.bfloat16))
    assert model.stack is None and "head_dim" in model.unstacked
    assert any("head_dim" in str(w.message) for w in caught)
    assert "PyTorch operators" in model.abilities.backend and "multiple of 16" in model.abilities.backend
    ids = tokens(2, 30)
    with torch.no_grad():
        assert (cached_logits(model, ids) - hf(ids).logits).abs().max().item() <= TOL


@torch.no_grad()
def test_a_token_gets_the_same_bits_alone_in_any_window_and_on_either_instruction_set(family):
    """What makes greedy speculative decoding exact, for each family's features in the kernels
    (biases, q/k norms, partial rotary, yarn's factor, gelu, norm offset)."""
    name, _, model, _ = family
    if model.stack is None:
        pytest.skip("no CPU kernels here")
    prompt, new = tokens(2, 12, seed=6), tokens(2, 12, seed=7)
    before = kernels.isa()
    isas = ["avx2"] + (["avx512"] if before == "avx512" else [])
    try:
        for isa in isas:
            kernels.compiled().set_isa(isa)
            single = model.new_cache(1, 32)
            model(prompt[:1], cache=single)
            alone = torch.cat([model(new[:1, t:t + 1], cache=single).logits for t in range(12)], 1)
            if isa == "avx2":
                reference = alone
            assert torch.equal(alone, reference), (name, isa)
            for T in (2, 5, 9, 12):
                cache = model.new_cache(2, 32)
                model(prompt, cache=cache)
                assert torch.equal(model(new[:, :T], cache=cache).logits[0], reference[0, :T]), (name, isa, T)
    finally:
        kernels.compiled().set_isa(before)


def test_the_api_runs_a_foreign_checkpoint_under_its_own_prompt_rules(tmp_path):
    """api.load + generate on a Llama-3-style folder (its BOS first, EOS a list in
    generation_config.json): the tokens transformers' generate gives from its tokenizer's ids."""
    from specdec.api import generate, load

    from .test_tokenizer import foreign_checkpoint_tokenizer
    hf = hf_model("llama3", vocab_size=300, bos_token_id=0, eos_token_id=[1, 2])
    save(hf, tmp_path, torch.bfloat16)
    hf_tok = foreign_checkpoint_tokenizer(tmp_path, True, json.loads((tmp_path / "config.json").read_text()),
                                          {"eos_token_id": [1, 2]})
    prompt = "def wrap(text):"
    ids = torch.tensor([hf_tok(prompt).input_ids])
    hf.generation_config.eos_token_id = [1, 2]
    expected = hf.generate(ids, max_new_tokens=24, do_sample=False, pad_token_id=0)[0, ids.shape[1]:].tolist()
    result = generate(load(tmp_path), prompt, max_new_tokens=24)
    assert result.tokens[0] == expected


def test_generation_ends_at_any_of_several_eos_ids():
    from specdec.decoding.stopping import Row
    for eos in (7, 5):
        row = Row(StopRule(10, (5, 7)))
        assert not row.emit(3) and row.emit(eos) and row.finish_reason == "eos" and row.tokens == [3, eos]
