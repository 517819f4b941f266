"""adaptive.py and k="auto": the controller picks what its cost model says pays (plain decoding
when drafts are rejected and verification is expensive, deep drafts when they are accepted and
it is cheap), probes deeper options, says what it chose and why; the engine with k="auto" stays
lossless (greedy token for token, sampling in distribution)."""
from __future__ import annotations

import pytest
import torch

from specdec.decoding import adaptive, calibration
from specdec.decoding.adaptive import MAX_STRETCH, Adaptive
from specdec.decoding.costmodel import VerifyCurve
from specdec.decoding.engine import speculative_generate
from specdec.decoding.reference import reference_generate
from specdec.decoding.sampling import SamplingConfig
from specdec.decoding.stopping import StopRule
from specdec.lm.interface import admit
from specdec.proposers import DraftModelProposer, MTPProposer, NgramProposer

from .spec_helpers import NEAR_TIE, greedy_divergence, noisy_copy, tiny_llama
from .test_engine_sampling import DRAFT, PROMPT, SETTINGS, TARGET, N, distribution_test, exact_joint, passes
from .test_tree import tiny_heads

STEEP = VerifyCurve({n: 1e-3 * n for n in range(1, 20)})   # every token costs a full forward
FLAT = VerifyCurve({n: 1e-3 * (1 + 0.01 * n) for n in range(1, 20)})


@pytest.fixture(autouse=True)
def private_curve_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(calibration, "_cache_dir", lambda: tmp_path / "curves")


def run_controller(curve: VerifyCurve, accept: bool, steps: int = 40, shapes=None, level: float = 3e-4) -> Adaptive:
    """Feed the controller `steps` steps at batch 2 in which every draft is accepted (or none);
    drafting costs `level` seconds per level."""
    controller = Adaptive(curve, 2, shapes or {"chain": (1,) * 6})
    while controller.steps < steps:
        depth, _, stretch = controller.choose()
        if depth == 0:
            controller.observe_plain(stretch, stretch * 1.05e-3, stretch * 1e-3)
            continue
        accepted = [depth if accept else 0] * 2
        forward = curve.at(1 + depth)
        controller.observe([depth] * 2, accepted, 1 + depth, level * depth,
                           forward + level * depth + 1e-4, forward)
    return controller


def test_rejected_drafts_and_a_steep_curve_choose_plain_decoding():
    controller = run_controller(STEEP, accept=False, steps=300)
    assert controller.choices["plain"] >= 0.9 * controller.steps  # the rest: the first tries and the probes
    assert controller.summary()["predicted_speedup"]["chain:1"] < 1


def test_a_probe_that_costs_next_to_nothing_comes_after_every_plain_step():
    controller = run_controller(FLAT, accept=False, steps=60, level=1e-6)
    assert controller.choose()[2] == 1  # plain for one step at a time
    assert controller.choices["plain"] < 40


def test_accepted_drafts_and_a_flat_curve_choose_the_deepest_chain():
    controller = run_controller(FLAT, accept=True, level=1e-5)
    assert controller.chosen == (0, 6)
    assert controller.summary()["predicted_speedup"]["chain:6"] > 4


def test_probes_draft_one_level_and_back_off_while_plain_decoding_wins():
    controller = run_controller(STEEP, accept=False, steps=8)
    stretches, probes = [], []
    for _ in range(12):
        depth, widths, steps = controller.choose()
        if depth == 0:
            stretches.append(steps)
            controller.observe_plain(steps, steps * 1.05e-3, steps * 1e-3)
        else:
            probes.append((depth, widths))
            controller.observe([depth] * 2, [0, 0], 1 + depth, 3e-4, 2.4e-3, 2e-3)
    assert probes and all(p == (1, (1,)) for p in probes)
    assert stretches[1:] == sorted(stretches[1:]) and max(stretches) == MAX_STRETCH


def test_accepted_probes_bring_drafting_back():
    controller = run_controller(FLAT, accept=False, steps=100)
    for _ in range(40):  # the text turns predictable: every draft is accepted from now on
        depth, _, steps = controller.choose()
        if depth == 0:
            controller.observe_plain(steps, steps * 1.05e-3, steps * 1e-3)
        else:
            controller.observe([depth] * 2, [depth] * 2, 1 + depth, 3e-4 * depth,
                               1.1e-3 + 3e-4 * depth, 1e-3)
    assert controller.chosen[1] > 1


def test_a_tree_is_chosen_where_its_alternatives_are_accepted():
    controller = Adaptive(FLAT, 1, {"chain": (1, 1), "tree": (3, 3)})
    for _ in range(30):
        depth, widths, _ = controller.choose()
        tree = max(widths, default=1) > 1
        controller.observe([depth], [depth if tree else 0], 1 + sum(widths), 1e-5, 1.1e-3, 1e-3)
    assert controller.names[controller.chosen[0]] == "tree"


