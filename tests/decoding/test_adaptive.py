"""adaptive.py and k="auto": the controller picks what its cost model says pays (plain decoding
when drafts are rejected and verification is expensive, deep drafts when they are accepted and
it is cheap), probes deeper options, says what it chose and why; the engine with k="auto" stays
lossless (greedy token for token, sampling in distribution)."""
from __future__ import annotations

import math
import time

import numpy as np
import pytest
import torch

from specdec import kernels
from specdec.decoding import adaptive, calibration, engine
from specdec.decoding.adaptive import CHEAP, MAX_STRETCH, PROBE_EVERY, Adaptive
from specdec.decoding.costmodel import VerifyCurve
from specdec.decoding.protocol import Joining
from specdec.decoding.engine import speculative_generate
from specdec.decoding.reference import reference_generate
from specdec.decoding.sampling import SamplingConfig
from specdec.decoding.stopping import StopRule
from specdec.lm.interface import admit
from specdec.proposers import DraftModelProposer, MTPProposer, NgramProposer

from ..spec_helpers import NEAR_TIE, greedy_divergence, noisy_copy, tiny_llama
from .test_engine_sampling import DRAFT, PROMPT, SETTINGS, TARGET, N, distribution_test, exact_joint, passes
from .test_tree import tiny_heads


def joining(rows: int, prompt: int = 0) -> Joining:
    """Rows joining a controller, each with a prompt of `prompt` tokens (0: nothing to catch up on)."""
    return Joining([[0] * prompt] * rows, [SamplingConfig()] * rows, [None] * rows, [0] * rows)

STEEP = VerifyCurve({n: 1e-3 * n for n in range(1, 20)})   # every token costs a full forward
FLAT = VerifyCurve({n: 1e-3 * (1 + 0.01 * n) for n in range(1, 20)})


@pytest.fixture(autouse=True)
def private_curve_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(calibration, "cache_root", lambda: tmp_path / "curves")


def run_controller(curve: VerifyCurve, accept: bool, steps: int = 40, shapes=None, level: float = 3e-4,
                   controller: Adaptive | None = None, slower: float = 1.0, overhead: float = 1e-4,
                   spikes: int = 0, spike: float = 1.0) -> Adaptive:
    """Feed the controller steps at batch 2, up to `steps` in all, in which every draft is accepted
    (or none); drafting costs `level` seconds per level (the first `spikes` drafting steps `spike`
    times as much: a catch-up, a stolen time slice) and the engine `overhead` per drafting step,
    a plain step 1.05 ms (1 ms of it the forward, the curve's t(1)), a drafting step's forward
    `slower` times the curve's."""
    controller = controller or Adaptive(curve, 2, shapes or {"chain": (1,) * 6})
    while controller.steps < steps:
        depth, _, stretch = controller.choose()
        if depth == 0:
            plain = min(stretch, steps - controller.steps)  # a stretch without probes (inf) runs to the end
            controller.observe_plain(plain, plain * 1.05e-3, plain * 1e-3)
            continue
        accepted = [depth if accept else 0] * 2
        forward = curve.at(1 + depth) * slower
        draft = level * depth * (spike if spikes > 0 else 1)
        spikes -= 1
        controller.observe([depth] * 2, accepted, 1 + depth, draft, forward + draft + overhead, forward)
    return controller


def drafting_steps(controller: Adaptive) -> int:
    return controller.steps - controller.choices["plain"]


def test_rejected_drafts_and_a_steep_curve_choose_plain_decoding():
    controller = run_controller(STEEP, accept=False, steps=300)
    assert controller.choices["plain"] >= 0.9 * controller.steps  # the rest: the first tries and the probes
    assert controller.summary()["predicted_speedup"]["chain:1"] < 1


def test_a_probe_that_costs_next_to_nothing_comes_after_every_plain_step():
    controller = run_controller(FLAT, accept=False, steps=60, level=1e-6, overhead=5e-5)  # a plain step's
    assert controller.choose()[2] == 1  # plain for one step at a time
    assert controller.choices["plain"] < 40


def test_probes_after_every_plain_step_take_the_shape_that_pays_best():
    """Nearly free probes (one after every plain step) go to the depth-1 shape predicted to pay
    best, here the chain (a tree of 3 verifies 4 tokens for the same rejected drafts), not to every
    shape in turn."""
    controller = run_controller(FLAT, accept=False, steps=200, level=1e-6, overhead=5e-5,
                                shapes={"chain": (1,) * 3, "tree": (3, 1, 1)})
    probes = []
    for _ in range(40):
        depth, widths, steps = controller.choose()
        if depth == 0:
            controller.observe_plain(steps, steps * 1.05e-3, steps * 1e-3)
        else:
            probes.append(widths)
            controller.observe([depth], [0], 1 + sum(widths), 1e-6, FLAT.at(1 + sum(widths)) + 5e-5,
                               FLAT.at(1 + sum(widths)))
    assert probes.count((1,)) > 15 and probes.count((3,)) <= 2  # in turn: as many trees as chains


def test_accepted_drafts_and_a_flat_curve_choose_the_deepest_chain():
    controller = run_controller(FLAT, accept=True, level=1e-5)
    assert controller.chosen == (0, 6)
    assert controller.summary()["predicted_speedup"]["chain:6"] > 4


def test_probes_draft_one_level_and_back_off_while_plain_decoding_wins():
    # drafts at a tenth of a forward per level: rejected, they lose; accepted, they would pay
    controller = run_controller(FLAT, accept=False, steps=8, level=1e-4)
    stretches, probes = [], []
    for _ in range(16):
        depth, widths, steps = controller.choose()
        if depth == 0:
            stretches.append(steps)
            controller.observe_plain(steps, steps * 1.05e-3, steps * 1e-3)
        else:
            probes.append((depth, widths))
            controller.observe([depth] * 2, [0, 0], 1 + depth, 1e-4, 1.22e-3, 1.02e-3)
    assert probes and all(p == (1, (1,)) for p in probes)
    assert stretches[1:] == sorted(stretches[1:]) and max(stretches) >= MAX_STRETCH
    assert not controller.summary()["stopped_probing"]


