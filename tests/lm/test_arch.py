"""config.json read strictly: what changes the arithmetic is implemented (the rotary frequencies
equal transformers') or refused by name with the reason; unknown families list the supported ones."""
from __future__ import annotations

import importlib
import inspect

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.auto.configuration_auto import model_type_to_module_name

from specdec.errors import SpecdecError
from specdec.lm.arch import FAMILIES, UNREAD, UNREAD_AS, Arch

BASE = dict(model_type="llama", vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)

ROPES = [
    {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 32},
    {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "rope_theta": 1e6, "factor": 2.0, "original_max_position_embeddings": 64, "beta_fast": 16,
     "mscale": 0.7, "mscale_all_dim": 0.5},
    {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 64,
     "short_factor": [1.0, 1.1, 1.3, 1.7, 2.0, 2.5, 3.0, 4.0], "long_factor": [2.0] * 8},
]


@pytest.mark.parametrize("rope", ROPES, ids=lambda r: r["rope_type"])
def test_scaled_rotary_frequencies_and_factor_equal_transformers(rope):
    hf = transformers.LlamaConfig(**{k: v for k, v in BASE.items() if k != "model_type"}, rope_parameters=dict(rope))
    expected, factor = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf, "cpu")
    arch = Arch.from_dict(hf.to_dict())
    assert torch.allclose(arch.inv_freq(), expected, rtol=1e-6, atol=0) and arch.attention_factor == pytest.approx(factor)


def test_longrope_runs_within_its_original_context_where_it_uses_the_short_factors():
    arch = Arch.from_dict({**BASE, "model_type": "phi3", "original_max_position_embeddings": 64,
                           "rope_scaling": {"type": "su", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}})
    assert arch.max_position_embeddings == 64 and arch.rope_scaling["rope_type"] == "longrope"
    assert arch.attention_factor == pytest.approx((1 + torch.log(torch.tensor(4.0)).item() / torch.log(
        torch.tensor(64.0)).item()) ** 0.5)  # from the config's 256 positions over the original 64


def test_the_old_layout_of_rope_keys_reads_as_the_new():
    old = Arch.from_dict({**BASE, "rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2.0}})
    new = Arch.from_dict({**BASE, "rope_parameters": {"rope_type": "linear", "rope_theta": 5e5, "factor": 2.0}})
    assert old == new and old.rope_scaling


REFUSED = [  # (config changes, the name the refusal must say)
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0], "long_factor": [2.0],
                          "original_max_position_embeddings": 64}}, "short_factor"),
    ({"rope_parameters": {"rope_type": "su", "rope_theta": 1e4}}, "su"),
    ({"rope_parameters": {"rope_type": "proportional", "rope_theta": 1e4}}, "proportional"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0}}, "low_freq_factor"),
    ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0, "beta_fast": 3}}, "beta_fast"),
    ({"pretraining_tp": 2}, "pretraining_tp"),
    ({"hidden_act": "relu"}, "hidden_act"),
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
    ({"final_logit_softcapping": 30.0}, "final_logit_softcapping"),
    ({"quantization_config": {"quant_method": "gptq"}}, "quantization_config"),
    ({"num_local_experts": 8}, "num_local_experts"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({"model_type": "mistral", "attention_bias": True}, "attention_bias"),
    ({"model_type": "qwen2", "mlp_bias": True}, "mlp_bias"),
    ({"model_type": "gemma2"}, "soft-caps"),
    ({"model_type": "mixtral"}, "mixture-of-experts"),
]


@pytest.mark.parametrize("changes,name", REFUSED, ids=[n for _, n in REFUSED])
def test_a_key_specdec_does_not_compute_is_refused_by_name(changes, name):
    with pytest.raises(SpecdecError, match=name):
        Arch.from_dict({**BASE, **changes})


def test_an_unknown_family_is_refused_with_the_supported_list():
    with pytest.raises(SpecdecError, match="gpt_neox.*" + ", ".join(FAMILIES)):
        Arch.from_dict({**BASE, "model_type": "gpt_neox"})