def test_rows_joining_start_from_what_earlier_rows_taught():
    controller = run_controller(FLAT, accept=True)
    controller.memory, controller.memory_key = {}, "key"
    controller.remember()
    fresh = Adaptive(FLAT, 0, {"chain": (1,) * 6})
    fresh.recall(controller.memory["key"])
    fresh.join(3)
    assert fresh.accepted.shape == (1, 3, 6) and (fresh.accepted / fresh.offered > 0.9).all()
    assert fresh.choose()[0] > 1  # it drafts at once, where a fresh controller would explore first
    fresh.leave([2])
    assert fresh.accepted.shape == (1, 1, 6)


def test_the_stored_curve_is_measured_once_and_never_decreases():
    model = admit(tiny_llama(0))
    curve, measured = calibration.cached_verify_curve(model, 2, 6, repeats=1)
    again, measured_again = calibration.cached_verify_curve(model, 2, 6)
    assert measured and not measured_again and again.seconds == curve.seconds
    times = [curve.seconds[n] for n in sorted(curve.seconds)]
    assert times == sorted(times) and max(curve.seconds) >= 6


def proposers(target):
    return {"draft-model": lambda: DraftModelProposer(model=noisy_copy(target, 0.05, seed=1)),
            "mtp": lambda: MTPProposer(heads=tiny_heads(target, "mtp-sequential", 3), target=target),
            "ngram": lambda: NgramProposer()}


@pytest.mark.parametrize("name", ["draft-model", "mtp", "ngram"])
@pytest.mark.parametrize("batch", [1, 4])
def test_auto_greedy_equals_plain_decoding(name, batch):
    target = tiny_llama(0)
    prompts = [[3, 9, 4, 3, 9], [5, 1, 2, 7, 1, 2, 7], [8], [4, 4, 4, 4]][:batch]
    rule = StopRule(max_new_tokens=30)
    rows, metrics = speculative_generate(target, proposers(target)[name](), prompts, rule, SamplingConfig(), "auto")
    for prompt, row in zip(prompts, rows):
        expected = reference_generate(target, prompt, rule, SamplingConfig()).tokens
        gap = greedy_divergence(target, prompt, row.tokens, expected)
        assert gap is None or gap < NEAR_TIE
    summary = metrics.adaptive
    assert sum(summary["choices"].values()) == metrics.steps
    assert "plain" in summary["predicted_speedup"]


def test_auto_with_a_proposer_that_drafts_no_trees_says_it_uses_chains():
    class ChainsOnly:
        def __init__(self, inner):
            self.inner, self.name, self.vocab_size = inner, "chains-only", inner.vocab_size
            self.trees, self.max_depth = False, None

        def start(self, *args, **kwargs):
            return self.inner.start(*args, **kwargs)

        def join(self, *args):
            self.inner.join(*args)

        def leave(self, *args):
            self.inner.leave(*args)

        def propose(self, state, limits, widths, draws):
            return self.inner.propose(state, limits, (1,) * len(widths), draws)

        def observe(self, state, outcome):
            self.inner.observe(state, outcome)

    target = tiny_llama(0)
    _, metrics = speculative_generate(target, ChainsOnly(NgramProposer()), [[1, 2, 1, 2]],
                                      StopRule(max_new_tokens=8), SamplingConfig(), "auto")
    assert "chains only" in metrics.adaptive["note"] and list(metrics.adaptive["shapes"]) == ["chain"]


def test_auto_sampling_matches_the_target_distribution(monkeypatch):
    # a batch of N rows: a made-up curve instead of timing forwards of N rows (only the choices depend on it)
    monkeypatch.setattr(adaptive, "cached_verify_curve", lambda model, batch, tokens: (
        VerifyCurve({n: 1e-3 * (1 + 0.2 * n) for n in range(1, tokens + 1)}, batch), False))
    rule = StopRule(max_new_tokens=3)
    rows, metrics = speculative_generate(TARGET, DraftModelProposer(model=DRAFT), [PROMPT] * N, rule,
                                         SETTINGS["T=1"], "auto", torch.Generator().manual_seed(5))
    first3 = torch.tensor([row.tokens[:3] for row in rows])
    V = TARGET.config.vocab_size
    counts = torch.bincount(first3[:, 0] * V * V + first3[:, 1] * V + first3[:, 2], minlength=V ** 3).double()
    assert passes(distribution_test(counts, exact_joint(SETTINGS["T=1"])))
    assert metrics.accepted > 0.01 * N
