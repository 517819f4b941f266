"""verify.py: greedy acceptance from tables of intent; rejection sampling against closed forms."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare

from specdec.decoding.verify import Verdict, greedy_accept, rejection_sample, residual

V = 10


def logits_with_argmax(argmax: list[int]) -> torch.Tensor:
    """(len(argmax), V) logits whose row i has its maximum at argmax[i]."""
    logits = torch.randn(len(argmax), V, generator=torch.Generator().manual_seed(len(argmax)))
    logits[torch.arange(len(argmax)), torch.tensor(argmax)] = 10.0
    return logits


# drafts, draft length (None: all), target argmax over [last, drafts], accepted, next token
GREEDY_CASES = {
    "perfect match -> bonus": ([3, 4, 5], None, [3, 4, 5, 6], 3, 6),
    "first-token miss -> recovered": ([1, 4, 5], None, [3, 4, 5, 6], 0, 3),
    "partial": ([3, 4, 1], None, [3, 4, 5, 6], 2, 5),
    "a match after a miss does not count": ([3, 1, 5], None, [3, 4, 5, 6], 1, 4),
    "short row: bonus after its last draft": ([3, 4, 5], 2, [3, 4, 9, 6], 2, 9),
    "short row: padding is never accepted": ([3, 4, 9], 2, [3, 4, 9, 6], 2, 9),
    "draft length 0": ([3, 4, 5], 0, [3, 4, 5, 6], 0, 3),
    "single draft accepted": ([7], None, [7, 2], 1, 2),
    "single draft rejected": ([7], None, [8, 2], 0, 8),
}


@pytest.mark.parametrize("case", GREEDY_CASES.values(), ids=GREEDY_CASES.keys())
def test_greedy_accept_table(case):
    drafts, length, argmax, accepted, next_token = case
    lengths = None if length is None else torch.tensor([length])
    verdict = greedy_accept(torch.tensor([drafts]), logits_with_argmax(argmax)[None], lengths)
    assert verdict.accepted.tolist() == [accepted]
    assert verdict.next_token.tolist() == [next_token]


def test_greedy_accept_empty_draft():
    verdict = greedy_accept(torch.zeros(2, 0, dtype=torch.long), torch.stack([logits_with_argmax([7]),
                                                                             logits_with_argmax([1])]))
    assert verdict.accepted.tolist() == [0, 0] and verdict.next_token.tolist() == [7, 1]


def test_greedy_accept_batch_equals_rows_one_by_one():
    cases = [c for c in GREEDY_CASES.values() if len(c[0]) == 3]
    drafts = torch.tensor([c[0] for c in cases])
    lengths = torch.tensor([3 if c[1] is None else c[1] for c in cases])
    logits = torch.stack([logits_with_argmax(c[2]) for c in cases])
    verdict = greedy_accept(drafts, logits, lengths)
    assert verdict.accepted.tolist() == [c[3] for c in cases]
    assert verdict.next_token.tolist() == [c[4] for c in cases]


# ---- rejection sampling: the closed form of one accept/resample step ----

def step_distribution(draft_probs: torch.Tensor | None, target_probs: torch.Tensor, draft_token: int | None = None):
    """Exact distribution (V,) of the token one step emits at a drafted position, in closed form:
    sum over drafts x of draft(x) * [accept(x) * onehot(x) + (1 - accept(x)) * residual].
    draft_probs None: the deterministic draft `draft_token`."""
    if draft_probs is None:
        draft_probs = torch.nn.functional.one_hot(torch.tensor(draft_token), V).double()
    out = torch.zeros(V, dtype=torch.float64)
    res = residual(target_probs[None], draft_probs[None])[0]
    for x in range(V):
        if draft_probs[x] == 0:
            continue
        accept = min(1.0, float(target_probs[x] / draft_probs[x]))
        out += draft_probs[x] * (accept * torch.nn.functional.one_hot(torch.tensor(x), V).double() + (1 - accept) * res)
    return out


def normalised(x: torch.Tensor) -> torch.Tensor:
    return x.double() / x.double().sum()


def distributions(kind: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    target, draft = torch.rand(V, generator=g) ** 3, torch.rand(V, generator=g) ** 3
    if kind == "zero-containing":
        target[torch.randperm(V, generator=g)[:4]] = 0
        draft[torch.randperm(V, generator=g)[:4]] = 0
    elif kind == "identical":
        draft = target.clone()
    elif kind == "disjoint":
        target[:V // 2], draft[V // 2:] = 0, 0
    return normalised(target), normalised(draft)


KINDS = ["random", "zero-containing", "identical", "disjoint"]


@settings(max_examples=60, deadline=None)
@given(kind=st.sampled_from(KINDS), seed=st.integers(0, 2**31 - 1))
def test_closed_form_step_distribution_equals_target(kind, seed):
    target, draft = distributions(kind, seed)
    torch.testing.assert_close(step_distribution(draft, target), target, atol=1e-12, rtol=0)


@settings(max_examples=60, deadline=None)
@given(kind=st.sampled_from(KINDS), seed=st.integers(0, 2**31 - 1), token=st.integers(0, V - 1))
def test_closed_form_with_deterministic_draft_equals_target(kind, seed, token):
    target, _ = distributions(kind, seed)
    torch.testing.assert_close(step_distribution(None, target, token), target, atol=1e-12, rtol=0)


def test_residual_of_identical_distributions_falls_back_to_target():
    target, _ = distributions("random", 0)
    torch.testing.assert_close(residual(target[None], target[None])[0], target)


# ---- rejection_sample itself: its empirical output against the closed form ----

N = 200_000  # rows of one batched call; chi-square at significance 1e-3 (seeded, so deterministic)


def pooled_p_value(counts: torch.Tensor, expected: torch.Tensor) -> float:
    """Chi-square p-value with the cells of expected count < 5 pooled into one (the test's
    approximation needs it; a sample in a cell of probability 0 fails outright)."""
    if counts[expected == 0].sum() > 0:
        return 0.0
    big = expected >= 5
    observed = torch.cat([counts[big], counts[~big].sum()[None]])
    wanted = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = wanted > 0
    return chisquare(observed[keep], wanted[keep] * observed.sum() / wanted.sum()).pvalue


def sampled_counts(verdict: Verdict) -> torch.Tensor:
    return torch.bincount(verdict.next_token, minlength=V)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("deterministic", [False, True], ids=["draft-probs", "one-hot-draft"])
def test_rejection_sample_first_token_matches_target(kind, deterministic):
    target, draft = distributions(kind, 7)
    g = torch.Generator().manual_seed(11)
    drafts = torch.multinomial(draft.float(), N, replacement=True, generator=g)[:, None]  # (N, 1)
    if deterministic:
        drafts = torch.full((N, 1), int(draft.argmax()))
    target_probs = target.float().expand(N, 2, V)
    verdict = rejection_sample(drafts, None if deterministic else draft.float().expand(N, 1, V), target_probs, g)
    # the first emitted token: the draft if accepted, else the recovered token
    first = torch.where(verdict.accepted > 0, drafts[:, 0], verdict.next_token)
    observed = torch.bincount(first, minlength=V).double()
    support = target > 0
    assert observed[~support].sum() == 0, "a token the target gives probability 0 was emitted"
    assert pooled_p_value(observed, N * target) > 1e-3


def test_rejection_sample_respects_draft_lengths_and_bonus():
    target, draft = distributions("random", 3)
    g = torch.Generator().manual_seed(5)
    drafts = torch.multinomial(draft.float(), 2 * N, replacement=True, generator=g).view(N, 2)
    bonus = distributions("random", 4)[0]                                  # the target after the drafts
    target_probs = torch.stack([target, target, bonus]).float().expand(N, 3, V)
    draft_probs = draft.float().expand(N, 2, V)
    lengths = torch.randint(0, 3, (N,), generator=g)
    verdict = rejection_sample(drafts, draft_probs, target_probs, g, lengths)
    assert (verdict.accepted <= lengths).all()
    # rows with no drafts emit exactly one token, from the target's first distribution
    none = lengths == 0
    assert (verdict.accepted[none] == 0).all()
    counts = torch.bincount(verdict.next_token[none], minlength=V).double()
    assert pooled_p_value(counts, int(none.sum()) * target) > 1e-3
    # the bonus token after two accepted drafts comes from position 2's distribution
    full = verdict.accepted == 2
    counts = torch.bincount(verdict.next_token[full], minlength=V).double()
    assert pooled_p_value(counts, int(full.sum()) * bonus) > 1e-3


def test_rejection_sample_with_one_hot_distributions_is_greedy():
    argmax = [[3, 4, 5, 6], [1, 4, 5, 6], [3, 4, 1, 6]]
    drafts = torch.tensor([[3, 4, 5]] * 3)
    target_probs = torch.stack([torch.nn.functional.one_hot(torch.tensor(a), V).float() for a in argmax])
    draft_probs = torch.nn.functional.one_hot(drafts, V).float()
    verdict = rejection_sample(drafts, draft_probs, target_probs, torch.Generator().manual_seed(0))
    assert verdict.accepted.tolist() == [3, 0, 2] and verdict.next_token.tolist() == [6, 1, 1]
