"""The cost model against hand-computed cases: the α = 0 and α = 1 limits, the closed form of
E, the verify-curve arithmetic, the batch effect, the MoE expert-activation estimate, and the
`specdec simulate` command."""
from __future__ import annotations

import pytest

from specdec.cli import main
from specdec.decoding.calibration import read_curve_file, write_curve_file
from specdec.decoding.costmodel import (
    VerifyCurve,
    break_even_alpha,
    expected_tokens,
    expected_tokens_iid,
    moe_curve,
    moe_distinct_experts,
    moe_verify_ratio,
    predicted_speedup,
    predictions,
    speedup_limit,
)
from specdec.errors import SpecdecError

FLAT = VerifyCurve({1: 0.01, 2: 0.01, 3: 0.01, 5: 0.01, 9: 0.01})      # n tokens cost as much as one
LINEAR = VerifyCurve({1: 0.01, 9: 0.09})                              # n tokens cost n times one


@pytest.mark.parametrize("alpha, k, expected", [
    (0.0, 4, 1.0),          # nothing accepted: only the recovered token
    (1.0, 4, 5.0),          # everything accepted: k drafts + the bonus token
    (0.5, 1, 1.5),
    (0.5, 2, 1.75),         # 1 + 0.5 + 0.25
    (0.8, 3, 1 + 0.8 + 0.64 + 0.512),
    (0.3, 0, 1.0),          # k = 0 is plain decoding
])
def test_expected_tokens_closed_form(alpha, k, expected):
    assert expected_tokens_iid(alpha, k) == pytest.approx(expected)
    assert expected_tokens([alpha] * k) == pytest.approx(expected)


def test_expected_tokens_per_position():
    assert expected_tokens([0.9, 0.5, 0.2]) == pytest.approx(1 + 0.9 + 0.45 + 0.09)
    assert expected_tokens([0.0, None]) == 1.0      # position 2 never reached: contributes nothing
    with pytest.raises(SpecdecError, match=r"\[0, 1\]"):
        expected_tokens([1.2])
    with pytest.raises(SpecdecError, match="probability"):
        expected_tokens_iid(-0.1, 2)


def test_verify_curve_interpolates_and_refuses_to_extrapolate():
    curve = VerifyCurve({1: 0.010, 3: 0.030, 5: 0.034})
    assert curve.at(2) == pytest.approx(0.020)
    assert curve.at(4) == pytest.approx(0.032)
    assert curve.relative() == pytest.approx({1: 1.0, 3: 3.0, 5: 3.4})
    with pytest.raises(SpecdecError, match="measure it up to"):
        curve.at(6)
    with pytest.raises(SpecdecError, match="1-token forward"):
        VerifyCurve({2: 0.01})


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_speedup_limits(k):
    # α = 1, free draft, flat curve: every step emits k + 1 tokens for the price of one
    assert predicted_speedup([1.0] * k, 0.0, FLAT) == pytest.approx(k + 1)
    # α = 1 but verification cost proportional to tokens: no gain at all
    assert predicted_speedup([1.0] * k, 0.0, LINEAR) == pytest.approx(1.0)
    # α = 0: one token per step, and the step costs more than plain decoding's
    assert predicted_speedup([0.0] * k, 0.002, FLAT) == pytest.approx(0.01 / 0.012)
    assert speedup_limit(k + 1, k, FLAT) == pytest.approx(k + 1)


def test_predicted_speedup_hand_case_with_draft_and_overhead():
    curve = VerifyCurve({1: 0.010, 2: 0.012})
    # E = 1.5; step = 2 ms draft + 12 ms verify + 1 ms overhead; plain step 10 ms
    assert predicted_speedup([0.5], 0.002, curve, 0.001) == pytest.approx(1.5 * 0.010 / 0.015)