def test_a_drafter_that_cannot_pay_even_when_always_accepted_is_not_probed_again():
    """Drafts that cost as much as the target's forward cannot pay on a steep verify curve whatever
    their acceptance: once that is known (the first steps), auto decodes plainly without a probe,
    not one every MAX_STRETCH steps."""
    controller = run_controller(STEEP, accept=False, steps=100, level=1e-3)
    learned = drafting_steps(controller)
    assert controller.choose()[2] == float("inf") and controller.summary()["stopped_probing"]
    run_controller(STEEP, accept=False, steps=20_000, level=1e-3, controller=controller)
    assert drafting_steps(controller) == learned <= 8


def test_probes_of_a_drafter_known_not_to_pay_thin_out_without_bound():
    """Drafts at 30% of a forward per level, always rejected: no acceptance the evidence allows
    would pay, so the stretches between probes keep doubling past MAX_STRETCH (a probe after as many
    steps as were decoded before it: a few dozen over 20000 steps, not one every MAX_STRETCH)."""
    controller = run_controller(FLAT, accept=False, steps=20_000, level=3e-4)
    assert not controller.summary()["stopped_probing"]
    assert controller.probes <= 20 and drafting_steps(controller) <= 30


def test_a_free_drafter_whose_first_draft_is_rejected_does_not_draft_deeper():
    """A lookup that costs nothing (n-gram) whose first drafts are rejected: the depths it never
    reaches are judged like the first, not by the optimistic prior, so it does not draft deep
    chains on the hope that later drafts would be accepted."""
    controller = run_controller(FLAT, accept=False, steps=400, level=1e-6)
    deep = sum(n for label, n in controller.choices.items() if label != "plain" and int(label.split(":")[1]) > 1)
    assert deep <= 0.05 * controller.steps


def test_probes_thin_out_and_still_find_drafts_that_turn_good():
    """A drafter whose drafts are rejected for 4000 steps costs ever fewer probes (exponential
    spacing: a handful over 4000 steps); when the text turns predictable, a probe finds it within as
    many steps as came before (the stretches at most double) and drafting resumes."""
    controller = run_controller(FLAT, accept=False, steps=4000, level=1e-4)
    assert drafting_steps(controller) <= 0.005 * controller.steps
    before = drafting_steps(controller)
    run_controller(FLAT, accept=True, steps=8000 + 2 * PROBE_EVERY, level=1e-4, controller=controller)
    assert drafting_steps(controller) - before > PROBE_EVERY and controller.chosen[1] > 1


def test_forwards_slowed_by_drafting_count_against_it():
    """The controller weighs the target's forward by what the run's forwards took against the
    verify curve: drafts accepted half the time pay on the curve, but not when every drafting
    step's forward takes twice the curve's time (a draft evicting the target's weights from the
    caches, a drafter's features, a busy machine)."""
    half = Adaptive(FLAT, 2, {"chain": (1,)})
    while half.steps < 200:
        depth, _, stretch = half.choose()
        if depth == 0:
            plain = min(stretch, 200 - half.steps)
            half.observe_plain(plain, plain * 1.05e-3, plain * 1e-3)
        else:
            half.observe([1, 1], [1, 0], 2, 1e-4, 2 * FLAT.at(2) + 2e-4, 2 * FLAT.at(2))
    assert half.choices["plain"] > 0.8 * half.steps
    assert run_controller(FLAT, accept=True, steps=60, level=1e-4, shapes={"chain": (1,)}).chosen[1] == 1


def test_a_probes_catch_up_does_not_count_as_drafting_cost():
    """A step after a plain stretch also feeds the proposer the stretch (its catch-up): once a depth
    has a cost measured away from such steps, a probe's seconds do not raise it."""
    controller = run_controller(FLAT, accept=True, steps=10, level=1e-4, shapes={"chain": (1,)})
    cost = controller.draft_estimates(2)[1]
    for _ in range(5):
        controller.observe_plain(64, 64 * 1.05e-3, 64 * 1e-3)
        controller.chosen = (0, 1)
        controller.observe([1, 1], [1, 1], 2, 50 * cost, 1.1e-3 + 50 * cost, 1.02e-3)
    assert controller.draft_estimates(2)[1] == pytest.approx(cost, rel=0.02)  # the plain steps rescale its unit


def test_the_runs_first_drafting_step_does_not_price_its_drafts_alone():
    """A draft model reads the prompts lazily, in its first proposal: that step's seconds (here 100
    times a draft's) leave the depth unmeasured, so auto drafts again and prices the draft by the
    steps that follow (priced at the first, drafts always accepted did not pay, and auto decoded
    plainly from then on: its probes after plain stretches do not re-price a measured depth)."""
    controller = run_controller(FLAT, accept=True, steps=60, level=1e-4, shapes={"chain": (1,)}, spikes=1, spike=100)
    assert controller.draft_estimates(2)[1] == pytest.approx(1e-4)
    assert drafting_steps(controller) > 30


def test_a_draft_priced_only_with_a_catch_up_is_drafted_again_and_never_stops_probing_on_it():
    """Drafts always accepted, each costing 0.3 of the target's forward, on a flat curve: they pay
    (chain:1 1.5x). A busy machine makes the first two drafting steps' seconds 10 times that (the
    prompts' read, then a stolen time slice): priced at them, not even drafts always accepted pay, and
    the controller used to stop probing for good (0 drafts from then on; a benchmark's next runs
    recalled it). Now a step with a catch-up is drafted again at once, its price taken alone, the
    plausible bounds take a depth's fewest seconds, and the probing stops only on prices from two
    steps without a catch-up: the next probe finds the true price."""
    controller = run_controller(FLAT, accept=True, steps=400, shapes={"chain": (1,) * 4}, spikes=2, spike=10)
    assert not controller.stopped and drafting_steps(controller) > 100


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
    fresh.join(joining(3))
    assert fresh.accepted.shape == (1, 3, 6) and (fresh.accepted / fresh.offered > 0.9).all()
    assert fresh.choose()[0] > 1  # it drafts at once, where a fresh controller would explore first
    fresh.leave([2])
    assert fresh.accepted.shape == (1, 1, 6)


