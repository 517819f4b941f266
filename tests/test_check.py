"""specdec.check: the user's lossless check. The randomized PIT is uniform for tokens drawn from the
distribution (and not otherwise); the check passes a correct pair, fails a deliberately wrong
verifier on the same pair, and its KS p-value is right; its two-stage decision has the stated
false-alarm rate and power; the command's exit status is its verdict."""
from __future__ import annotations

import json
import math

import pytest
import torch
from scipy.stats import kstest

from specdec.check import (
    DETECTABLE,
    FALSE_ALARM,
    FIRST_LEVEL,
    POWER,
    SECOND_LEVEL,
    WRONG_VERIFIERS,
    check,
    decide,
    ks_critical,
    ks_uniform,
    randomized_pit,
)
from specdec.cli import main
from specdec.decoding.sampling import SamplingConfig
from specdec.errors import SpecdecError
from specdec.proposers import DraftModelProposer, NgramProposer

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
    result = check(TARGET, DraftModelProposer(model=DRAFT), PROMPTS, SAMPLING, k=3, sequences=96,
                   max_new_tokens=24)
    print("\n" + result.verdict())
    assert result.passed, result.verdict()
    assert result.sampled["tokens"] == 96 * 24 and result.sampled["impossible_tokens"] == 0
    assert [r["p_value"] >= FIRST_LEVEL for r in result.sampled["runs"]] == [True]  # one run sufficed
    assert result.greedy["identical"] == len(PROMPTS)
    assert 0.05 < result.sampled["acceptance_rate"] < 0.95  # drafts were accepted and rejected: both paths ran


def test_a_deliberately_wrong_verifier_fails():
    result = check(TARGET, DraftModelProposer(model=DRAFT), PROMPTS, SAMPLING, k=3, sequences=96,
                   max_new_tokens=24, sampled_verify=WRONG_VERIFIERS["accept-always"])
    print("\n" + result.verdict())
    assert result.status == "FAIL"
    assert result.sampled["runs"][-1]["p_value"] < 1e-3 or result.sampled["impossible_tokens"] > 0


