"""proposers/: the n-gram lookup from tables of intent, the ragged-row helpers, the registry."""
from __future__ import annotations

import pytest
import torch

from specdec.decoding.protocol import Outcome
from specdec.decoding.sampling import Draws, SamplingConfig
from specdec.errors import SpecdecError
from specdec.proposers import (
    DRAFTERS,
    DraftModelOptions,
    DraftModelProposer,
    EagleProposer,
    NgramOptions,
    NgramProposer,
    ParallelDraftProposer,
    VocabOptions,
    build_drafter,
)

# history, max_n, min_n, limit, proposal
NGRAM_CASES = {
    "longest n-gram wins": ([1, 2, 3, 9, 2, 3, 7, 1, 2, 3], 3, 1, 3, [9, 2, 3]),
    "most recent occurrence": ([4, 5, 4, 6, 4], 3, 1, 2, [6, 4]),
    "falls back to shorter n": ([1, 2, 3, 4, 3], 3, 1, 2, [4, 3]),
    "min_n respected: no match": ([1, 2, 3, 4, 3], 3, 2, 2, []),
    "continuation cut at the history's end": ([7, 8, 7], 2, 1, 4, [8, 7]),
    "limit cuts the continuation": ([1, 2, 3, 4, 1], 1, 1, 2, [2, 3]),
    "no repeat: nothing": ([1, 2, 3], 3, 1, 4, []),
    "one token: nothing": ([5], 3, 1, 4, []),
    "limit 0: nothing": ([1, 2, 1], 3, 1, 0, []),
}


def propose_one(history, max_n, min_n, limit):
    ngram = NgramProposer(max_n=max_n, min_n=min_n)
    state = ngram.start(len(history) + 8, 8, 1)
    ngram.join(state, [history], torch.zeros(1, 0, 1), [SamplingConfig()])
    proposal = ngram.propose(state, torch.tensor([limit]), (1,) * 8, Draws())
    assert proposal.draft_probs is None
    return proposal.tokens[0, :int(proposal.lengths[0])].tolist()


@pytest.mark.parametrize("case", NGRAM_CASES.values(), ids=NGRAM_CASES.keys())
def test_ngram_table(case):
    *args, expected = case
    assert propose_one(*args) == expected


def test_ngram_batch_equals_rows_one_by_one_and_observe_extends_history():
    cases = [c for c in NGRAM_CASES.values() if c[1:3] == (3, 1)]
    ngram = NgramProposer()
    histories = [c[0] for c in cases]
    state = ngram.start(20, 8, len(cases))
    ngram.join(state, histories, torch.zeros(len(cases), 0, 1), [SamplingConfig()] * len(cases))
    limits = torch.tensor([c[3] for c in cases])
    proposal = ngram.propose(state, limits, (1,) * 8, Draws())
    for b, case in enumerate(cases):
        assert proposal.tokens[b, :int(proposal.lengths[b])].tolist() == case[4]
    tokens = torch.tensor([[9, 9, 9]] * len(cases))
    counts = torch.arange(len(cases)) % 3
    ngram.observe(state, Outcome(counts.tolist(), tokens.tolist(), counts.tolist(), torch.zeros(len(cases), 3, 1)))
    for b, h in enumerate(histories):
        assert state.rows[b].tokens == h + [9] * int(counts[b])


def test_each_drafter_of_the_registry_makes_its_proposer_under_its_name():
    """Every drafter, built for the toy target (each has a shipped folder for it, or none to read)."""
    from specdec.api import TOY_TARGET, load
    target = load(TOY_TARGET)
    for name, entry in DRAFTERS.items():
        proposer = build_drafter(name, target)
        assert proposer.name == name and isinstance(proposer, entry.cls), name
    assert issubclass(DRAFTERS["ngram"].cls, NgramProposer)  # n-gram lookup that also walks a grammar
    hybrid = build_drafter("eagle-hybrid", target)
    assert (type(hybrid.model), hybrid.model_depth, hybrid.lookup.min_match) == (EagleProposer, 2, 3)
    assert hybrid.features == hybrid.model.features != ()  # the engine hands over the head's layers


@pytest.mark.parametrize("name, options", [("ngram", VocabOptions(8)), ("eagle", DraftModelOptions(8)),
                                           ("suffix", NgramOptions(3))])
def test_a_drafter_refuses_another_drafters_options(name, options):
    assert DRAFTERS[name].checked(None) == DRAFTERS[name].options()
    with pytest.raises(SpecdecError, match=f"the {name} drafter takes {DRAFTERS[name].options.__name__}"):
        DRAFTERS[name].checked(options)


