"""proposers/hybrid.py: suffix lookup where it finds a long match, a draft model or an EAGLE head elsewhere."""
from __future__ import annotations

import pytest
import torch

from specdec.decoding.engine import speculative_generate
from specdec.decoding.protocol import Outcome
from specdec.decoding.reference import reference_generate
from specdec.decoding.sampling import Draws, SamplingConfig
from specdec.decoding.stopping import StopRule
from specdec.proposers import DraftModelProposer, EagleProposer, SuffixProposer
from specdec.proposers.hybrid import HybridProposer

from ..spec_helpers import noisy_copy, tiny_llama
from .test_eagle import distilled
from ..decoding.test_engine import TARGET as EAGLE_TARGET  # the target test_eagle's head was distilled for

REPEATING = [5, 6, 7, 8, 9, 5, 6, 7]  # suffix lookup continues it with 8, 9, 5, ...
NOVEL = [11, 12, 13, 14, 15, 16]      # no token twice: lookup finds nothing


def hybrid(target=None) -> HybridProposer:
    target = target if target is not None else tiny_llama(0)
    return HybridProposer(SuffixProposer(shared_nodes=0), DraftModelProposer(noisy_copy(target, 0.05, seed=1)))


def eagle_hybrid() -> HybridProposer:
    return HybridProposer(SuffixProposer(shared_nodes=0, min_match=2), EagleProposer(distilled(), EAGLE_TARGET),
                          model_depth=2, name="eagle-hybrid")


def greedy_drafts(proposer, prompt: list[int], k: int) -> list[int]:
    """What `proposer` drafts first, k levels, for a fresh row of `prompt` (greedy)."""
    state = proposer.start(len(prompt) + 16, k, 1)
    proposer.join(state, [prompt], torch.zeros(1, 0, 1), [SamplingConfig()])
    proposal = proposer.propose(state, torch.tensor([k]), (1,) * k, Draws())
    return proposal.tokens[0, :int(proposal.lengths[0])].tolist()


def test_each_row_drafts_from_lookup_where_it_finds_a_continuation_else_from_the_draft_model():
    proposer = hybrid()
    state = proposer.start(32, 3, 2)
    proposer.join(state, [REPEATING, NOVEL], torch.zeros(2, 0, 1), [SamplingConfig()] * 2)
    proposal = proposer.propose(state, torch.tensor([3, 3]), (1, 1, 1), Draws())
    assert proposal.lengths.tolist() == [3, 3] and proposal.draft_probs is None
    assert proposal.tokens[0].tolist() == [8, 9, 5] == greedy_drafts(proposer.lookup, REPEATING, 3)
    assert proposal.tokens[1].tolist() == greedy_drafts(proposer.model, NOVEL, 3)
    assert greedy_drafts(proposer.lookup, NOVEL, 3) == []


def test_a_match_shorter_than_lookups_min_match_is_left_to_the_draft_model():
    short = [5, 6, 7, 1, 2, 6, 7]  # "6 7" seen before (then 1): a match of 2
    target = tiny_llama(0)
    proposer = HybridProposer(SuffixProposer(shared_nodes=0, min_match=3), DraftModelProposer(noisy_copy(target, 0.05,
                                                                                                          seed=1)))
    state = proposer.start(32, 3, 2)
    proposer.join(state, [REPEATING, short], torch.zeros(2, 0, 1), [SamplingConfig()] * 2)
    proposal = proposer.propose(state, torch.tensor([3, 3]), (1, 1, 1), Draws())
    assert proposal.tokens[0].tolist() == [8, 9, 5]  # "5 6 7": a match of 3
    assert proposal.tokens[1].tolist() == greedy_drafts(proposer.model, short, 3)
    assert greedy_drafts(SuffixProposer(shared_nodes=0), short, 3) == [1, 2]  # what min_match 1 would draft
    assert state.by_model == [False, True]


def test_the_draft_model_reads_the_tokens_of_the_steps_lookup_drafted():
    """A row lookup drafted for, whose step then committed tokens the draft model never saw (two
    accepted lookup drafts and a new token), is drafted by the model next exactly as a fresh row of
    the whole sequence: the model counted none of the accepted lookup drafts as in its cache."""
    proposer = hybrid()
    state = proposer.start(32, 3, 1)
    proposer.join(state, [REPEATING], torch.zeros(1, 0, 1), [SamplingConfig()])
    assert proposer.propose(state, torch.tensor([3]), (1, 1, 1), Draws()).tokens[0].tolist() == [8, 9, 5]
    proposer.observe(state, Outcome([2], [[8, 9, 40, 0]], [3], torch.zeros(1, 4, 1)))
    after = proposer.propose(state, torch.tensor([3]), (1, 1, 1), Draws()).tokens[0].tolist()
    assert after == greedy_drafts(proposer.model, REPEATING + [8, 9, 40], 3) != []


