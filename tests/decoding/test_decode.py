"""Plain decoding against the reference oracle, and exact EOS / stop-string / max_new_tokens rules."""
from __future__ import annotations

import pytest
import torch

from specdec.decoding.engine import plain_generate
from specdec.decoding.reference import reference_generate
from specdec.decoding.sampling import SamplingConfig, probabilities
from specdec.decoding.stopping import StopRule
from specdec.lm.tokenizer import Tokenizer

from ..conftest import tiny_model

PROMPTS = [[5, 17, 42], [200, 3, 3, 3, 9, 81, 7, 7, 100, 2], [1], [300, 301, 302, 303, 304, 305]]


@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_batched_decoding_equals_the_reference(batch):
    model = tiny_model()
    rule = StopRule(max_new_tokens=24)
    rows, _ = plain_generate(model, PROMPTS[:batch], rule, SamplingConfig())
    for prompt, row in zip(PROMPTS, rows):
        assert row.tokens == reference_generate(model, prompt, rule, SamplingConfig()).tokens


@pytest.mark.parametrize("sampling", [SamplingConfig(1.0, seed=3), SamplingConfig(0.7, top_k=20, top_p=0.9, seed=4)])
def test_seeded_sampling_at_batch_1_equals_the_reference(sampling):
    model = tiny_model()
    rule = StopRule(max_new_tokens=20)
    rows, _ = plain_generate(model, PROMPTS[1:2], rule, sampling, sampling.generator())
    ref = reference_generate(model, PROMPTS[1], rule, sampling, sampling.generator())
    assert rows[0].tokens == ref.tokens


def test_top_k_top_p_and_temperature_transform():
    logits = torch.log(torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]]))
    assert torch.allclose(probabilities(logits, SamplingConfig(1.0, top_k=2)), torch.tensor([[5 / 7, 2 / 7, 0, 0, 0]]))
    # top_p=0.8: 0.5 + 0.2 < 0.8, so the third token is still needed to reach 0.8
    assert torch.allclose(probabilities(logits, SamplingConfig(1.0, top_p=0.8)),
                          torch.tensor([[0.5, 0.2, 0.15, 0, 0]]) / 0.85)
    assert probabilities(logits, SamplingConfig(0.0)).tolist() == [[1, 0, 0, 0, 0]]
    sharp = probabilities(logits, SamplingConfig(0.5))
    assert torch.allclose(sharp, torch.tensor([[0.25, 0.04, 0.0225, 0.01, 0.0025]]) / 0.325)


def test_eos_stop_string_and_length_are_honoured_exactly(tokenizer_file):
    model, tok = tiny_model(), Tokenizer.load(tokenizer_file)
    prompt = PROMPTS[1]
    free = reference_generate(model, prompt, StopRule(30), SamplingConfig()).tokens
    # EOS: the first occurrence of the token at position 5 ends the row there, kept in tokens
    eos = free[5]
    first = free.index(eos)
    rows, _ = plain_generate(model, [prompt], StopRule(30, eos_id=eos), SamplingConfig())
    assert rows[0].tokens == free[:first + 1] and rows[0].finish_reason == "eos"
    # stop string: the text ends before it; tokens end with the token that completed it
    text = tok.decode(free)
    stop = text[len(text) // 2:len(text) // 2 + 2]
    cut = text.index(stop)
    rule = StopRule(30, stop_strings=(stop,), decode=tok.decode)
    rows, _ = plain_generate(model, [prompt], rule, SamplingConfig())
    n = next(i for i in range(1, 31) if stop in tok.decode(free[:i]))
    assert rows[0].tokens == free[:n] and rows[0].finish_reason == "stop"
    assert rows[0].text() == text[:cut]
    # length, including zero
    for m in (0, 1, 7):
        rows, _ = plain_generate(model, [prompt], StopRule(m), SamplingConfig())
        assert rows[0].tokens == free[:m] and rows[0].finish_reason == "length"


def test_rows_finish_on_their_own_in_a_batch():
    model = tiny_model()
    free = [reference_generate(model, p, StopRule(12), SamplingConfig()).tokens for p in PROMPTS]
    eos = free[0][2]
    rows, _ = plain_generate(model, PROMPTS, StopRule(12, eos_id=eos), SamplingConfig())
    for f, row in zip(free, rows):
        want = f[:f.index(eos) + 1] if eos in f else f
        assert row.tokens == want