def test_a_draft_model_with_a_draft_vocabulary_keeps_greedy_output_and_drafts_only_its_tokens():
    from specdec.decoding.engine import speculative_generate
    from specdec.decoding.reference import reference_generate
    from specdec.decoding.stopping import StopRule

    from ..spec_helpers import noisy_copy, tiny_llama
    target = tiny_llama(0)
    vocab = torch.randperm(64, generator=torch.Generator().manual_seed(0))[:24].sort().values  # any 24 ids
    counts = torch.zeros(64, dtype=torch.long).index_fill_(0, vocab, 9)
    proposer = DraftModelProposer(model=noisy_copy(target, 0.05, seed=1), draft_vocab=24,
                              token_counts=counts)
    assert torch.equal(proposer.draft_ids, vocab)
    prompts, rule = [[3, 9, 4], [5, 1, 2, 7, 1]], StopRule(max_new_tokens=20)
    rows, metrics = speculative_generate(target, proposer, prompts, rule, SamplingConfig(), 3)
    expected = [reference_generate(target, p, rule, SamplingConfig()).tokens for p in prompts]
    assert [r.tokens for r in rows] == expected
    # drafts are target ids of the draft vocabulary, and the draft's own choice over it at every position
    state = proposer.start(30, 3, 1)
    proposer.join(state, prompts[:1], torch.zeros(1, 2, 32), [SamplingConfig()])
    drafts = proposer.propose(state, torch.tensor([3]), (1, 1, 1), Draws()).tokens[0].tolist()
    assert all(d in vocab.tolist() for d in drafts)
    context = list(prompts[0])
    for d in drafts:
        logits = proposer.model(torch.tensor([context])).logits[0, -1]
        assert d == int(vocab[logits[vocab].argmax()])
        context.append(d)
    with pytest.raises(Exception, match="token counts"):
        DraftModelProposer(model=target, draft_vocab=24)


def catch_up_proposer(name: str):
    from ..spec_helpers import tiny_llama
    if name == "draft-model":  # over the target's 64 ids
        return DraftModelProposer(model=tiny_llama(1, vocab=64, context=512))
    return ParallelDraftProposer(model=tiny_llama(1, vocab=65, context=512), mask_token_id=64, block=3)


def test_a_draft_models_catch_up_pads_no_row(monkeypatch):
    """A request joining with a 150-token prompt beside three rows a token behind (a server's batch): the
    draft reads the prompt on that row alone and its drafting window pads none, so no forward holds more
    than one row's 64 columns (the catch-up padded for the others was 4 x 64 columns, three times over);
    and it drafts what a draft model told each row's whole sequence drafts."""
    from ..spec_helpers import tiny_llama
    proposer = DraftModelProposer(model=tiny_llama(1, vocab=64, context=512))
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 63, (5,), generator=g).tolist() for _ in range(3)]
    joining = torch.randint(0, 63, (150,), generator=g).tolist()
    state = proposer.start(240, 3, 4)
    proposer.join(state, prompts, torch.zeros(3, 0, 1), [SamplingConfig()] * 3)
    proposer.propose(state, torch.tensor([1, 1, 1]), (1,) * 3, Draws())
    emitted = torch.randint(0, 63, (3,), generator=g).tolist()
    proposer.observe(state, Outcome([0, 0, 0], [[t] for t in emitted], [1, 1, 1], torch.zeros(3, 2, 1)))
    proposer.join(state, [joining], torch.zeros(1, 0, 1), [SamplingConfig()])
    columns, forward = [], proposer.model.forward
    monkeypatch.setattr(proposer.model, "forward", lambda tokens, *a, **kw: (columns.append(tokens.numel()),
                                                                             forward(tokens, *a, **kw))[1])
    after = proposer.propose(state, torch.tensor([3, 3, 3, 3]), (1,) * 3, Draws())
    assert max(columns) <= 64 and sum(columns) < 150 + 4 * 4, columns
    fresh = proposer.start(240, 3, 4)
    proposer.join(fresh, [p + [t] for p, t in zip(prompts, emitted)] + [joining], torch.zeros(4, 0, 1),
                  [SamplingConfig()] * 4)
    assert after.tokens.tolist() == proposer.propose(fresh, torch.tensor([3, 3, 3, 3]), (1,) * 3, Draws()).tokens.tolist()


@pytest.mark.parametrize("name", ["draft-model", "parallel"])
def test_a_draft_model_catches_up_on_a_long_plain_stretch_completely(name):
    """A draft model told of 150 plain-decoded tokens at once (what k="auto" does after a stretch of
    plain steps) drafts what it drafts when the whole sequence is its prompt: it reads every pending
    token (base.catch_up, FEED at a time), the prompt included; none is dropped. Beside it a row
    deep into its sequence already: the catch-up window, padded for it, must not overflow its cache."""
    proposer = catch_up_proposer(name)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 63, (5,), generator=g).tolist(), torch.randint(0, 63, (180,), generator=g).tolist()]
    stretch = torch.randint(0, 63, (150,), generator=g).tolist()
    told = proposer.start(240, 3, 2)
    proposer.join(told, prompts, torch.zeros(2, 0, 1), [SamplingConfig()] * 2)
    proposer.propose(told, torch.tensor([1, 1]), (1,) * 3, Draws())  # both rows read their prompts
    proposer.observe(told, Outcome([0, 0], [stretch, stretch[:2] + [0] * 148], [150, 2], torch.zeros(2, 151, 1)))
    fresh = proposer.start(240, 3, 2)
    proposer.join(fresh, [prompts[0] + stretch, prompts[1] + stretch[:2]], torch.zeros(2, 0, 1), [SamplingConfig()] * 2)
    after = proposer.propose(told, torch.tensor([3, 3]), (1,) * 3, Draws())
    whole = proposer.propose(fresh, torch.tensor([3, 3]), (1,) * 3, Draws())
    assert after.tokens.tolist() == whole.tokens.tolist()