def test_a_row_the_draft_model_does_not_draft_for_leaves_the_window_as_narrow_as_the_drafting_rows_need():
    """A row lookup drafts for (the model's limit 0) may hold a long stretch the model has not read:
    the model's window holds the drafting rows' pending tokens alone (the row's stay pending, none
    computed), and when the model drafts for that row later its drafts are a fresh row's."""
    model = DraftModelProposer(noisy_copy(tiny_llama(0), 0.05, seed=1))
    long = [(7 * i) % 30 + 1 for i in range(40)]
    state = model.start(64, 3, 2)
    model.join(state, [NOVEL, long], torch.zeros(2, 0, 1), [SamplingConfig()] * 2)
    assert model.pending_window(state, [3, 0]) == [len(NOVEL), 0] and state.pending[1] == long
    state = model.start(64, 3, 2)
    model.join(state, [NOVEL, long], torch.zeros(2, 0, 1), [SamplingConfig()] * 2)
    first = model.propose(state, torch.tensor([3, 0]), (1, 1, 1), Draws())
    assert first.tokens[0, :3].tolist() == greedy_drafts(model, NOVEL, 3) and state.pending[1] == long
    model.observe(state, Outcome([0, 0], [[3, 0, 0, 0], [4, 0, 0, 0]], [1, 1], torch.zeros(2, 4, 1)))
    later = model.propose(state, torch.tensor([0, 3]), (1, 1, 1), Draws())
    assert later.tokens[1, :3].tolist() == greedy_drafts(model, long + [4], 3)


@pytest.mark.parametrize("model, k", [("draft-model", 2), ("draft-model", 4), ("draft-model", "auto"),
                                      ("eagle", 1), ("eagle", 4), ("eagle", "auto")])
def test_greedy_output_is_plain_decodings_at_batch_one_and_three(model, k):
    """Behind lookup, a draft model or an EAGLE head (the registry's hybrid and eagle-hybrid)."""
    target = EAGLE_TARGET
    prompts = [REPEATING, NOVEL, [3, 9, 4, 3, 9]]
    rule = StopRule(max_new_tokens=24)
    expected = [reference_generate(target, p, rule, SamplingConfig()).tokens for p in prompts]
    proposer = hybrid(target) if model == "draft-model" else eagle_hybrid()
    rows, metrics = speculative_generate(target, proposer, prompts, rule, SamplingConfig(), k)
    assert [r.tokens for r in rows] == expected
    assert [speculative_generate(target, proposer, [p], rule, SamplingConfig(), k)[0][0].tokens
            for p in prompts] == expected
    if k != "auto":
        assert metrics.proposed > 0


def test_sampled_rows_keep_each_drafts_distribution():
    """At T=1 a lookup row's drafts are one-hot, the model row's carry the model's distribution."""
    proposer = hybrid()
    state = proposer.start(32, 2, 2)
    proposer.join(state, [REPEATING, NOVEL], torch.zeros(2, 0, 1), [SamplingConfig(1.0)] * 2)
    proposal = proposer.propose(state, torch.tensor([2, 2]), (1, 1), Draws(torch.Generator().manual_seed(0)))
    probs = proposal.draft_probs
    assert probs is not None and probs.shape[:2] == (2, 2)
    assert torch.equal(probs[0], torch.nn.functional.one_hot(proposal.tokens[0], probs.shape[-1]).to(probs.dtype))
    assert torch.allclose(probs[1].sum(-1), torch.ones(2)) and bool((probs[1].max(-1).values < 1).all())


# ---- an EAGLE head behind lookup (the registry's eagle-hybrid) ----

def test_the_eagle_head_drafts_after_lookups_steps_from_the_targets_features():
    """Each step the head drafts (at most 2 levels), also after steps whose lookup drafts were
    accepted, it drafts what a fresh head drafts on the whole committed sequence with the target's
    features from one forward over it: the features of the tokens lookup's steps committed reached
    the head."""
    prompt = [1, 2, 3, 1, 2, 3, 1]  # the toy target continues it 27, 36, 20, 27, 27, 27, ..., 48, 42, 36, 36, ...
    proposer = eagle_hybrid()
    committed, drafted, steps = list(prompt), [], []  # steps: (the head drafted, drafts accepted)
    model_propose, hybrid_observe = proposer.model.propose, proposer.observe

    def propose(state, limits, widths, draws):
        proposal = model_propose(state, limits, widths, draws)
        if int(proposal.lengths[0]):
            drafted.append((list(committed), proposal.tokens[0, :int(proposal.lengths[0])].tolist()))
        return proposal

    def observe(state, outcome):
        if state.by_model:
            steps.append((state.by_model[0], outcome.accepted[0]))
        committed.extend(outcome.tokens[0][:outcome.counts[0]])
        hybrid_observe(state, outcome)

    proposer.model.propose, proposer.observe = propose, observe
    speculative_generate(EAGLE_TARGET, proposer, [prompt], StopRule(max_new_tokens=40), SamplingConfig(), 4)
    lookup_accepted = [i for i, (by_model, accepted) in enumerate(steps) if not by_model and accepted > 1]
    assert lookup_accepted and any(by_model for by_model, _ in steps[lookup_accepted[0]:])  # then the head drafted
    assert all(len(d) <= 2 for _, d in drafted)
    fresh = EagleProposer(proposer.model.head, EAGLE_TARGET)
    for sequence, drafts in drafted:
        full = EAGLE_TARGET(torch.tensor([sequence]), output_layers=fresh.features)
        features = torch.cat([full.layers[i] for i in fresh.features], -1)[:, :-1]
        state = fresh.start(len(sequence) + 8, 2, 1)
        fresh.join(state, [sequence], features, [SamplingConfig()])
        again = fresh.propose(state, torch.tensor([len(drafts)]), (1,) * len(drafts), Draws())
        assert again.tokens[0].tolist() == drafts, sequence