def test_a_closed_batch_remembers_what_its_rows_taught_after_they_left():
    """A run ends when its last rows have left the batch: what they taught must outlive them (the
    remembered q was the prior's 0.7, as if nothing had been seen, so every run explored afresh)."""
    controller = run_controller(FLAT, accept=False, steps=100, level=3e-4)
    controller.leave([])
    controller.memory, controller.memory_key = {}, "key"
    controller.remember()
    fresh = Adaptive(FLAT, 0, {"chain": (1,) * 6})
    fresh.recall(controller.memory["key"])
    assert fresh.taught[1].max() <= adaptive.REMEMBERED_WEIGHT  # an earlier run is soon outweighed
    fresh.join(joining(2))
    assert fresh.acceptance()[0, :, 0].max() < 0.25
    assert fresh.choose()[0] == 0  # plain from the start, no exploring on the prior's hope


def test_the_stored_curve_is_measured_once_and_never_decreases():
    admitted = admit(tiny_llama(0))
    curve, measured = calibration.cached_verify_curve(admitted, 2, 6, repeats=1)
    again, measured_again = calibration.cached_verify_curve(admitted, 2, 6)
    assert measured and not measured_again and again.seconds == curve.seconds
    times = [curve.seconds[n] for n in sorted(curve.seconds)]
    assert times == sorted(times) and max(curve.seconds) >= 6


def test_a_target_with_quantized_matrices_has_a_curve_of_its_own():
    """The stored curve is keyed by the target's backend, which names the formats its matrices are
    stored in: the same weights with one layer's matrices in Q8_0 (the unembedding unchanged) cost
    another forward, so k=auto never prices a quantized target by its bf16 curve."""
    plain, quantized = tiny_llama(0), tiny_llama(0)
    quantized.model.layers[0].mlp.gate_up_proj.store("q8_0")
    keys = [calibration._key(admit(m, role="target"), 1) for m in (plain, quantized)]
    assert keys[0] != keys[1]


def test_another_build_of_the_kernels_has_a_curve_of_its_own(monkeypatch):
    """A stored curve is keyed by the kernels' build (their sources, compiler, torch): a change to the
    kernels that makes a forward cheaper is measured anew, never priced by the old build's curve."""
    admitted = admit(tiny_llama(0), role="target")
    key = calibration._key(admitted, 1)
    monkeypatch.setattr(kernels, "build", lambda: "another build")
    assert calibration._key(admitted, 1) != key


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


class ChainsOnly:
    """A proposer that hands everything on to `inner` but drafts chains only (no trees)."""
    name = "chains-only"

    def __init__(self, inner):
        self.inner, self.vocab_size, self.trees, self.max_depth = inner, inner.vocab_size, False, None

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


def test_auto_with_a_proposer_that_drafts_no_trees_says_it_uses_chains():
    target = tiny_llama(0)
    _, metrics = speculative_generate(target, ChainsOnly(NgramProposer()), [[1, 2, 1, 2]],
                                      StopRule(max_new_tokens=8), SamplingConfig(), "auto")
    assert "chains only" in metrics.adaptive["note"] and list(metrics.adaptive["shapes"]) == ["chain"]


def test_auto_sampling_matches_the_target_distribution(monkeypatch):
    # a batch of N rows: a made-up curve instead of timing forwards of N rows (only the choices depend on it)
    monkeypatch.setattr(engine, "verify_curves", lambda model, batches, tokens, name: (
        {b: VerifyCurve({n: 1e-3 * (1 + 0.2 * n) for n in range(1, tokens + 1)}, b) for b in batches}, 0.0))
    rule = StopRule(max_new_tokens=3)
    proposer = DraftModelProposer(model=DRAFT)
    proposer.reading_size = 0  # the draft is the target's size, which could never pay: priced free, so it drafts
    rows, metrics = speculative_generate(TARGET, proposer, [PROMPT] * N, rule,
                                         SETTINGS["T=1"], "auto", torch.Generator().manual_seed(5))
    first3 = torch.tensor([row.tokens[:3] for row in rows])
    V = TARGET.config.vocab_size
    counts = torch.bincount(first3[:, 0] * V * V + first3[:, 1] * V + first3[:, 2], minlength=V ** 3).double()
    assert passes(distribution_test(counts, exact_joint(SETTINGS["T=1"])))
    assert metrics.accepted > 0.01 * N


class Counted(ChainsOnly):
    """A chains-only proposer that counts its proposals and sleeps `delay` seconds per level it
    drafts (a draft dearer than the target's forward: it can never pay)."""
    name = "counted"

    def __init__(self, inner, delay: float = 0.0):
        super().__init__(inner)
        self.delay, self.proposals = delay, 0

    def propose(self, state, limits, widths, draws):
        self.proposals += 1
        time.sleep(self.delay * int(limits.max()))
        return super().propose(state, limits, widths, draws)


def test_auto_asks_the_proposer_only_on_drafting_steps():
    """Plain steps call no proposer (a stretch is told to it once, at its end, with `observe`):
    with auto, the proposals are the drafting steps."""
    target = tiny_llama(0)
    proposer = Counted(DraftModelProposer(model=noisy_copy(target, 0.05, seed=1)))
    _, metrics = speculative_generate(target, proposer, [[3, 9, 4, 3, 9], [5, 1, 2]], StopRule(max_new_tokens=40),
                                      SamplingConfig(), "auto")
    assert proposer.proposals == metrics.steps - metrics.adaptive["choices"].get("plain", 0) > 0


