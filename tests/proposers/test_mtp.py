"""The MTP proposer (proposers/mtp.py) through the engine: token-identical to the reference under
greedy decoding for both head designs, every k up to the depth and batch 1 and 4; drafts that are
exactly what the heads compute in training (teacher forcing) after any number of steps and
rollbacks; the target's distribution under sampling (the engine's chi-square + TV test with
100,000 samples, which fails when drafts are not drawn from the reported draft_probs); clear errors."""
from __future__ import annotations

import copy
import functools

import pytest
import torch

from specdec.decoding.engine import speculative_generate
from specdec.decoding.reference import reference_generate
from specdec.decoding.sampling import SamplingConfig, probabilities
from specdec.decoding.stopping import StopRule
from specdec.errors import SpecdecError
from specdec.proposers import MTPProposer, base
from specdec.heads.mtp import MTP_KINDS, MTPHeads, build_mtp, teacher_forced
from specdec.train.losses import mtp_backward
from specdec.train.objectives import init_weights

from ..decoding import test_engine_sampling as sampling_test
from ..spec_helpers import own_continuations, tiny_llama
from ..decoding.test_engine import GREEDY, PROMPTS, RULE, TARGET, assert_matches_reference, reference

DEPTH = 3


@functools.cache
def distilled(kind: str, target=TARGET, depth: int = DEPTH, steps: int = 60) -> MTPHeads:
    """Heads trained briefly on the frozen target's own continuations (greedy and sampled), so
    that they agree with it often but not always: both acceptance and rejection get exercised."""
    data, g = own_continuations(target)  # (96, 32)
    V = target.config.vocab_size
    torch.manual_seed(1)
    heads = build_mtp(kind, target.config, depth)
    init_weights(heads)
    opt = torch.optim.AdamW(heads.parameters(), lr=1e-2)
    frozen = copy.deepcopy(target).requires_grad_(False)  # the heads share its weights: same as the target's
    for _ in range(steps):
        mtp_backward(frozen, heads, data[torch.randint(0, len(data), (16,), generator=g)], [1.0] * depth, 1.0,
                     train_trunk=False, memory_saving=True)
        opt.step()
        opt.zero_grad()
    heads.token_counts = torch.bincount(data.flatten(), minlength=V)  # as training records them
    return heads.eval()


def proposer(kind: str, target=TARGET, draft_vocab: int | None = None):
    return MTPProposer(heads=distilled(kind, target), target=target, draft_vocab=draft_vocab)


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("k", range(1, DEPTH + 1))
@pytest.mark.parametrize("kind", MTP_KINDS)
def test_greedy_output_equals_reference(kind, k, batch):
    groups = [PROMPTS] if batch == 4 else [[p] for p in PROMPTS]
    for group in groups:
        rows, metrics = speculative_generate(TARGET, proposer(kind), group, RULE, GREEDY, k)
        for prompt, row in zip(group, rows):
            assert_matches_reference(prompt, row.tokens)
        assert metrics.emitted == sum(len(r.tokens) for r in rows)
    if batch == 4:  # the distilled heads are neither useless nor perfect: both paths were taken
        assert 0 < metrics.accepted < metrics.proposed


@pytest.mark.parametrize("kind", MTP_KINDS)
def test_a_draft_vocabulary_keeps_greedy_output_and_drafts_only_its_tokens(kind):
    """Drafting over the 24 most frequent of 64 token ids: output still equals the reference; every
    draft is one of those ids, and some target tokens fall outside them (so drafts were lost)."""
    p = proposer(kind, draft_vocab=24)
    allowed = set(p.draft_ids.tolist())
    assert len(allowed) == 24 and allowed == set(distilled(kind).token_counts.topk(24).indices.tolist())
    recorder = Recorder(p)
    rows, metrics = speculative_generate(TARGET, recorder, PROMPTS, RULE, GREEDY, DEPTH)
    for prompt, row in zip(PROMPTS, rows):
        assert_matches_reference(prompt, row.tokens)
    drafted = {t for _, proposal in recorder.log for b in range(proposal.tokens.shape[0])
               for t in proposal.tokens[b, :proposal.lengths[b]].tolist()}
    assert drafted <= allowed and metrics.accepted > 0
    assert any(t not in allowed for row in rows for t in row.tokens)


