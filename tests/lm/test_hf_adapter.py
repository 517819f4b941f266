"""transformers causal LMs as target and as draft (any batch size, chains of drafts): greedy output equals
the reference decoding of the same target; bad models are refused with a clear error."""
from __future__ import annotations

import pytest
import torch
import transformers

from specdec.decoding.engine import speculative_generate
from specdec.decoding.reference import reference_generate
from specdec.decoding.sampling import SamplingConfig
from specdec.decoding.stopping import StopRule
from specdec.errors import SpecdecError
from specdec.lm.checkpoint import hf_config
from specdec.proposers import DraftModelProposer, NgramProposer

from ..spec_helpers import NEAR_TIE, greedy_divergence, tiny_llama

GREEDY = SamplingConfig()
RULE = StopRule(max_new_tokens=16)
PROMPTS = [[5, 9, 5, 9, 5], list(range(20, 31))]
SPECDEC_TARGET = tiny_llama(0)  # vocab 64, context 64


def hf_gpt2(seed: int) -> transformers.GPT2LMHeadModel:
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                  bos_token_id=0, eos_token_id=0, initializer_range=0.2)
    return transformers.GPT2LMHeadModel(cfg).eval()


def hf_llama(seed: int) -> transformers.LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   bos_token_id=0, eos_token_id=0, pad_token_id=0, initializer_range=0.2)
    return transformers.LlamaForCausalLM(cfg).eval()


def hf_copy_of_specdec_target() -> transformers.LlamaForCausalLM:
    """specdec's target as a transformers model with the same weights: the same function."""
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**hf_config(SPECDEC_TARGET.config, torch.float32)))
    model.load_state_dict(SPECDEC_TARGET.hf_state_dict())
    return model.eval()


@pytest.fixture(scope="module")
def models():
    return {"hf-llama": hf_llama(0), "hf-gpt2": hf_gpt2(1), "specdec": SPECDEC_TARGET,
            "hf-copy-of-specdec": hf_copy_of_specdec_target()}


PAIRS = [("hf-llama", "hf-gpt2"), ("hf-gpt2", "hf-gpt2"), ("hf-llama", "hf-llama"),
         ("specdec", "hf-copy-of-specdec"), ("hf-copy-of-specdec", "specdec"), ("hf-gpt2", "ngram")]


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("target_name,draft_name", PAIRS)
def test_transformers_target_and_draft_greedy_equals_reference(models, target_name, draft_name, k):
    target = models[target_name]
    if draft_name == "ngram":
        proposer = NgramProposer()
    else:
        proposer = DraftModelProposer(model=models[draft_name])
    for prompt in PROMPTS:
        rows, metrics = speculative_generate(target, proposer, [prompt], RULE, GREEDY, k)
        expected = reference_generate(target, prompt, RULE, GREEDY).tokens
        gap = greedy_divergence(target, prompt, rows[0].tokens, expected)
        assert gap is None or gap < NEAR_TIE, f"diverges where the target's top-2 gap is {gap}"
        if {target_name, draft_name} == {"specdec", "hf-copy-of-specdec"} or target_name == draft_name:
            # the same function as draft: every draft accepted, through both caches' rollbacks
            assert gap is not None or metrics.acceptance_rate == 1.0


def test_transformers_sampling_runs_and_stops_exactly(models):
    rule = StopRule(max_new_tokens=7)
    sampling = SamplingConfig(temperature=0.8, top_k=10)
    rows, metrics = speculative_generate(models["hf-llama"], DraftModelProposer(model=models["hf-gpt2"]),
                                         [PROMPTS[0]], rule, sampling, 3, torch.Generator().manual_seed(0))
    assert len(rows[0].tokens) == 7 and metrics.emitted == 7


@pytest.mark.parametrize("target_name,draft_name", [("hf-gpt2", "ngram"), ("hf-llama", "hf-gpt2"),
                                                    ("specdec", "hf-gpt2")])
def test_transformers_models_batch_rows_of_different_lengths(models, target_name, draft_name):
    """Rows commit different numbers of tokens each step; each row's own cache rolls back alone."""
    target = models[target_name]
    proposer = NgramProposer() if draft_name == "ngram" else DraftModelProposer(model=models[draft_name])
    rows, _ = speculative_generate(target, proposer, PROMPTS, RULE, GREEDY, 3)
    for prompt, row in zip(PROMPTS, rows):
        expected = reference_generate(target, prompt, RULE, GREEDY).tokens
        gap = greedy_divergence(target, prompt, row.tokens, expected)
        assert gap is None or gap < NEAR_TIE, f"diverges where the target's top-2 gap is {gap}"


def test_bad_transformers_models_are_refused(models):
    bert = transformers.BertModel(transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1,
                                                          num_attention_heads=2, intermediate_size=32)).eval()
    with pytest.raises(SpecdecError, match="BertModel.*not a causal language model"):
        DraftModelProposer(model=bert)
    with pytest.raises(SpecdecError, match="training mode"):
        DraftModelProposer(model=hf_gpt2(2).train())
    small_vocab = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=32, n_embd=16, n_layer=1, n_head=2, n_positions=64, bos_token_id=0, eos_token_id=0)).eval()
    with pytest.raises(SpecdecError, match="vocabulary of 32 tokens but the target has 64"):
        speculative_generate(models["hf-llama"], DraftModelProposer(model=small_vocab), [PROMPTS[0]],
                             RULE, GREEDY, 2)
    with pytest.raises(SpecdecError, match="context is 64"):
        speculative_generate(models["hf-gpt2"], NgramProposer(), [[1] * 60], RULE, GREEDY, 2)