def test_auto_stops_probing_a_draft_that_costs_more_than_the_target():
    """A draft that costs 200 ms per level beside a target forward of a fraction of that cannot pay
    with every draft accepted: after the first weighing, auto decodes plainly without probing
    (the old schedule probed after 16, 48, 112 and 240 plain steps). 200 ms, not 50: beside the
    suite's other worker a forward's seconds spike, and a 50 ms draft once looked as if it could pay."""
    target = tiny_llama(0, context=512)
    proposer = Counted(DraftModelProposer(model=noisy_copy(target, 0.05, seed=1)), delay=0.2)
    _, metrics = speculative_generate(target, proposer, [[3, 9, 4, 3, 9]], StopRule(max_new_tokens=300),
                                      SamplingConfig(), "auto")
    assert metrics.adaptive["stopped_probing"] and proposer.proposals <= 5


def test_the_engines_overhead_is_weighed_by_depth():
    """A sampled row's verification costs more the more tokens it verifies (its noise and
    probabilities per column): the overhead is kept per depth, an unmeasured depth taking the
    nearest measured one's, not one mean for every depth."""
    controller = Adaptive(FLAT, 1, {"chain": (1,) * 6})
    for depth, other in ((1, 1e-4), (4, 1e-3)):
        controller.chosen = (0, depth)
        controller.observe([depth], [0], 1 + depth, 1e-5, FLAT.at(1 + depth) + 1e-5 + other, FLAT.at(1 + depth))
    overhead = controller.overhead_estimates()
    assert overhead[0] == 0 and overhead[1] == pytest.approx(1e-4) and overhead[2] == pytest.approx(1e-4)
    assert overhead[4] == overhead[6] == pytest.approx(1e-3)


def test_a_run_that_knew_no_draft_could_pay_does_not_make_the_next_one_probe_early():
    """Rejected drafts on a flat curve: the controller ends its run knowing that no draft pays even at
    the plausible upper bound of its acceptance. The next run of the same proposer (its memory) does
    not probe after REMEMBERED_STRETCH steps, as it would after a run whose verdict was open: a probe
    there costs the proposer's catch-up on the whole stretch, which a 64-token run never earns back.
    A longer run still probes (a text turning predictable is found)."""
    proposer = NgramProposer()
    curves = {1: FLAT, 2: FLAT}
    first = Adaptive.for_run(curves, proposer, None)
    first.join(joining(2))
    run_controller(FLAT, accept=False, steps=400, controller=first)
    assert first.hopeless and not first.stopped  # every draft accepted would pay on this curve
    first.remember()
    second = Adaptive.for_run(curves, proposer, None)
    second.join(joining(2))
    run_controller(FLAT, accept=False, steps=64, controller=second)
    assert drafting_steps(second) == 0
    run_controller(FLAT, accept=False, steps=400, controller=second)
    assert drafting_steps(second) >= 1
    # the control: a run whose verdict was open (drafts accepted) starts the next one probing early
    other = NgramProposer()  # its own memory
    open_verdict = Adaptive.for_run(curves, other, None)
    open_verdict.join(joining(2))
    run_controller(FLAT, accept=False, steps=40, controller=open_verdict)
    open_verdict.verdict = (2, False)
    open_verdict.remember()
    after = Adaptive.for_run(curves, other, None)
    after.join(joining(2))
    run_controller(FLAT, accept=False, steps=64, controller=after)
    assert drafting_steps(after) >= 1


class ForwardsCounted:
    """A draft model's forwards, counted apart: those run while the proposer proposes (its catch-up
    included) and those run anywhere else (while the engine decodes plainly)."""

    def __init__(self, proposer):
        self.proposing, self.inside, self.outside = False, 0, 0
        model, forward = proposer.model, proposer.model.forward

        def counted(*args, **kwargs):
            if self.proposing:
                self.inside += 1
            else:
                self.outside += 1
            return forward(*args, **kwargs)
        model.forward = counted
        propose = proposer.propose

        def proposing(*args, **kwargs):
            self.proposing = True
            try:
                return propose(*args, **kwargs)
            finally:
                self.proposing = False
        proposer.propose = proposing


@pytest.mark.parametrize("delay", [0.0, 0.05])
def test_a_plain_stretch_runs_no_draft_forward(delay):
    """Under auto the draft model runs only when a step drafts: a plain stretch, its end (the proposer
    hears of it) and the run's end cost no draft forward; the stretch is read (catch-up) by the next
    drafting step. With a draft dearer than the target (delay: it can never pay) the controller stops
    after its first weighings and the draft model runs no forward for the rest of the 300 tokens."""
    target = tiny_llama(0, context=512)
    inner = DraftModelProposer(model=noisy_copy(target, 0.05, seed=1))
    forwards = ForwardsCounted(inner)
    proposer = Counted(inner, delay=delay)
    rows, metrics = speculative_generate(target, proposer, [[3, 9, 4, 3, 9], [5, 1, 2]], StopRule(max_new_tokens=300),
                                         SamplingConfig(), "auto")
    assert forwards.outside == 0 and metrics.adaptive["choices"].get("plain", 0) > 0
    assert proposer.proposals == metrics.steps - metrics.adaptive["choices"]["plain"]
    if delay:
        assert metrics.adaptive["stopped_probing"] and forwards.inside <= 5 * (1 + 8)  # the first weighings only
    rule = StopRule(max_new_tokens=300)
    for prompt, row in zip([[3, 9, 4, 3, 9], [5, 1, 2]], rows):
        expected = reference_generate(target, prompt, rule, SamplingConfig()).tokens
        gap = greedy_divergence(target, prompt, row.tokens, expected)
        assert gap is None or gap < NEAR_TIE