def test_a_generation_s_prefill_pulls_the_speedup_towards_1():
    curve = VerifyCurve({1: 0.010, 2: 0.012})
    decode_only = predicted_speedup([0.5], 0.0, curve, 0.001)  # 1.5 x 10 ms / 13 ms
    # 5 ms of prefill per emitted token, the same for both: (10 + 5) / (13 / 1.5 + 5)
    whole = predicted_speedup([0.5], 0.0, curve, 0.001, prefill_seconds_per_token=0.005)
    assert decode_only == pytest.approx(1.5 * 0.010 / 0.013)
    assert whole == pytest.approx(0.015 / (0.013 / 1.5 + 0.005)) and 1 < whole < decode_only


def test_a_proposer_that_drafts_less_than_k_is_costed_by_what_it_drafts():
    curve = VerifyCurve({1: 0.010, 2: 0.012, 3: 0.014})
    # drafts position 1 half the time and always position 2 after it, each always accepted:
    # E = 1 + 0.5 + 0.5 = 2; one draft per step on average, so a step verifies 2 tokens (12 ms)
    assert predicted_speedup([1.0, 1.0], 0.0, curve, proposal_rate_per_position=[0.5, 1.0],
                             mean_drafts=1.0) == pytest.approx(2 * 0.010 / 0.012)
    # its ceiling with a free draft: τ = 2 over the 2 tokens verified, not over k + 1 = 3
    assert speedup_limit(2.0, 2, curve, mean_drafts=1.0) == pytest.approx(2 * 0.010 / 0.012)


def test_with_measured_proposal_rates_e_is_the_measured_tau():
    """On a real n-gram run (it drafts only what it finds), 1 + Σ Π p_j α_j telescopes to
    1 + accepted / steps: exactly τ when no stop cuts a run (here only max_new_tokens, which
    the engine's draft limits respect)."""
    from specdec.decoding.engine import speculative_generate
    from specdec.decoding.sampling import SamplingConfig
    from specdec.decoding.stopping import StopRule
    from specdec.proposers import NgramProposer

    from ..spec_helpers import tiny_llama
    prompts = [[1, 2, 3, 1, 2, 3, 1], [5, 6, 5, 6], list(range(7, 19))]
    _, m = speculative_generate(tiny_llama(0), NgramProposer(), prompts, StopRule(40), SamplingConfig(), 4)
    rates = m.proposal_rate_per_position
    assert min(rates) < 1 and m.proposed < 4 * m.row_steps  # n-gram lookup really drafted less than k
    reached = [a * p for a, p in zip(m.acceptance_per_position, rates)]
    assert expected_tokens(reached) == pytest.approx(m.mean_acceptance_length)
    assert expected_tokens(m.acceptance_per_position) > m.mean_acceptance_length  # what α_i alone would claim


def test_batch_effect_costs_b_rows_as_b_times_the_tokens():
    curve = VerifyCurve({1: 1.0, 2: 1.0, 4: 2.0, 6: 3.0, 16: 8.0})
    # batch 1, k=2: verify 3 tokens (interpolated 1.5) for E = 3 -> 2x
    assert predicted_speedup([1.0, 1.0], 0.0, curve) == pytest.approx(3 / 1.5)
    # batch 2: plain step = 2 tokens (1.0), spec step = 6 tokens (3.0): the same E = 3 gains nothing
    assert predicted_speedup([1.0, 1.0], 0.0, curve, batch_size=2) == pytest.approx(1.0)
    # a curve measured at the batch size itself is used as it is
    at_b4 = VerifyCurve({1: 1.0, 3: 2.0}, batch_size=4)
    assert predicted_speedup([1.0, 1.0], 0.0, at_b4, batch_size=4) == pytest.approx(1.5)
    with pytest.raises(SpecdecError, match="batch 4, not 2"):
        predicted_speedup([1.0], 0.0, at_b4, batch_size=2)
    with pytest.raises(SpecdecError, match="batch size must be >= 1"):
        predicted_speedup([1.0], 0.0, curve, batch_size=0)


