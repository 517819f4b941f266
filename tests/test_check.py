"""specdec.check: the user's lossless check. The randomized PIT is uniform for tokens drawn from the
distribution (and not otherwise); the check passes a correct pair, fails a deliberately wrong
verifier on the same pair, and its KS p-value is right."""
from __future__ import annotations

import math

import pytest
import torch
from scipy.stats import kstest

from specdec.check import WRONG_VERIFIERS, check, ks_uniform, randomized_pit
from specdec.cli import main
from specdec.decoding.sampling import SamplingConfig
from specdec.errors import SpecdecError
from specdec.proposers import build_proposer

from .spec_helpers import noisy_copy, tiny_llama

TARGET = tiny_llama(3, vocab=200, layers=1, hidden=32, heads=2, kv_heads=1, context=64, std=0.4)
DRAFT = noisy_copy(TARGET, 0.05, seed=7)
PROMPTS = [[1, 5, 9], [2, 40, 41, 42], [7], [100, 3]]
SAMPLING = SamplingConfig(temperature=0.8, top_k=50, top_p=0.95)


def test_the_randomized_pit_is_uniform_exactly_for_its_own_distribution():
    g = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(4000, 300, generator=g) * 3, -1)     # (T, V): peaked, large vocabulary
    drawn = torch.multinomial(probs, 1, generator=g)[:, 0]
    u, bad = randomized_pit(probs, drawn, g)
    assert bad == 0 and kstest(u.numpy(), "uniform").pvalue > 0.01
    other = torch.softmax(torch.log(probs) * 1.3, -1)                       # a sharper distribution
    u, _ = randomized_pit(probs, torch.multinomial(other, 1, generator=g)[:, 0], g)
    assert kstest(u.numpy(), "uniform").pvalue < 1e-6


def test_the_ks_p_value_matches_scipy():
    g = torch.Generator().manual_seed(1)
    for n, power in ((20, 1.0), (500, 1.0), (3000, 1.2)):
        u = torch.rand(n, generator=g, dtype=torch.float64) ** power
        d, p = ks_uniform(u)
        reference = kstest(u.numpy(), "uniform")
        assert math.isclose(d, reference.statistic, rel_tol=1e-9)
        assert abs(p - reference.pvalue) < 5e-3 + 0.05 * reference.pvalue


def test_a_correct_pair_passes_and_greedy_equals_plain():
    result = check(TARGET, build_proposer("draft-model", model=DRAFT), PROMPTS, SAMPLING, k=3, sequences=96,
                   max_new_tokens=24)
    print("\n" + result.verdict())
    assert result.passed, result.verdict()
    assert result.sampled["tokens"] == 96 * 24 and result.sampled["impossible_tokens"] == 0
    assert result.greedy["identical"] == len(PROMPTS)
    assert 0.05 < result.sampled["acceptance_rate"] < 0.95  # drafts were accepted and rejected: both paths ran


def test_a_deliberately_wrong_verifier_fails():
    result = check(TARGET, build_proposer("draft-model", model=DRAFT), PROMPTS, SAMPLING, k=3, sequences=96,
                   max_new_tokens=24, sampled_verify=WRONG_VERIFIERS["accept-always"])
    print("\n" + result.verdict())
    assert not result.passed
    assert result.sampled["p_value"] < 1e-3 or result.sampled["impossible_tokens"] > 0


def test_the_command_prints_its_verdict_and_refuses_greedy(tmp_path, capsys):
    from specdec.api import DEFAULT_TARGET
    from specdec.lm.checkpoint import save_model
    big = tiny_llama(4, vocab=16384, layers=1, hidden=32, heads=2, kv_heads=1, context=128, std=0.4)
    tokenizer = DEFAULT_TARGET / "tokenizer.json"
    target = save_model(big, tmp_path / "t", tokenizer, dtype=torch.float32)
    draft = save_model(noisy_copy(big, 0.2, seed=8), tmp_path / "d", tokenizer, dtype=torch.float32)
    with pytest.raises(SpecdecError, match="temperature > 0"):
        check(TARGET, build_proposer("ngram"), PROMPTS, SamplingConfig(), k=2)
    code = main(["check", "--model", str(target), "--draft", "draft-model", "--draft-model", str(draft),
                 "--prompt", "def f(x):", "--sequences", "16", "--max-new-tokens", "8", "-k", "2",
                 "--temperature", "1", "--threads", "1"])
    out = capsys.readouterr().out
    assert code == 0 and "PASS" in out and "p = " in out and "conditions:" in out


def test_a_subtly_wrong_residual_fails_on_the_p_value_alone(monkeypatch):
    from specdec.decoding import verify

    def residual_without_max(target_probs, draft_probs):  # |target - draft| normalised: wrong
        diff = (target_probs - draft_probs).abs()
        return diff / diff.sum(-1, keepdim=True)

    plain = SamplingConfig(temperature=1.0)  # no top-k / top-p: every token is possible, only the PIT can tell
    proposer = build_proposer("draft-model", model=DRAFT)
    assert check(TARGET, proposer, PROMPTS, plain, k=3, sequences=96, max_new_tokens=24).passed
    monkeypatch.setattr(verify, "residual", residual_without_max)
    result = check(TARGET, proposer, PROMPTS, plain, k=3, sequences=96, max_new_tokens=24)
    print("\n" + result.verdict())
    assert result.sampled["impossible_tokens"] == 0 and result.sampled["p_value"] < 0.01 and not result.passed