def curve(ratio: float) -> VerifyCurve:
    """A verify curve on which a window of n tokens costs 1 + ratio × (n - 1) plain forwards."""
    return VerifyCurve({n: 1e-3 * (1 + ratio * (n - 1)) for n in range(1, 20)})


def test_a_drafting_choice_made_on_the_prior_is_weighed_again_after_its_step():
    """At batch 8 a window of 2 tokens costs 1.5 plain forwards: the prior (q 0.7) says a draft pays,
    so the first step drafts, and the next two draft again to price the draft without the first
    step's read of the prompts (`confirm`); its drafts rejected, the next weighing chooses plain
    decoding (the choice used to hold for HOLD steps, and on: 4 drafting steps before the evidence
    was read)."""
    controller = Adaptive(curve(0.5), 8, {"chain": (1,)})
    drafted = 0
    for _ in range(6):
        depth, _, steps = controller.choose()
        if depth == 0:
            controller.observe_plain(1, 1.05e-3, 1e-3)
            continue
        drafted += 1
        controller.observe([1] * 8, [0] * 8, 2, 1e-5, 1.5e-3 + 6e-5, 1.5e-3)
    assert drafted == 3


def test_a_lucky_first_step_on_thin_evidence_does_not_hold_drafting():
    """Batch 8, a window of 2 tokens at 1.5 plain forwards: the first drafting step has 4 of 8 drafts
    accepted, every later one 1 of 8 (as suffix lookup on chat prompts). On that one step drafting
    looks to pay, but not at the plausible lower bounds of q, so the choice is weighed again after
    each step: 3 drafting steps in the first 16 (the first and two that price the draft without its
    read of the prompts), where the choice used to hold for HOLD steps (4)."""
    controller, drafted = Adaptive(curve(0.5), 8, {"chain": (1,)}), []
    while controller.steps < 16:
        depth, _, steps = controller.choose()
        if depth == 0:
            plain = min(steps, 16 - controller.steps)
            controller.observe_plain(plain, plain * 1.05e-3, plain * 1e-3)
        else:
            accepted = [1] * 4 + [0] * 4 if not drafted else [1] + [0] * 7
            drafted.append(controller.steps)
            controller.observe([1] * 8, accepted, 2, 1e-6, 1.5e-3 + 5e-5, 1.5e-3)
    assert drafted == [0, 1, 2]


def test_no_probe_comes_that_the_steps_left_in_a_closed_batch_cannot_repay():
    """Rejected drafts: probes come after stretches of 16, 32, ... plain steps. In a closed batch
    (horizon: its rows' largest budget) a probe comes only where as many steps are left as the
    stretch before it, so none falls in a run's last stretch; without a horizon (a server) they come."""
    def probes_at(horizon_of) -> list[int]:
        controller, at = Adaptive(curve(0.5), 2, {"chain": (1,)}), []
        while controller.steps < 120:
            depth, _, steps = controller.choose(horizon_of(controller.steps))
            if depth == 0:
                plain = min(steps, 120 - controller.steps)
                controller.observe_plain(plain, plain * 1.05e-3, plain * 1e-3)
            else:
                at.append(controller.steps)
                controller.observe([1, 1], [0, 0], 2, 1e-5, 1.5e-3 + 6e-5, 1.5e-3)
        return at
    served, closed = probes_at(lambda step: float("inf")), probes_at(lambda step: 120 - step)
    assert served[-1] > 60 and closed == [p for p in served if p <= 60] and len(closed) < len(served)


def test_a_tree_that_could_not_pay_with_every_draft_accepted_is_never_probed():
    """A window of n tokens costs 1 + 0.7 (n - 1) plain forwards and nothing is accepted: no option
    plausibly pays, and the insurance probes go to the chain (with every draft accepted, 4 tokens for
    3.1 forwards), never to the tree (3, 1, 1): 4 tokens at best for 4.5 forwards. Probes used to
    cycle through the shapes: as many trees as chains."""
    controller = Adaptive(curve(0.7), 2, {"chain": (1,) * 3, "tree": (3, 1, 1)})
    probes = []
    while controller.steps < 3000:
        depth, widths, steps = controller.choose()
        if depth == 0:
            plain = min(steps, 3000 - controller.steps)
            controller.observe_plain(plain, plain * 1.05e-3, plain * 1e-3)
        else:
            probes.append(widths)
            forward = curve(0.7).at(1 + sum(widths))
            controller.observe([depth] * 2, [0, 0], 1 + sum(widths), 1e-5, forward + 6e-5, forward)
    assert controller.hopeless and probes.count((1,)) >= 3 and not any(max(w) > 1 for w in probes)


def test_the_remembered_verdict_is_the_full_batchs_not_its_last_rows():
    """A closed batch whose drafts never pay at batch 2 ends with one row, priced on the batch-1 curve
    (flat: there a draft plausibly pays). The next run starts at batch 2 again: it must inherit the
    verdict of the full batch (no plausible gain: its first probe waits), not of the last row."""
    proposer = NgramProposer()
    first = Adaptive.for_run({1: FLAT, 2: curve(0.7)}, proposer, None)
    first.join(joining(2))
    run_controller(curve(0.7), accept=False, steps=400, controller=first)
    assert first.hopeless
    first.leave([0])
    first.choose()
    assert not first.hopeless  # the last row alone: a draft might pay on the flat curve
    first.remember()
    assert _remembered(proposer)["hopeless"]


def _remembered(proposer) -> dict:
    (learned,) = adaptive._MEMORY[proposer].values()
    return learned