def test_prompts_up_to_the_end_of_the_context():
    prompts = [[(7 * i) % 64 for i in range(60)], [(11 * i + 3) % 64 for i in range(58)], [1, 2], [9]]
    rule = StopRule(max_new_tokens=5)
    for kind in MTP_KINDS:
        rows, _ = speculative_generate(TARGET, proposer(kind), prompts, rule, GREEDY, DEPTH)
        for prompt, row in zip(prompts, rows):
            assert_matches_reference(prompt, row.tokens, rule)
            assert len(row.tokens) == 5


@pytest.mark.parametrize("kind", MTP_KINDS)
def test_eos_stop_strings_and_max_new_tokens_inside_accepted_runs(kind):
    """Every token of the reference output in turn is made the EOS token, then a stop string, and
    max_new_tokens runs below k: each row ends exactly where the reference ends, also when the
    stop falls inside a run of accepted drafts (counted: some drafts accepted past the stop)."""
    decode = lambda ids: "".join(chr(65 + i) for i in ids)  # noqa: E731 - one letter per token
    cut_inside_run = 0
    ref = reference(tuple(PROMPTS[2]))
    rules = [StopRule(24, eos_id=t) for t in ref[2:12]]
    rules += [StopRule(24, stop_strings=(decode(ref[j:j + 2]),), decode=decode) for j in range(2, 12)]
    rules += [StopRule(n) for n in (1, 2)]
    for rule in rules:
        rows, metrics = speculative_generate(TARGET, proposer(kind), PROMPTS, rule, GREEDY, DEPTH)
        for prompt, row in zip(PROMPTS, rows):
            expected = reference_generate(TARGET, prompt, rule, GREEDY)
            assert (row.tokens, row.finish_reason) == (expected.tokens, expected.finish_reason)
        cut_inside_run += metrics.accepted + metrics.row_steps > metrics.emitted
    assert cut_inside_run > 0


class Recorder:
    """Delegates to a proposer and remembers every proposal with the sequences it was made for."""

    def __init__(self, inner):
        self.inner, self.name, self.vocab_size = inner, inner.name, inner.vocab_size
        self.trees, self.max_depth, self.features = inner.trees, inner.max_depth, inner.features
        self.log = []

    def start(self, max_len, k, capacity, nodes=None):
        self.sequences = []
        return self.inner.start(max_len, k, capacity, nodes)

    def join(self, state, prompts, prompt_hidden, samplings):
        self.sequences += [list(p) for p in prompts]
        self.inner.join(state, prompts, prompt_hidden, samplings)

    def leave(self, state, keep):
        self.sequences = [self.sequences[b] for b in keep]
        self.inner.leave(state, keep)

    def propose(self, state, limits, widths, draws):
        proposal = self.inner.propose(state, limits, widths, draws)
        self.log.append(([list(s) for s in self.sequences], proposal))
        return proposal

    def observe(self, state, outcome):
        for b, seq in enumerate(self.sequences):
            seq.extend(outcome.tokens[b][:outcome.counts[b]])
        self.inner.observe(state, outcome)


@pytest.mark.parametrize("kind", MTP_KINDS)
def test_drafts_are_what_the_heads_compute_in_training(kind):
    """After every step and rollback, draft j's distribution equals head j's teacher-forced
    distribution at the last committed position, over the sequence followed by the drafts
    before it: the cached, incremental drafting computes exactly the training forward."""
    sampling = SamplingConfig(temperature=1.0)
    recorder = Recorder(proposer(kind))
    prompts = [PROMPTS[1], PROMPTS[2], [4, 9], [3, 3, 3, 3, 3, 3]]
    speculative_generate(TARGET, recorder, prompts, StopRule(20), sampling, DEPTH, torch.Generator().manual_seed(3))
    heads, checked = distilled(kind), 0
    for sequences, proposal in recorder.log:
        for b, seq in enumerate(sequences):
            n = int(proposal.lengths[b])
            if n == 0:
                continue
            window = torch.tensor([seq + proposal.tokens[b].tolist() + [0] * DEPTH])
            with torch.no_grad():
                hidden = TARGET(window[:, :-1]).hidden
                for j, out, _, _ in teacher_forced(heads, TARGET, hidden, window):
                    if j < n:
                        expected = probabilities(heads.logits(j, TARGET, out[:, len(seq) - 2]), sampling)[0]
                        torch.testing.assert_close(proposal.draft_probs[b, j], expected, atol=2e-5, rtol=1e-4)
                        checked += 1
    assert checked > 50


