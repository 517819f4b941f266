"""config.json read strictly: what changes the arithmetic is implemented (the rotary frequencies
equal transformers') or refused by name with the reason; unknown families list the supported ones."""
from __future__ import annotations

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from specdec.errors import SpecdecError
from specdec.lm.arch import FAMILIES, Arch

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