def test_a_machine_slower_than_the_curve_does_not_make_an_unmeasured_draft_look_cheaper():
    """Plain steps whose forwards take 1.5 times the curve's (a busier machine than when the curve was
    measured) scale plain decoding's forward; before any drafting step, drafting's forwards are
    priced on the same scale, so the predicted speedup of a draft stays where the curve put it (it
    used to rise from 0.97 to 1.12 and draft on the prior's hope after the first plain stretch, a
    drafting step's own bookkeeping priced at nothing until measured: now a plain step's)."""
    controller = Adaptive(curve(0.75), 8, {"chain": (1,)})
    rates = controller.rates()
    before = rates[0, 1] / rates[0, 0]
    depth, _, steps = controller.choose()
    assert depth == 0 and before < 1
    controller.observe_plain(steps, steps * 1.55e-3, steps * 1.5e-3)
    rates = controller.rates()
    assert rates[0, 1] / rates[0, 0] == pytest.approx(before, rel=0.05)
    assert controller.choose()[0] == 1 and controller.stretch == 2 * PROBE_EVERY  # a probe, not a choice


def test_drafting_on_thin_evidence_after_a_plain_stretch_backs_off_like_a_probe():
    """Batch 8 on a curve where the prior's q (0.7) just pays: after a plain stretch the controller
    drafts on that hope. Its stretches still double as after a probe (they used to restart at
    PROBE_EVERY, so a break-even prior kept drafting every 16 steps)."""
    controller = Adaptive(curve(0.6), 8, {"chain": (1,)})
    controller.observe_plain(PROBE_EVERY, PROBE_EVERY * 1.05e-3, PROBE_EVERY * 1e-3)
    assert controller.choose()[0] == 1 and controller.stretch == 2 * PROBE_EVERY


def test_probes_wait_until_their_catch_up_is_a_small_share_of_the_stretch_and_the_estimate_repays_it():
    """A probe after a plain stretch pays the drafter's catch-up on what it has not read: the prompts
    (a run's first probe) and the stretch (EAGLE's layer over 8 rows of SmolLM2: 30 µs a token). At
    batch 8 on a curve where a token more costs half a forward, with drafts rejected, probes every
    16, 32, 64 ... steps cost 0.92-0.95x in 64-token runs, and one after 32 steps in every later run
    (its prompts' catch-up, about two plain steps). A probe waits until its catch-up, priced per
    token not read, is at most CHEAP of the stretch before it, in this run and the next; and once the
    catch-up is measured, a probe is made only where the estimated acceptance repays it (the plausible
    upper bound had every probe at 4 clients of the Qwen2.5-Coder pair pay for its 0.5B reading 500
    prompt tokens: hybrid serving 0.90x plain): with every draft rejected, none after the first."""
    curve = VerifyCurve({n: 1e-3 * (1 + 0.5 * (n - 1)) for n in range(1, 20)})
    per_token = 2.5e-6  # a catch-up of 20 µs a plain step: 1.9% of it

    def run(steps: int, proposer) -> tuple[Adaptive, list]:
        controller = Adaptive.for_run({8: curve}, proposer, None)
        controller.join(joining(8, prompt=100))
        probes = []  # (catch-up seconds, plain steps before it) of each probe after a stretch
        while controller.steps < steps:
            depth, _, stretch = controller.choose(horizon=steps - controller.steps)
            if depth == 0:
                plain = min(stretch, steps - controller.steps)
                controller.observe_plain(plain, plain * 1.05e-3, plain * 1e-3)
                continue
            catch_up = per_token * controller.unread.sum()
            if controller.plain_run:
                probes.append((catch_up, controller.plain_run))
            controller.observe([depth] * 8, [0] * 8, 1 + depth, 1e-4 + catch_up, curve.at(1 + depth) + 1e-4 + catch_up
                               + 5e-5, curve.at(1 + depth))
        controller.remember()
        return controller, probes

    first, probes = run(1000, NgramProposer())
    assert first.catch_up[0] == pytest.approx(per_token)
    [(cost, stretch)] = probes  # the one probe, after its catch-up became CHEAP of the stretch
    assert cost <= CHEAP * stretch * 1.05e-3
    proposer = NgramProposer()
    run(64, proposer)
    second, _ = run(64, proposer)  # the next 64-step run: its prompts' catch-up alone (2 ms) is CHEAP of 63 plain steps
    assert drafting_steps(second) == 0


def test_a_catch_up_is_priced_by_its_tokens():
    """The price of a token not read is the catch-ups' seconds over their tokens (older ones fading): a
    large catch-up weighs by its tokens. Priced as a running mean of each one's seconds per token, a
    client's small catch-ups (a few tokens in one forward, about a depth's own price: no excess) priced
    the 0.5B reading 500 prompt tokens at 4 clients at 0.7 ms a token, not the 1.8 it took."""
    controller = Adaptive(curve(0.5), 4, {"chain": (1,)})
    for _ in range(5):
        controller.price_catch_up(-1e-4, 3)  # a few tokens, a little under the depth's own price
    controller.price_catch_up(0.9, 500)      # the prompts of four rows that joined: 1.8 ms a token
    assert controller.catch_up_seconds() == pytest.approx(1.8e-3, rel=0.05)
    assert controller.catch_up[1] == 6


def test_drafting_resumes_only_where_it_repays_the_catch_up_on_what_the_drafter_has_not_read():
    """Batch 8, a window of 2 tokens at 1.5 plain forwards, 5 of 8 drafts accepted: drafting pays
    (1.1x). Resuming it after a plain stretch costs the drafter's catch-up on the stretch, measured
    here at 3 ms for 16 steps of 8 rows (23 µs a token). With 4 steps left, drafting resumes after 1
    plain step (a catch-up of 0.19 ms, which 4 steps of drafting save), not after 8 (1.5 ms: a batch
    whose rows thin out near its end resumed drafting for its last steps, a catch-up on the whole
    stretch each time); with 1,000 steps left it resumes."""
    def primed(stretch: int) -> Adaptive:
        controller = Adaptive(curve(0.5), 8, {"chain": (1,)})
        for step in range(8):
            controller.choose()
            controller.chosen = (0, 1)  # each step drafts; rows take turns: 5 of 8 drafts accepted
            accepted = [int((b + step) % 8 < 5) for b in range(8)]
            catch_up = 3e-3 if step == 7 else 0.0  # the last after a plain stretch
            controller.observe([1] * 8, accepted, 2, 1e-5 + catch_up, 1.5e-3 + 6e-5 + catch_up, 1.5e-3)
            if step == 6:
                controller.observe_plain(16, 16 * 1.05e-3, 16e-3)
        controller.observe_plain(stretch, stretch * 1.05e-3, stretch * 1e-3)
        assert controller.catch_up[0] * 16 * 8 == pytest.approx(3e-3)  # seconds per token not read
        assert controller.rates()[0, 1] > 1.05 * controller.rates()[0, 0]
        return controller

    assert primed(stretch=1).choose(horizon=4)[0] == 1
    assert primed(stretch=8).choose(horizon=4)[0] == 0
    assert primed(stretch=8).choose(horizon=1000)[0] == 1


