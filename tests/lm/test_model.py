"""The model against transformers' LlamaForCausalLM, and the KV cache's invariants."""
from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import torch
import transformers

from specdec.decoding.reference import reference_generate
from specdec.decoding.sampling import SamplingConfig
from specdec.decoding.stopping import StopRule
from specdec.lm.checkpoint import load_model, save_model

from ..conftest import TINY, tiny_model

TOL = 1e-4  # max abs logit difference allowed in fp32


@pytest.mark.parametrize("tied", [False, True])
def test_our_checkpoint_loads_in_transformers_with_equal_logits_and_greedy_output(tmp_path, tied):
    cfg = dataclasses.replace(TINY, tie_word_embeddings=tied)
    ours = tiny_model(cfg=cfg)
    save_model(ours, tmp_path / "m", dtype=torch.float32)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.float32).eval()
    assert isinstance(hf, transformers.LlamaForCausalLM)
    tokens = torch.randint(0, cfg.vocab_size, (3, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (ours(tokens).logits - hf(tokens).logits).abs().max().item()
    assert diff <= TOL
    prompt = tokens[0, :10]
    with torch.no_grad():
        hf_out = hf.generate(prompt[None], max_new_tokens=30, min_new_tokens=30, do_sample=False)[0, 10:]
    row = reference_generate(ours, prompt.tolist(), StopRule(30), SamplingConfig())
    assert row.tokens == hf_out.tolist()


def test_transformers_model_loads_into_ours_with_equal_logits(tmp_path):
    hf_cfg = transformers.LlamaConfig(vocab_size=300, hidden_size=48, intermediate_size=96, num_hidden_layers=3,
                                      num_attention_heads=6, num_key_value_heads=3, max_position_embeddings=128,
                                      rope_theta=5000.0, rms_norm_eps=1e-6)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(hf_cfg).eval()
    hf.save_pretrained(tmp_path / "hf")
    ours = load_model(tmp_path / "hf", dtype=torch.float32)
    assert ours.config.rope_theta == 5000.0 and ours.config.head_dim == 8
    tokens = torch.randint(0, 300, (2, 33))
    with torch.no_grad():
        assert (ours(tokens).logits - hf(tokens).logits).abs().max().item() <= TOL


def test_cached_decoding_equals_full_forward():
    model = tiny_model()
    tokens = torch.randint(0, TINY.vocab_size, (2, 30))
    with torch.no_grad():
        full = model(tokens).logits
        cache = model.new_cache(2, 64)
        parts = [model(tokens[:, a:b], cache=cache).logits for a, b in [(0, 13), (13, 14), (14, 22), (22, 30)]]
    assert cache.lengths.tolist() == [30, 30]
    assert (torch.cat(parts, 1) - full).abs().max().item() <= 1e-5


def test_rollback_is_a_pointer_move_and_rows_keep_their_own_length():
    model = tiny_model()
    a, b = torch.randint(0, TINY.vocab_size, (2, 20))
    with torch.no_grad():
        cache = model.new_cache(2, 64)
        model(torch.stack([a, b])[:, :16], cache=cache)
        tables = [list(t) for t in cache.tables]
        cache.rollback(torch.tensor([12, 9]))            # reject different amounts per row
        assert cache.tables == tables                     # no block given back or moved
        step = torch.stack([a[12:15], b[9:12]])
        got = model(step, cache=cache).logits             # rows continue from their own lengths
        want_a = model(a[None, :15]).logits[:, 12:]
        want_b = model(b[None, :12]).logits[:, 9:]
    assert cache.lengths.tolist() == [15, 12]
    assert (got[0] - want_a[0]).abs().max() <= 1e-5 and (got[1] - want_b[0]).abs().max() <= 1e-5


def test_explicit_tree_mask_and_positions():
    """Two branches after a shared prefix, verified in one pass, equal separate causal passes."""
    model = tiny_model()
    prefix = torch.randint(0, TINY.vocab_size, (1, 10))
    x, y1, y2 = torch.randint(0, TINY.vocab_size, (3,)).tolist()
    # new tokens [x, y1, y2]: y1 and y2 are alternative children of x, both at position 11
    tree = torch.tensor([[[1, 0, 0], [1, 1, 0], [1, 0, 1]]], dtype=torch.bool)
    with torch.no_grad():
        cache = model.new_cache(1, 32)
        model(prefix, cache=cache)
        got = model(torch.tensor([[x, y1, y2]]), positions=torch.tensor([[10, 11, 11]]), cache=cache,
                    attention_mask=tree).logits
        want1 = model(torch.cat([prefix, torch.tensor([[x, y1]])], 1)).logits[0, -2:]
        want2 = model(torch.cat([prefix, torch.tensor([[x, y2]])], 1)).logits[0, -1]
    assert (got[0, :2] - want1).abs().max() <= 1e-5
    assert (got[0, 2] - want2).abs().max() <= 1e-5


def test_hidden_states_of_chosen_layers():
    model = tiny_model()
    tokens = torch.randint(0, TINY.vocab_size, (1, 12))
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **{k: v for k, v in TINY.to_dict().items() if k != "tie_word_embeddings"})).eval()
    hf.load_state_dict(model.hf_state_dict())
    with torch.no_grad():
        out = model(tokens, output_layers=(0, 1))
        ref = hf(tokens, output_hidden_states=True).hidden_states
    assert (out.layers[0] - ref[1]).abs().max() <= TOL      # hidden_states[0] is the embedding
    assert (out.hidden - ref[-1]).abs().max() <= TOL        # the last entry is after the final norm


def test_cache_overflow_and_context_are_clear_errors():
    model = tiny_model()
    cache = model.new_cache(1, 8)
    with pytest.raises(ValueError, match="KV cache overflow"):
        model(torch.zeros(1, 9, dtype=torch.long), cache=cache)
    with pytest.raises(ValueError, match="beyond the model's context"):
        model(torch.zeros(1, TINY.max_position_embeddings + 1, dtype=torch.long))


def test_a_model_built_on_the_meta_device_imports_no_compiler_stack():
    """A GGUF file's model is built on the meta device and filled tensor by tensor: building it runs
    no initialisation, whose meta kernels (torch's Python references) import torch's compiler stack
    (dynamo, sympy: 54 MB resident of modules a decoding process never uses). A fresh process."""
    code = ("import sys, torch\n"
            "from specdec.lm.arch import Arch\n"
            "from specdec.lm.model import LlamaForCausalLM\n"
            "cfg = Arch(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,\n"
            "           num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64)\n"
            "with torch.device('meta'):\n"
            "    model = LlamaForCausalLM(cfg)\n"
            "assert model.model.embed_tokens.weight.is_meta\n"
            "print(sorted(m for m in ('torch._dynamo', 'sympy') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
