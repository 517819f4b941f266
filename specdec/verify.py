"""Verification of draft tokens against the target: pure tensor functions, no models, no state.

Vocabulary (DESIGN.md section 1). A row proposes draft tokens d_1..d_L (L = its draft length, at
most k; shorter rows are right-padded to k). The target scored the window [last, d_1..d_k] in one
forward pass, so position i of `target_logits` / `target_probs` (B, k+1, V) is its distribution of
the token that follows d_i (position 0: the token after `last`).

- accepted tokens: the longest prefix of drafts the target agrees with, n per row (0 <= n <= L);
- recovered token: when n < L, the target's token at position n, in place of the rejected d_{n+1};
- bonus token: when n == L, the target's token at position L, after the last draft.

Each step thus emits n + 1 tokens per row. `Verdict.next_token` is the recovered or bonus token.

Greedy: a draft is accepted iff it is the target's argmax. Sampling (Leviathan et al. 2023, Chen et
al. 2023): d_i is accepted with probability min(1, target_probs[d_i] / draft_probs[d_i]); at the
first rejection the recovered token is drawn from the residual max(0, target_probs - draft_probs)
normalised. The emitted token is then distributed exactly as target_probs. Deterministic proposers
(n-gram lookup) pass draft_probs=None, meaning one-hot on the drafted token: acceptance with
probability target_probs[d_i] and the residual is target_probs without d_i, which stays lossless.

Both functions take probabilities already processed by the same temperature / top-k / top-p
transform for target and draft (sampling.probabilities); this module knows nothing about models,
caches or stopping.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from .sampling import argmax, sample, uniform


class Verdict(NamedTuple):
    accepted: torch.Tensor    # (B,) long, number of drafts accepted per row
    next_token: torch.Tensor  # (B,) long, the recovered token (after a rejection) or the bonus token


def _draft_lengths(draft_tokens: torch.Tensor, draft_lengths: torch.Tensor | None) -> torch.Tensor:
    B, k = draft_tokens.shape
    if draft_lengths is None:
        return torch.full((B,), k, dtype=torch.long, device=draft_tokens.device)
    return draft_lengths


def _prefix_length(ok: torch.Tensor) -> torch.Tensor:
    """(B, k) bool -> (B,) length of the leading run of True."""
    return ok.long().cumprod(1).sum(1)


def greedy_accept(draft_tokens: torch.Tensor, target_logits: torch.Tensor,
                  draft_lengths: torch.Tensor | None = None) -> Verdict:
    """draft_tokens (B, k); target_logits (B, k+1, V); draft_lengths (B,) real drafts per row
    (default k). A draft is accepted while it equals the target's argmax.

    Only an argmax over the vocabulary; the comparison runs over at most k ids per row on the
    host, which costs less than the dozen tiny tensor operations it would take."""
    target_tokens = argmax(target_logits).tolist()  # (B, k+1)
    lengths = _draft_lengths(draft_tokens, draft_lengths).tolist()
    accepted, next_token = [], []
    for drafts, target, n_drafts in zip(draft_tokens.tolist(), target_tokens, lengths):
        n = 0
        while n < n_drafts and drafts[n] == target[n]:
            n += 1
        accepted.append(n)
        next_token.append(target[n])
    device = draft_tokens.device
    return Verdict(torch.tensor(accepted, device=device), torch.tensor(next_token, device=device))


def residual(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """(B, V), (B, V) -> (B, V): max(0, target_probs - draft_probs), normalised.

    Where the mass is zero (target and draft equal up to rounding, so a rejection there has
    probability zero) the target's distribution is returned instead, to keep the sampler defined.
    """
    excess = (target_probs - draft_probs).clamp(min=0)
    mass = excess.sum(-1, keepdim=True)
    return torch.where(mass > 0, excess / mass.clamp(min=torch.finfo(excess.dtype).tiny), target_probs)


def rejection_sample(draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
                     target_probs: torch.Tensor, generator: torch.Generator | None = None,
                     draft_lengths: torch.Tensor | None = None) -> Verdict:
    """draft_tokens (B, k); draft_probs (B, k, V) the distributions the drafts were sampled from,
    or None for deterministic drafts; target_probs (B, k+1, V); draft_lengths (B,) (default k);
    generator: one for all rows, or one per row (sampling.RowGenerators).

    Accept d_i with probability min(1, target/draft), then emit a recovered token from the
    residual at the first rejection, or a bonus token from target_probs after the last draft.
    """
    B, k = draft_tokens.shape
    rows = torch.arange(B, device=draft_tokens.device)
    lengths = _draft_lengths(draft_tokens, draft_lengths)
    proposed = torch.arange(k, device=draft_tokens.device)[None] < lengths[:, None]  # (B, k)
    target_p = target_probs[:, :k].gather(2, draft_tokens[..., None]).squeeze(2)     # (B, k)
    if draft_probs is None:
        draft_p = torch.ones_like(target_p)
    else:
        draft_p = draft_probs.gather(2, draft_tokens[..., None]).squeeze(2)          # (B, k)
    u = uniform(B, k, generator, device=target_p.device)
    # u < target/draft, written without the division (draft_p > 0 for any sampled draft)
    accepted = _prefix_length((u * draft_p < target_p) & proposed)                    # (B,)

    at = target_probs[rows, accepted]                                                 # (B, V)
    rejected = accepted < lengths
    if k > 0:
        pos = accepted.clamp(max=k - 1)
        if draft_probs is None:
            draft_at = torch.nn.functional.one_hot(draft_tokens[rows, pos], at.shape[-1]).to(at.dtype)
        else:
            draft_at = draft_probs[rows, pos]                                         # (B, V)
        at = torch.where(rejected[:, None], residual(at, draft_at), at)
    next_token = sample(at, generator)
    return Verdict(accepted, next_token)