def test_a_tree_step_teaches_the_chain_what_its_first_children_did():
    """A chain whose first three steps were rejected (the start of an answer a draft cannot guess), then a
    tree of the same drafter accepted through its first children at every step: the chain would have
    been accepted too, and learns it from the tree's steps (tree.chain_runs), so the controller goes back
    to the deeper chain. It used to keep the chain's three failures forever and stay at the tree of
    depth 1 (a 0.5B draft of a 1.5B target: 1.04x where a chain of 3 gave 1.4x)."""
    curve = VerifyCurve({n: 1e-3 * (1 + 0.03 * (n - 1)) for n in range(1, 20)})
    controller = Adaptive(curve, 1, {"chain": (1,) * 4, "tree": (3, 2, 1, 1)})
    chosen = []
    for step in range(40):
        depth, widths, _ = controller.choose()
        assert depth > 0
        tree = max(widths) > 1
        chosen.append("tree" if tree else "chain")
        accepted = 0 if step < 3 else depth  # the first three steps rejected, then every first child accepted
        controller.observe([depth], [accepted], 1 + sum(widths), 4e-4 * depth, 1.1e-3 + 4e-4 * depth, 1e-3,
                           [accepted] if tree else None)
    assert chosen[:3] == ["chain"] * 3 and "tree" in chosen[3:10]
    assert chosen[-10:] == ["chain"] * 10 and controller.chosen[1] >= 3


MILD = VerifyCurve({n: 8e-3 * (1 + 0.04 * (n - 1)) for n in range(1, 20)})  # SmolLM2's on 2 cores, about


def decode_stream(q: float | tuple[float, float, int], seed: int, steps: int = 2000, spike_at: int | None = None
                  ) -> tuple[float, float]:
    """Run the controller at batch 1 on a simulated stream: drafts accepted independently with chance q,
    or in regimes (good q, bad q, mean length in steps) that switch at random, plain steps or not; a
    plain step 8.2 ms (8 of them the forward, MILD's t(1)), a drafting step MILD's forward, 0.8 ms a
    level of drafting (an EAGLE head's) and 0.6 ms of the engine's; the drafting forward of step
    `spike_at` takes three times as long (a stolen time slice). Returns (share of plain steps, speedup
    over plain decoding)."""
    rng = np.random.default_rng(seed)
    controller = Adaptive(MILD, 1, {"chain": (1,) * 4})
    good, chance = True, q
    tokens = seconds = 0.0
    while controller.steps < steps:
        depth, _, stretch = controller.choose()
        if depth == 0:
            plain = min(stretch, steps - controller.steps)
            controller.observe_plain(plain, plain * 8.2e-3, plain * 8e-3)
            tokens, seconds = tokens + plain, seconds + plain * 8.2e-3
            if isinstance(q, tuple) and rng.random() < 1 - (1 - 1 / q[2]) ** plain:
                good = not good
            continue
        if isinstance(q, tuple):
            good = good != (rng.random() < 1 / q[2])
            chance = q[0] if good else q[1]
        accepted = 0
        while accepted < depth and rng.random() < chance:
            accepted += 1
        forward = MILD.at(1 + depth) * (3 if controller.steps == spike_at else 1)
        step = forward + 0.8e-3 * depth + 0.6e-3
        controller.observe([depth], [accepted], 1 + depth, 0.8e-3 * depth, step, forward)
        tokens, seconds = tokens + 1 + accepted, seconds + step
    return controller.choices["plain"] / controller.steps, tokens / seconds * 8.2e-3


def test_drafts_accepted_independently_are_drafted_through_the_dips_of_a_ten_step_estimate():
    """A draft accepted 40% of the time, each draft independently, pays 1.18x at k = 1 here. A row's
    estimate weighs about its last ten drafts, so it dips below the 19% that breaks even now and then:
    plain decoding for a stretch, and after it the row's acceptance drifts back to what all its drafts
    taught (it kept the dip's low point, and each return to drafting doubled the next stretch: plain 57%
    of the steps, 1.08x). Five streams of 2,000 steps."""
    runs = [decode_stream(0.4, seed) for seed in range(5)]
    assert np.mean([plain for plain, _ in runs]) < 0.25
    assert np.mean([speedup for _, speedup in runs]) > 1.13


def test_drafts_accepted_in_bursts_are_drafted_in_the_bursts():
    """Drafts accepted 90% of the time in stretches of about 30 steps and never in the stretches between:
    auto drafts through the good ones and decodes plainly in the bad (1.63x; it was 1.50x, plain 58% of
    the steps where half of them could have drafted), and no worse where nothing pays."""
    runs = [decode_stream((0.9, 0.0, 30), seed) for seed in range(5)]
    assert np.mean([speedup for _, speedup in runs]) > 1.6
    assert all(plain > 0.98 and speedup > 0.99 for plain, speedup in (decode_stream(0.0, seed) for seed in range(3)))


