"""engine.py as a step loop (continuous batching): requests that join a running batch between
steps, leave it when finished or cancelled, and carry their own sampling settings and seeds.

Greedy rows equal the reference whatever shares the batch (divergence only at a proven near-tie);
sampled rows in a batch mixed with greedy rows and other settings follow the target's distribution
under their own settings (the chi-square + TV test of test_engine_sampling.py), and the same test
fails when the engine mixes up the rows' settings; a request's draws come from its own generator.
"""
from __future__ import annotations

import pytest
import torch

from specdec.decoding import verify as verify_module
from specdec.decoding.engine import Engine, Request
from specdec.decoding.reference import reference_generate
from specdec.decoding.sampling import SamplingConfig, probabilities
from specdec.decoding.stopping import StopRule
from specdec.lm.interface import admit
from specdec.proposers import DraftModelProposer, NgramProposer, SelfDraftProposer

from . import test_engine_sampling as sampling_test
from ..spec_helpers import NEAR_TIE, greedy_divergence, noisy_copy, tiny_llama

TARGET = tiny_llama(0)  # vocab 64, context 64
GREEDY = SamplingConfig()
PROPOSERS = {
    "draft-model": lambda: DraftModelProposer(model=noisy_copy(TARGET, 0.02, seed=1)),
    "ngram": lambda: NgramProposer(),
    "self": lambda: SelfDraftProposer(target=TARGET),  # attends to the engine's own cache (its layers' shapes)
}
CASES = [([5], 20), ([1, 2, 3, 1, 2, 3, 1], 9), (list(range(7, 19)), 24), ([3, 3, 3, 3], 3), ([9, 8], 30),
         ([4, 4, 1], 1), ([2, 7, 2, 7, 2], 16), ([11], 12)]


def assert_greedy_matches(prompt: list[int], rule: StopRule, tokens: list[int]) -> None:
    expected = reference_generate(TARGET, prompt, rule, GREEDY).tokens
    gap = greedy_divergence(TARGET, prompt, tokens, expected)
    assert gap is None or gap < NEAR_TIE, f"prompt {prompt}: diverges from the reference where the top-2 gap is {gap}"


@pytest.mark.parametrize("name", PROPOSERS)
@pytest.mark.parametrize("k", [1, 3])
def test_requests_joining_and_leaving_a_running_batch_equal_the_reference(name, k):
    engine = Engine(admit(TARGET), PROPOSERS[name](), k, capacity=3, max_len=64)
    requests = [Request(p, StopRule(n)) for p, n in CASES]
    buffers = {engine.cache.pool.store.data_ptr()}
    for request in requests[:2]:
        engine.submit(request)
    engine.step()
    engine.step()
    for request in requests[2:]:  # more than the batch holds: they wait for rows to free up
        engine.submit(request)
    sizes = []
    while engine.busy:
        engine.step()
        sizes.append(len(engine.requests))
        buffers.add(engine.cache.pool.store.data_ptr())
    assert max(sizes) == 3 and engine.requests == [] and not engine.waiting
    assert len(buffers) == 1  # the cache is allocated once: rows are reused in place
    for request, (prompt, n) in zip(requests, CASES):
        assert request.row.done and len(request.row.tokens) == n
        assert_greedy_matches(prompt, StopRule(n), request.row.tokens)
    assert engine.metrics.emitted == sum(len(r.row.tokens) for r in requests)


def test_a_cancelled_request_leaves_at_the_next_step_and_the_others_are_unaffected():
    engine = Engine(admit(TARGET), PROPOSERS["draft-model"](), 3, capacity=4, max_len=64)
    seen: list[list[int]] = []
    requests = [Request(p, StopRule(n), on_tokens=lambda r, tokens, drafted: seen.append(tokens) if r is victim else None)
                for p, n in CASES[:4]]
    victim = requests[2]
    for request in requests:
        engine.submit(request)
    engine.step()
    victim.cancelled = True
    emitted = len(victim.row.tokens)
    engine.step()
    assert victim not in engine.requests and len(victim.row.tokens) == emitted and len(seen) == 1
    while engine.busy:
        engine.step()
    for request, (prompt, n) in zip(requests, CASES[:4]):
        if request is not victim:
            assert_greedy_matches(prompt, StopRule(n), request.row.tokens)