def test_moe_expert_activation():
    assert moe_distinct_experts(8, 2, 0) == 0
    assert moe_distinct_experts(8, 2, 1) == pytest.approx(2)
    assert moe_distinct_experts(8, 2, 2) == pytest.approx(8 * (1 - 0.75 ** 2))   # 3.5
    assert moe_distinct_experts(8, 2, 200) == pytest.approx(8)                   # every expert
    assert moe_distinct_experts(1, 1, 5) == pytest.approx(1)                     # dense: one MLP
    # dense (no expert bytes): verifying more tokens reads no more weights
    assert moe_verify_ratio(16, 8, 2, 0.0) == 1.0
    assert moe_verify_ratio(1, 8, 2, 0.6) == pytest.approx(1.0)
    # all bytes in experts, many tokens: all 8 experts instead of 2 -> 4x the bytes
    assert moe_verify_ratio(200, 8, 2, 1.0) == pytest.approx(4.0)
    assert moe_verify_ratio(2, 8, 2, 0.5) == pytest.approx(0.5 + 0.5 * 3.5 / 2)
    curve = moe_curve(FLAT, 8, 2, 1.0)
    assert curve.seconds[1] == FLAT.seconds[1] and curve.seconds[9] > 3 * FLAT.seconds[9]
    with pytest.raises(SpecdecError, match="top_k"):
        moe_distinct_experts(4, 5, 1)


def test_break_even_alpha():
    assert break_even_alpha(4, 0.9) == 0.0          # cheaper than plain: any α pays
    assert break_even_alpha(2, 3.5) is None         # even α = 1 gives only 3 tokens
    alpha = break_even_alpha(3, 2.0)
    assert expected_tokens_iid(alpha, 3) == pytest.approx(2.0, abs=1e-9)


def test_simulate_command(capsys):
    code = main(["simulate", "--alpha", "1", "--ks", "2", "--verify-ms", "10", "10", "10"])
    out = capsys.readouterr().out
    assert code == 0
    assert "| 2 | 3.00 | 1.00 | 0.00 | 3.00x |" in out
    assert "predicted, not measured" in out and "batch 1" in out and "α = 1.0" in out
    code = main(["simulate", "--alpha", "0.5", "--alpha-per-position", "0.5", "--verify-ms", "10", "12"])
    assert code == 2 and "exactly one of --alpha" in capsys.readouterr().err


def test_predictions_of_a_chain():
    """A free draft on a flat curve: the speedup is E; break-even where E equals the verify ratio."""
    [p] = predictions([[1.0, 1.0]], 0.0, FLAT)
    assert (p.k, p.tokens_per_step, p.verify_ratio, p.speedup, p.limit) == (2, 3.0, 1.0, 3.0, 3.0)
    [p] = predictions([[0.5]], 0.5, LINEAR)
    assert p.draft_ratio == pytest.approx(0.5) and p.verify_ratio == pytest.approx(2.0)
    assert p.break_even is None  # a forward of 2 tokens costs 2, plus the draft: a chain of 1 never pays


def test_a_calibrated_curve_file_is_what_simulate_reads(tmp_path, capsys):
    path = tmp_path / "curve.json"
    write_curve_file(path, {1: {1: 0.01, 2: 0.011, 3: 0.012}}, "models/target", "cpu-kernels", {"device_used": "cpu"})
    curve, source = read_curve_file(path, 1)
    assert curve.seconds == {1: 0.01, 2: 0.011, 3: 0.012} and "target models/target" in source
    assert main(["simulate", "--alpha", "0.5", "--ks", "2", "--verify-curve", str(path)]) == 0
    assert "| 2 | 1.75 | 1.20 |" in capsys.readouterr().out
    assert main(["simulate", "--alpha", "0.5", "--ks", "2", "--verify-curve", str(path), "--batch-size", "4"]) == 2
    assert "batch sizes [1], not 4" in capsys.readouterr().err