def test_one_slow_forward_does_not_price_drafting_out():
    """One drafting step whose forward took three times the curve's (a stolen time slice) among steps
    that took the curve's own: the forwards' scale is the median of the latest steps, not a running mean
    that the spike moved by 40% (drafting accepted 40% of the time then looked dearer than plain decoding,
    and plain steps do not re-price drafting's forwards: on SmolLM2's chat, EAGLE decoded plainly for the
    rest of a benchmark after one 23 ms forward)."""
    for seed in range(3):
        calm, _ = decode_stream(0.4, seed, steps=400)
        spiked, _ = decode_stream(0.4, seed, steps=400, spike_at=40)
        assert spiked < calm + 0.05


def test_an_open_batch_pays_a_catch_up_only_where_the_rows_in_hand_repay_it():
    """A server's batch has no end (horizon math.inf), but its rows do: the drafter's catch-up on their
    prompts serves them alone, so drafting starts only where their remaining budgets repay it (at 16
    clients a draft model's read of every prompt, paid on an unbounded horizon, lost to plain decoding:
    docs/serving.md)."""
    def first_depth(budget: float) -> int:
        controller = Adaptive(FLAT, 0, {"chain": (1,) * 4})
        controller.join(joining(8, prompt=500))
        controller.price_catch_up(1e-4, 1)  # 0.1 ms a token: 0.4 s for the prompts
        return controller.choose(math.inf, 8 * budget)[0]  # the tokens 8 rows may still emit

    assert first_depth(math.inf) > 0  # unbounded rows would repay anything
    assert first_depth(4) == 0        # four steps left cannot repay 0.4 s
    assert first_depth(100_000) > 0


def test_a_catch_up_is_repaid_by_the_tokens_the_rows_may_still_emit():
    """Two rows joined, one with 50 tokens of its budget left and one with 2: a catch-up on their
    prompts worth what drafting saves over 75 tokens is repaid where they may still emit 100 tokens,
    but not by the 52 they may (counted as the rows times the largest budget, they were 100: at 4
    HumanEval clients of the Qwen2.5-Coder pair, catch-ups of 225-351 tokens, 0.3-0.7 s, were judged
    repaid by 2 rows x 50 tokens)."""
    def first_depth(tokens: float) -> int:
        controller = Adaptive(FLAT, 0, {"chain": (1,) * 4})
        controller.join(joining(2, prompt=100))
        rates = controller.rates()
        saved = 1 / rates[0, 0] - 1 / rates.max()  # seconds a token drafting saves
        controller.price_catch_up(75 * saved, 200)  # reading the 200 prompt tokens costs 75 tokens' savings
        return controller.choose(math.inf, tokens)[0]

    assert first_depth(50 + 50) > 0
    assert first_depth(50 + 2) == 0


def test_rows_that_join_drop_a_pending_confirmation():
    """A draft priced only with a catch-up is drafted again at once to price it alone (`confirm`), but
    not once rows have joined: their prompts make that step a catch-up again, so whether it repays is
    weighed like any other choice. (Served, the Qwen2.5-Coder pair's hybrid probed while a chat wave's
    first client was alone for a step, the other seven joined, and the confirming step read their 261
    prompt tokens at 8 rows: 0.6 s, about ten plain steps.)"""
    one = VerifyCurve({n: 40e-3 * (1 + 0.05 * (n - 1)) for n in range(1, 20)}, 1)    # a token's forward at one row
    eight = VerifyCurve({n: 60e-3 * (1 + 0.6 * (n - 1)) for n in range(1, 20)}, 8)  # nearly compute-bound at 8
    controller = Adaptive({1: one, 8: eight}, 0, {"chain": (1,)})
    controller.join(joining(1, prompt=36))
    controller.price_catch_up(0.9, 500)  # 1.8 ms a token
    assert controller.choose(math.inf, 96)[0] == 1  # the prior repays a 36-token catch-up at one row
    controller.observe([1], [1], 2, 1e-3 + 36 * 1.8e-3, 42e-3 + 1e-3 + 36 * 1.8e-3, 42e-3)
    assert controller.confirm == (0, 1)
    controller.join(joining(7, prompt=100))
    assert controller.choose(math.inf, 8 * 96)[0] == 0  # 700 tokens to read at 8 rows: 1.3 s, more than it saves


def test_a_drafts_price_is_a_share_of_a_plain_step_at_the_batch_in_hand():
    """A draft model's forward grows with the batch as the target's does, so what a level cost is kept
    as a share of a plain step's forward at its batch. Drafting priced at one row (a level at half a
    plain step, every draft accepted: it pays on a flat one-row curve) is priced anew when four rows are
    in hand, on a curve where a window's second token costs 0.6 of a plain step: there plain decoding
    wins even with every draft accepted, from the first step after the join (a choice held for the one
    row is weighed again). Priced at its one-row seconds, it drafted on at four rows (the Qwen2.5-Coder
    pair's hybrid served 4 clients at 0.73x its plain serving after a wave at 1 client)."""
    one = VerifyCurve({n: 1e-3 * (1 + 0.05 * (n - 1)) for n in range(1, 20)}, 1)
    four = VerifyCurve({n: 2e-3 * (1 + 0.6 * (n - 1)) for n in range(1, 20)}, 4)
    controller = Adaptive({1: one, 4: four}, 0, {"chain": (1,) * 4})
    controller.join(joining(1))
    while controller.steps < 30:
        depth, _, stretch = controller.choose()
        if depth == 0:
            plain = min(stretch, 30 - controller.steps)
            controller.observe_plain(plain, plain * 1e-3, plain * 1e-3)
            continue
        forward, draft = one.at(1 + depth), 0.5e-3 * depth
        controller.observe([depth], [depth], 1 + depth, draft, forward + draft, forward)
    assert drafting_steps(controller) >= 25
    controller.join(joining(3))
    assert controller.draft_estimates(4)[2] == pytest.approx(2 * controller.draft_estimates(1)[2])  # t_4(1) = 2 t_1(1)
    assert [controller.choose()[0] for _ in range(3)] == [0, 0, 0]