# ---- sampling: the engine's distribution test (tests/decoding/test_engine_sampling.py) ----

SAMPLING_TARGET = sampling_test.TARGET  # vocab 16
CONFIGS = [("mtp-sequential", "T=0.7,top-k=8,top-p=0.9", 3, None), ("mtp-parallel", "T=1", 2, None),
           ("mtp-sequential", "T=1", 2, 6)]  # the last drafts over 6 of the 16 token ids
SAMPLES = 100_000  # as in the engine's test


def counts_for(kind: str, setting: str, k: int, monkeypatch, draft_vocab: int | None = None):
    """The engine test's sampler with N = SAMPLES draws (its bounds are computed for any N)."""
    monkeypatch.setitem(sampling_test.PROPOSERS, kind, lambda: proposer(kind, SAMPLING_TARGET, draft_vocab))
    monkeypatch.setattr(sampling_test, "N", SAMPLES)
    return sampling_test.speculative_counts(kind, sampling_test.SETTINGS[setting], k)


@pytest.mark.parametrize("kind,setting,k,draft_vocab", CONFIGS)
def test_speculative_sampling_matches_the_target_distribution(kind, setting, k, draft_vocab, monkeypatch):
    counts, metrics = counts_for(kind, setting, k, monkeypatch, draft_vocab)
    result = sampling_test.distribution_test(counts, sampling_test.exact_joint(sampling_test.SETTINGS[setting]))
    print(f"\n{kind} {setting} k={k}: p={result[0]:.3g} TV={result[1]:.4f} (bound {result[2]:.4f}) "
          f"alpha={metrics.acceptance_rate:.3f} tau={metrics.mean_acceptance_length:.3f}")
    assert sampling_test.passes(result), result
    assert metrics.accepted > 0.1 * SAMPLES  # drafts were really accepted


def test_the_distribution_test_fails_when_drafts_are_not_drawn_from_draft_probs(monkeypatch):
    """A proposer bug, not a verifier bug: drafting the heads' argmax while reporting their
    distribution as draft_probs (greedy drafts are lossless only with one-hot draft_probs)."""
    monkeypatch.setattr(base, "sample", lambda probs, generator: probs.argmax(-1))  # where drafts are drawn
    kind, setting, k, _ = CONFIGS[0]
    counts, _ = counts_for(kind, setting, k, monkeypatch)
    result = sampling_test.distribution_test(counts, sampling_test.exact_joint(sampling_test.SETTINGS[setting]))
    print(f"\nwrong drafts: p={result[0]:.3g} TV={result[1]:.4f} (bound {result[2]:.4f})")
    assert not sampling_test.passes(result), result


# ---- errors ----

def test_k_beyond_the_heads_is_refused_and_heads_must_fit():
    with pytest.raises(SpecdecError, match=f"at most {DEPTH} tokens per step .* use k <= {DEPTH}"):
        speculative_generate(TARGET, proposer("mtp-sequential"), PROMPTS, RULE, GREEDY, DEPTH + 1)
    with pytest.raises(SpecdecError, match="built for another model"):
        MTPProposer(heads=distilled("mtp-parallel"), target=tiny_llama(0, hidden=64))
    with pytest.raises(SpecdecError, match="specdec's own LlamaForCausalLM"):
        MTPProposer(heads=distilled("mtp-parallel"), target=torch.nn.Linear(4, 4))
    with pytest.raises(SpecdecError, match="draft_vocab must be >= 1"):
        proposer("mtp-parallel", draft_vocab=0)
    uncounted = build_mtp("mtp-parallel", TARGET.config, 1)
    with pytest.raises(SpecdecError, match="saved without their training token counts"):
        MTPProposer(heads=uncounted, target=TARGET, draft_vocab=8)