def test_a_request_draws_from_its_own_generator():
    """A seeded sampled row gives the same tokens alone and beside rows with other seeds."""
    def run(neighbour_seeds: list[int]) -> list[int]:
        engine = Engine(admit(TARGET), PROPOSERS["draft-model"](), 3, capacity=3, max_len=64)
        rule, hot = StopRule(20), SamplingConfig(temperature=1.0, seed=7)
        mine = Request([5, 6], rule, hot, hot.generator())
        engine.submit(mine)
        for seed in neighbour_seeds:
            other = SamplingConfig(temperature=0.8, top_k=10, seed=seed)
            engine.submit(Request([9, 1, 3], rule, other, other.generator()))
        while engine.busy:
            engine.step()
        return mine.row.tokens

    alone = run([])
    assert run([1]) == alone and run([2, 3]) == alone


# ---- mixed settings in one batch: each row's distribution is the target's under its own settings ----

SAMPLES = 30_000  # per sampled setting
MIXED = [sampling_test.SETTINGS["T=1"], sampling_test.SETTINGS["T=0.7,top-k=8,top-p=0.9"]]


def mixed_counts() -> tuple[list[torch.Tensor], list[Request]]:
    """One engine run: SAMPLES rows of each sampled setting and 50 greedy rows, interleaved."""
    V, prompt = sampling_test.V, sampling_test.PROMPT
    rule = StopRule(max_new_tokens=4)
    engine = Engine(admit(sampling_test.TARGET), sampling_test.PROPOSERS["draft-model"](), 3,
                    capacity=2 * SAMPLES + 50, max_len=len(prompt) + 4)
    generator = torch.Generator().manual_seed(99)
    sampled: list[list[Request]] = [[], []]
    greedy = []
    for i in range(2 * SAMPLES + 50):
        if i % (2 * SAMPLES // 50 + 1) == 0 and len(greedy) < 50:
            greedy.append(Request(prompt, rule))
            engine.submit(greedy[-1])
        else:
            which = i % 2 if len(sampled[i % 2]) < SAMPLES else 1 - i % 2
            sampled[which].append(Request(prompt, rule, MIXED[which], generator))
            engine.submit(sampled[which][-1])
    while engine.busy:
        engine.step()
    counts = []
    for rows in sampled:
        first3 = torch.tensor([r.row.tokens[:3] for r in rows])
        counts.append(torch.bincount(first3[:, 0] * V * V + first3[:, 1] * V + first3[:, 2], minlength=V ** 3).double())
    return counts, greedy


def test_mixed_settings_in_one_batch_keep_every_row_lossless():
    counts, greedy = mixed_counts()
    for sampling, c in zip(MIXED, counts):
        result = sampling_test.distribution_test(c, sampling_test.exact_joint(sampling))
        print(f"\nmixed batch, {sampling}: p={result[0]:.3g} TV={result[1]:.4f} (bound {result[2]:.4f})")
        assert c.sum() == SAMPLES and sampling_test.passes(result), result
    expected = reference_generate(sampling_test.TARGET, sampling_test.PROMPT, StopRule(4), GREEDY).tokens
    assert len(greedy) == 50 and all(r.row.tokens == expected for r in greedy)


def test_the_mixed_batch_test_fails_when_rows_get_another_rows_settings(monkeypatch):
    monkeypatch.setattr(verify_module, "row_probabilities", lambda logits, configs: probabilities(logits, configs[-1]))
    counts, _ = mixed_counts()
    results = [sampling_test.distribution_test(c, sampling_test.exact_joint(s)) for s, c in zip(MIXED, counts)]
    print(f"\nwrong: every row under the last row's settings: {results}")
    assert not all(sampling_test.passes(r) for r in results)