def test_the_command_prints_its_verdict_and_refuses_greedy(tmp_path, capsys):
    from specdec.api import TOY_TARGET
    from specdec.lm.checkpoint import save_model
    big = tiny_llama(4, vocab=16384, layers=1, hidden=32, heads=2, kv_heads=1, context=128, std=0.4)
    tokenizer = TOY_TARGET / "tokenizer.json"
    target = save_model(big, tmp_path / "t", tokenizer, dtype=torch.float32)
    draft = save_model(noisy_copy(big, 0.2, seed=8), tmp_path / "d", tokenizer, dtype=torch.float32)
    with pytest.raises(SpecdecError, match="temperature > 0"):
        check(TARGET, NgramProposer(), PROMPTS, SamplingConfig(), k=2)
    command = ["check", "--model", str(target), "--draft", "draft-model", "--draft-model", str(draft),
               "--prompt", "def f(x):", "--sequences", "16", "--max-new-tokens", "8", "-k", "2",
               "--temperature", "1", "--top-k", "20", "--threads", "1"]
    code = main(command)
    out, err = capsys.readouterr()
    assert code == 0 and "PASS" in out and "p = " in out and "conditions:" in out
    assert "false-alarm rate 0.1%" in out and "power >= 0.9" in out
    assert "check: sampled run 1" in err and "check: greedy" in err  # progress bars, on stderr
    assert main(command + ["--wrong-verifier", "accept-always"]) == 1  # FAIL gates a CI
    assert "FAIL" in capsys.readouterr().out
    assert main(command + ["--wrong-verifier", "accept-always", "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["status"] == "FAIL"


def test_a_check_that_drafted_nothing_is_undecided(tiny_checkpoint, capsys):
    code = main(["check", "--model", str(tiny_checkpoint), "--draft", "ngram", "--ngram-min", "9", "--ngram-max", "9",
                 "--prompt", "x", "--sequences", "4", "--max-new-tokens", "4", "--threads", "1",
                 "--json"])  # at most 6 tokens in a row: no 9-gram to match
    result = json.loads(capsys.readouterr().out)
    assert code == 3 and result["status"] == "UNDECIDED" and result["sampled"]["acceptance_rate"] is None


def test_the_two_stage_decision_table():
    assert decide([0.5], 0) == "PASS" and decide([FIRST_LEVEL], 0) == "PASS"
    assert decide([0.5], 1) == "FAIL"                       # an impossible token: no second run needed
    assert decide([0.01], 0) is None                         # a second, independent run decides
    assert decide([0.01, 0.04], 0) == "FAIL" and decide([0.01, 0.06], 0) == "PASS"


def test_the_stated_false_alarm_rate_and_power():
    """A lossless pair's U's are uniform: the first run repeats at the rate FIRST_LEVEL (so the
    check fails at FIRST_LEVEL x SECOND_LEVEL = 0.001); at the stated distance the two stages
    together reject with at least the stated power (here a CDF x + 2δ min(x, 1 - x), |G - x| = δ
    at 0.5)."""
    from scipy.stats import norm
    assert FALSE_ALARM == pytest.approx(0.001)
    bound = (norm.cdf((DETECTABLE - ks_critical(FIRST_LEVEL)) / 0.5)
             * norm.cdf((DETECTABLE - ks_critical(SECOND_LEVEL)) / 0.5))
    assert POWER <= bound < POWER + 0.001                   # DETECTABLE is the smallest distance with that power
    assert DETECTABLE < 1.628 + 0.641                         # and no larger than one run at level 0.01 needed
    g, n = torch.Generator().manual_seed(0), 1000
    repeated = sum(ks_uniform(torch.rand(n, generator=g, dtype=torch.float64))[1] < FIRST_LEVEL for _ in range(3000))
    assert 0.012 < repeated / 3000 < 0.03

    def departed(delta):                                     # inverse of G(x) = x + 2δ min(x, 1 - x)
        u = torch.rand(n, generator=g, dtype=torch.float64)
        return torch.where(u <= (1 + 2 * delta) / 2, u / (1 + 2 * delta), (u - 2 * delta) / (1 - 2 * delta))

    delta, fails = DETECTABLE / math.sqrt(n), 0
    for _ in range(300):
        p = [ks_uniform(departed(delta))[1]]
        verdict = decide(p, 0) or decide(p + [ks_uniform(departed(delta))[1]], 0)
        fails += verdict == "FAIL"
    assert fails / 300 >= POWER


def test_a_subtly_wrong_residual_fails_on_the_p_value_alone(monkeypatch):
    from specdec.decoding import verify

    def residual_without_max(target_probs, draft_probs):  # |target - draft| normalised: wrong
        diff = (target_probs - draft_probs).abs()
        return diff / diff.sum(-1, keepdim=True)

    plain = SamplingConfig(temperature=1.0)  # no top-k / top-p: every token is possible, only the PIT can tell
    proposer = DraftModelProposer(model=DRAFT)
    assert check(TARGET, proposer, PROMPTS, plain, k=3, sequences=96, max_new_tokens=24).passed
    monkeypatch.setattr(verify, "residual", residual_without_max)
    result = check(TARGET, proposer, PROMPTS, plain, k=3, sequences=96, max_new_tokens=24)
    print("\n" + result.verdict())
    runs = result.sampled["runs"]
    assert result.sampled["impossible_tokens"] == 0 and not result.passed
    assert len(runs) == 2 and runs[0]["p_value"] < FIRST_LEVEL and runs[1]["p_value"] < SECOND_LEVEL  # both decided
    assert runs[0]["ks_statistic"] != runs[1]["ks_statistic"]  # two independent samples
