"""engine.py under sampling: the joint distribution of the first three generated tokens equals the
target's, enumerated exactly on a 16-token vocabulary, and the same test fails for wrong verifiers.

Each configuration draws N = 100,000 speculative samples in one run of the engine with a batch of
N identical prompts (the batch > 1 path: every row accepts, finishes and rolls back on its own).

The test, for observed counts over the 16^3 = 4096 sequences against the exact distribution p:
- chi-square: cells with expected count >= 5 kept, the other cells of nonzero probability pooled
  into one; a sample in a cell of probability 0 fails outright; pass at significance ALPHA = 1e-3.
- total variation: TV(empirical, p) <= sum_x sqrt(p(x)(1 - p(x)) / N) / 2 + sqrt(ln(1/DELTA) / (2N)),
  the first term bounding E[TV] (Jensen) and the second McDiarmid's deviation (one sample moves
  TV by at most 1/N), so a correct sampler exceeds it with probability <= DELTA = 1e-6.
Configurations cover temperature 1 and temperature 0.7 with top-k 8 and top-p 0.9, draft model and
n-gram proposers, k = 1 and 3, as an orthogonal array (every pair of levels appears once).
"""
from __future__ import annotations

import itertools
import math

import pytest
import torch
from scipy.stats import chisquare

from specdec.decoding import verify
from specdec.decoding.engine import speculative_generate
from specdec.decoding.sampling import SamplingConfig, probabilities
from specdec.decoding.stopping import StopRule
from specdec.decoding.verify import Verdict, rejection_sample
from specdec.proposers import DraftModelProposer, NgramProposer

from ..spec_helpers import noisy_copy, tiny_llama

V, N, ALPHA, DELTA = 16, 100_000, 1e-3, 1e-6
TARGET = tiny_llama(0, vocab=V, layers=1, hidden=16, heads=2, kv_heads=1, context=32, std=0.4)
DRAFT = noisy_copy(TARGET, 0.15, seed=5)
# the n-gram proposer finds "2" earlier and proposes "4 2 ..."; the target follows with 4 about half
# the time (T=1), so n-gram drafts are often accepted
PROMPT = [2, 4, 2]
SETTINGS = {
    "T=1": SamplingConfig(temperature=1.0),
    "T=0.7,top-k=8,top-p=0.9": SamplingConfig(temperature=0.7, top_k=8, top_p=0.9),
}
# a draft vocabulary of 10 of the 16 tokens: the draft's probability is 0 on the other 6
DRAFT_VOCAB_COUNTS = torch.tensor([9, 1, 8, 2, 7, 3, 6, 4, 5, 0, 10, 11, 0, 12, 0, 13])
PROPOSERS = {"draft-model": lambda: DraftModelProposer(model=DRAFT),
             "draft-model, 10-token draft vocabulary": lambda: DraftModelProposer(
                 model=DRAFT, draft_vocab=10, token_counts=DRAFT_VOCAB_COUNTS),
             "ngram": lambda: NgramProposer()}
CONFIGS = [("draft-model", "T=1", 1), ("draft-model", "T=0.7,top-k=8,top-p=0.9", 3),
           ("ngram", "T=1", 3), ("ngram", "T=0.7,top-k=8,top-p=0.9", 1),
           ("draft-model, 10-token draft vocabulary", "T=1", 3)]


@torch.no_grad()
def exact_joint(sampling: SamplingConfig, prompt: list[int] = PROMPT) -> torch.Tensor:
    """(V^3,) float64: P(t1, t2, t3 | prompt) under the target, indexed t1 * V^2 + t2 * V + t3."""
    seqs = torch.tensor([prompt + list(c) for c in itertools.product(range(V), repeat=3)])  # (V^3, P+3)
    P = len(prompt)
    probs = probabilities(TARGET(seqs).logits[:, P - 1:P + 2], sampling).double()            # (V^3, 3, V)
    return probs.gather(2, seqs[:, P:, None]).squeeze(2).prod(1)