@pytest.mark.parametrize("family,window,context", [("mistral", 64, 64), ("mistral", None, 256),
                                                   ("qwen2", 64, 256)])
def test_a_sliding_window_cuts_the_context_to_it(family, window, context):
    """qwen2's window is off unless use_sliding_window says so (transformers reads it the same way)."""
    assert Arch.from_dict({**BASE, "model_type": family, "sliding_window": window}).max_position_embeddings == context


def test_specdecs_own_config_round_trips():
    arch = Arch.from_dict({**BASE, "model_type": "qwen3", "head_dim": 32, "eos_token_id": [2, 3]})
    again = Arch.from_dict(arch.to_dict())
    assert again == arch and again.qk_norm and again.eos_ids == (2, 3)


# The config.json published with each model on the Hugging Face hub, as written there.
PUBLISHED = {
    "SmolLM2-135M": {
        "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 0,
        "eos_token_id": 0, "hidden_act": "silu", "hidden_size": 576, "initializer_range": 0.041666666666666664,
        "intermediate_size": 1536, "is_llama_config": True, "max_position_embeddings": 8192, "mlp_bias": False,
        "model_type": "llama", "num_attention_heads": 9, "num_hidden_layers": 30, "num_key_value_heads": 3,
        "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_interleaved": False, "rope_scaling": None,
        "rope_theta": 100000, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
        "transformers_version": "4.40.1", "use_cache": True, "vocab_size": 49152},
    "SmolLM2-135M-Instruct": {
        "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 1,
        "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 576, "initializer_range": 0.041666666666666664,
        "intermediate_size": 1536, "is_llama_config": True, "max_position_embeddings": 8192, "mlp_bias": False,
        "model_type": "llama", "num_attention_heads": 9, "num_hidden_layers": 30, "num_key_value_heads": 3,
        "pad_token_id": 2, "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_interleaved": False,
        "rope_scaling": None, "rope_theta": 100000, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
        "transformers.js_config": {"kv_cache_dtype": {"q4f16": "float16", "fp16": "float16"}},
        "transformers_version": "4.42.3", "use_cache": True, "vocab_size": 49152},
    "Llama-3.2-1B": {
        "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 128000, "eos_token_id": 128001, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2048,
        "initializer_range": 0.02, "intermediate_size": 8192, "max_position_embeddings": 131072, "mlp_bias": False,
        "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8,
        "pretraining_tp": 1, "rms_norm_eps": 1e-05,
        "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
        "transformers_version": "4.45.0.dev0", "use_cache": True, "vocab_size": 128256},
    "Qwen2.5-0.5B": {
        "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
        "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 896, "initializer_range": 0.02,
        "intermediate_size": 4864, "max_position_embeddings": 32768, "max_window_layers": 24, "model_type": "qwen2",
        "num_attention_heads": 14, "num_hidden_layers": 24, "num_key_value_heads": 2, "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
        "transformers_version": "4.40.1", "use_cache": True, "use_mrope": False, "use_sliding_window": False,
        "vocab_size": 151936},
    "Qwen3-0.6B": {
        "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 1024,
        "initializer_range": 0.02, "intermediate_size": 3072, "max_position_embeddings": 40960,
        "max_window_layers": 28, "model_type": "qwen3", "num_attention_heads": 16, "num_hidden_layers": 28,
        "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000,
        "sliding_window": None, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
        "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936},
    "Mistral-7B-v0.3": {
        "architectures": ["MistralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2,
        "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
        "max_position_embeddings": 32768, "model_type": "mistral", "num_attention_heads": 32,
        "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 1000000.0,
        "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "transformers_version": "4.42.0.dev0", "use_cache": True, "vocab_size": 32768},
    "Gemma-2B": {
        "architectures": ["GemmaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 2,
        "eos_token_id": 1, "head_dim": 256, "hidden_act": "gelu", "hidden_size": 2048, "initializer_range": 0.02,
        "intermediate_size": 16384, "max_position_embeddings": 8192, "model_type": "gemma",
        "num_attention_heads": 8, "num_hidden_layers": 18, "num_key_value_heads": 1, "pad_token_id": 0,
        "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 10000.0, "torch_dtype": "bfloat16",
        "transformers_version": "4.38.0.dev0", "use_cache": True, "vocab_size": 256000},
    "Phi-3-mini-4k-instruct": {
        "_name_or_path": "Phi-3-mini-4k-instruct", "architectures": ["Phi3ForCausalLM"], "attention_dropout": 0.0,
        "auto_map": {"AutoConfig": "configuration_phi3.Phi3Config",
                     "AutoModelForCausalLM": "modeling_phi3.Phi3ForCausalLM"},
        "bos_token_id": 1, "embd_pdrop": 0.0, "eos_token_id": 32000, "hidden_act": "silu", "hidden_size": 3072,
        "initializer_range": 0.02, "intermediate_size": 8192, "max_position_embeddings": 4096,
        "model_type": "phi3", "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 32,
        "original_max_position_embeddings": 4096, "pad_token_id": 32000, "resid_pdrop": 0.0,
        "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 10000.0, "sliding_window": 2047,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.40.2",
        "use_cache": True, "vocab_size": 32064},
    "SmolLM2-135M-Instruct (transformers' folder from its GGUF)": {
        "_model_name_or_path": "Smollm2 135M 8k Lc100K Mix1 Ep2", "attention_bias": False,
        "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2, "head_dim": 64, "hidden_act": "silu",
        "hidden_size": 576, "initializer_range": 0.02, "intermediate_size": 1536, "max_position_embeddings": 8192,
        "mlp_bias": False, "model_type": "llama", "num_attention_heads": 9, "num_hidden_layers": 30,
        "num_key_value_heads": 3, "pad_token_id": 2, "pretraining_tp": 1, "rms_norm_eps": 9.999999747378752e-06,
        "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"}, "tie_word_embeddings": True,
        "transformers_version": "5.24.0", "unk_token_id": 0, "use_cache": True, "vocab_size": 49152},
}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_published_configs_load_as_transformers_reads_them(name):
    config = PUBLISHED[name]
    arch = Arch.from_dict(config)
    hf = transformers.AutoConfig.for_model(**config)
    assert (arch.hidden_size, arch.num_hidden_layers, arch.num_attention_heads, arch.num_key_value_heads,
            arch.vocab_size, arch.tie_word_embeddings) == (
        hf.hidden_size, hf.num_hidden_layers, hf.num_attention_heads, hf.num_key_value_heads, hf.vocab_size,
        hf.tie_word_embeddings)
    assert arch.head_dim == (getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads)
    assert arch.rope_theta == hf.rope_parameters["rope_theta"] and arch.eos_ids == Arch(
        eos_token_id=config["eos_token_id"]).eos_ids
    assert arch.max_position_embeddings == min(hf.max_position_embeddings, config.get("sliding_window") or 1 << 30)
    kind = hf.rope_parameters["rope_type"]
    if kind != "default":
        assert torch.allclose(arch.inv_freq(), ROPE_INIT_FUNCTIONS[kind](hf, "cpu")[0])


@pytest.mark.parametrize("key", sorted(UNREAD | set(UNREAD_AS)))
def test_the_keys_accepted_unread_are_read_nowhere_in_transformers_modelling_code(key):
    for family in FAMILIES:
        module = model_type_to_module_name(family)  # gemma3_text's modelling code is gemma3's
        source = inspect.getsource(importlib.import_module(f"transformers.models.{module}.modeling_{module}"))
        assert f".{key}" not in source and f'"{key}"' not in source, (family, key)


@pytest.mark.parametrize("key, value", [(k, not plain) for k, (plain, _) in UNREAD_AS.items()])
def test_an_unread_key_saying_the_model_computes_otherwise_is_refused_by_name(key, value):
    with pytest.raises(SpecdecError, match=f"'{key}' = {value!r} is refused"):
        Arch.from_dict({**PUBLISHED["SmolLM2-135M"], key: value})