def speculative_counts(proposer_name: str, sampling: SamplingConfig, k: int, sampled_verify=rejection_sample):
    rule = StopRule(max_new_tokens=max(3, k + 1))  # room for a full first step of k drafts
    generator = torch.Generator().manual_seed(1234)
    rows, metrics = speculative_generate(TARGET, PROPOSERS[proposer_name](), [PROMPT] * N, rule, sampling, k,
                                         generator, sampled_verify=sampled_verify)
    first3 = torch.tensor([row.tokens[:3] for row in rows])  # (N, 3)
    index = first3[:, 0] * V * V + first3[:, 1] * V + first3[:, 2]
    return torch.bincount(index, minlength=V ** 3).double(), metrics


def distribution_test(counts: torch.Tensor, exact: torch.Tensor) -> tuple[float, float, float]:
    """(chi-square p-value, total variation, its bound) of counts (V^3,) against exact (V^3,)."""
    n = counts.sum()
    expected = n * exact
    if counts[exact == 0].sum() > 0:
        p_value = 0.0
    else:
        big, small = expected >= 5, (expected > 0) & (expected < 5)
        observed, wanted = [counts[big]], [expected[big]]
        if small.any():
            observed.append(counts[small].sum()[None])
            wanted.append(expected[small].sum()[None])
        observed, wanted = torch.cat(observed), torch.cat(wanted)
        p_value = float(chisquare(observed, wanted * observed.sum() / wanted.sum()).pvalue)
    tv = float((counts / n - exact).abs().sum() / 2)
    bound = float((exact * (1 - exact) / n).sqrt().sum() / 2 + math.sqrt(math.log(1 / DELTA) / (2 * n)))
    return p_value, tv, bound


def passes(result: tuple[float, float, float]) -> bool:
    p_value, tv, bound = result
    return p_value > ALPHA and tv <= bound


@pytest.mark.parametrize("proposer_name,setting,k", CONFIGS)
def test_speculative_sampling_matches_the_target_distribution(proposer_name, setting, k):
    sampling = SETTINGS[setting]
    counts, metrics = speculative_counts(proposer_name, sampling, k)
    result = distribution_test(counts, exact_joint(sampling))
    print(f"\n{proposer_name} {setting} k={k}: p={result[0]:.3g} TV={result[1]:.4f} (bound {result[2]:.4f}) "
          f"alpha={metrics.acceptance_rate:.3f} tau={metrics.mean_acceptance_length:.3f}")
    assert passes(result), result
    assert metrics.accepted > 0.01 * N  # drafts were really accepted: the test covers acceptance


# ---- wrong verifiers: the same test must fail ----

def accept_always(draft_tokens, draft_probs, target_probs, generator=None, draft_lengths=None) -> Verdict:
    """Wrong: keeps every draft, then a bonus token from the target."""
    rows = torch.arange(draft_tokens.shape[0])
    return Verdict(draft_lengths, torch.multinomial(target_probs[rows, draft_lengths], 1, generator=generator)[:, 0])


def residual_from_target(target_probs, draft_probs):
    """Wrong: the recovered token is drawn from the target instead of the residual."""
    return target_probs


def residual_without_max(target_probs, draft_probs):
    """Wrong: |target - draft| normalised instead of max(0, target - draft) normalised."""
    diff = (target_probs - draft_probs).abs()
    return diff / diff.sum(-1, keepdim=True)


WRONG = {
    "accept-always/draft-model": ("draft-model", "T=0.7,top-k=8,top-p=0.9", 3, accept_always, None),
    "accept-always/ngram": ("ngram", "T=1", 3, accept_always, None),
    "residual-from-target": ("draft-model", "T=0.7,top-k=8,top-p=0.9", 3, rejection_sample, residual_from_target),
    "residual-without-max": ("draft-model", "T=0.7,top-k=8,top-p=0.9", 3, rejection_sample, residual_without_max),
}


@pytest.mark.parametrize("case", WRONG.values(), ids=WRONG.keys())
def test_the_distribution_test_fails_for_a_wrong_verifier(case, monkeypatch):
    proposer_name, setting, k, sampled_verify, wrong_residual = case
    assert (proposer_name, setting, k) in CONFIGS  # the configuration the correct verifier passes
    if wrong_residual is not None:
        monkeypatch.setattr(verify, "residual", wrong_residual)
    sampling = SETTINGS[setting]
    counts, _ = speculative_counts(proposer_name, sampling, k, sampled_verify)
    result = distribution_test(counts, exact_joint(sampling))
    print(f"\nwrong verifier: p={result[0]:.3g} TV={result[1]:.4f} (bound {result[2]:.4f})")
    assert not passes(result), result
