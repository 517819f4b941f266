"""The one proposer protocol: every source of draft tokens (draft model, n-gram lookup, and later
MTP, EAGLE and Medusa heads) implements these three methods with these arguments.

A proposer object holds only its configuration and weights. Everything that belongs to one
generation (a draft KV cache, the token history) lives in the state that `start` returns and the
engine passes back to every call, so one proposer can serve any number of generations.

    state = proposer.start(prompts, prompt_hidden, sampling, max_len, k)   # after the target's prefill
    loop:
        proposal = proposer.propose(state, limits, generator)             # up to limits[b] drafts per row
        ... the target verifies, rows take their tokens ...
        proposer.observe(state, outcome)                                   # what was committed; roll back

The target's features reach the proposer as arguments (`prompt_hidden` at start, `Outcome.hidden`
after each step), for heads that draft from them (MTP, EAGLE, Medusa): its final hidden states, or
the outputs of the decoder layers the proposer declares once in `features` (EAGLE), which the
target's forward returns at no extra pass. The target's cache always lags one token behind the
sequence: the newest token ("last") is fed with the next verification window [last, drafts].

A proposer that drafts from logits may draft over a draft vocabulary (`DraftVocabulary`) and
draws its tokens with `draw`, so that every such proposer shares one definition of both.

This module knows nothing about particular proposers, verification or stopping.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ..errors import SpecdecError
from ..model import frozen_linear
from ..sampling import SamplingConfig, argmax, probabilities, sample


@dataclass
class Proposal:
    tokens: torch.Tensor               # (B, m) long draft tokens; row b's first lengths[b] are real
    lengths: torch.Tensor              # (B,) long, drafts proposed per row (0..limits[b])
    draft_probs: torch.Tensor | None   # (B, m, V) distributions the drafts were drawn from (after the
                                       # sampling transform); None: deterministic drafts (one-hot)

    @classmethod
    def empty(cls, batch_size: int) -> "Proposal":
        return cls(torch.zeros(batch_size, 0, dtype=torch.long), torch.zeros(batch_size, dtype=torch.long), None)

    def trimmed(self) -> "Proposal":
        """Without the trailing columns no row uses (a proposer may pad its drafts to the limit, as
        n-gram lookup does when it finds less): the target then verifies only 1 + max(lengths)."""
        m = int(self.lengths.max()) if self.lengths.numel() else 0
        if m == self.tokens.shape[1]:
            return self
        probs = None if self.draft_probs is None else self.draft_probs[:, :m]
        return Proposal(self.tokens[:, :m], self.lengths, probs)


@dataclass
class Outcome:
    """What one verification step committed, per row."""
    accepted: torch.Tensor  # (B,) drafts of the proposal the target accepted
    tokens: torch.Tensor    # (B, m+1) the accepted drafts, then the recovered or bonus token
    counts: torch.Tensor    # (B,) tokens of `tokens` emitted: accepted + 1, fewer where the row
                            # finished inside the run, 0 for rows finished before the step
    hidden: torch.Tensor    # (B, m+1, C) target features over [last, drafts] (final hidden states, or the
                            # declared layers' outputs concatenated: (B, m+1, len(features) * C)); the first
                            # counts[b] are now in the target's cache, hidden[b, i] predicted tokens[b, i]


class Proposer(Protocol):
    name: str
    vocab_size: int | None  # token ids it can propose; None: any (it copies ids it has seen)
    features: tuple[int, ...]  # target decoder layers whose outputs it reads, concatenated in this order,
                               # as prompt_hidden and Outcome.hidden; () or absent: the final hidden states

    def start(self, prompts: list[list[int]], prompt_hidden: torch.Tensor, sampling: SamplingConfig,
              max_len: int, k: int) -> Any:
        """New per-generation state. prompt_hidden (B, P-1, C): target features (see `features`) over
        each prompt without its last token (right-padded). max_len: the longest sequence (prompt +
        generated) a row may reach; k: the most drafts any row will be asked for per step."""

    def propose(self, state: Any, limits: torch.Tensor, generator: torch.Generator | None) -> Proposal:
        """Draft at most limits[b] (B,) tokens after each row's sequence (0: draft nothing)."""

    def observe(self, state: Any, outcome: Outcome) -> None:
        """Learn what the target committed for the last proposal; drop what it rejected."""


class DraftVocabulary:
    """A drafter's unembedding over the N token ids most frequent in its training tokens, and the
    map back to target ids. Lossless: the draft's probability is 0 outside the N ids, which the
    acceptance rules account for; it only makes the unembedding cheaper (N rows instead of V)."""

    def __init__(self, ids: torch.Tensor, lm_head_weight: torch.Tensor):
        self.ids = ids                                              # (N,) sorted target ids
        self.unembedding = frozen_linear(lm_head_weight[ids])       # (N, C) rows of the lm_head

    @classmethod
    def trained(cls, ids: torch.Tensor, unembedding: torch.nn.Module) -> "DraftVocabulary":
        """A drafter's own unembedding over ids (N,), trained with it (an EAGLE head's lm_head)."""
        vocab = cls.__new__(cls)
        vocab.ids, vocab.unembedding = ids, unembedding
        return vocab

    @staticmethod
    def ids_for(size: int | None, vocab_size: int, token_counts: torch.Tensor | None,
                no_counts: str) -> torch.Tensor | None:
        """The `size` most frequent ids (sorted), or None for the full vocabulary (size None or
        >= vocab_size); `no_counts` is the error when the counts were not saved."""
        if size is None or size >= vocab_size:
            return None
        if size < 1:
            raise SpecdecError(f"draft_vocab must be >= 1 token, got {size}")
        if token_counts is None:
            raise SpecdecError(no_counts)
        return token_counts.topk(size).indices.sort().values


def draw(logits: torch.Tensor, sampling: SamplingConfig, generator, vocab: DraftVocabulary | None,
         vocab_size: int) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Draft logits (B, N) (N = V without a draft vocabulary) -> the distribution the draft is
    drawn from, over the full vocabulary (B, V), and the drawn target ids (B,); greedy: None (greedy
    verification reads no draft distribution) and the argmax."""
    if sampling.greedy:
        token = argmax(logits)
        return None, token if vocab is None else vocab.ids[token]
    p = probabilities(logits, sampling)
    token = sample(p, generator)
    if vocab is None:
        return p, token
    return p.new_zeros(p.shape[0], vocab_size).index_copy_(1, vocab.ids, p), vocab.ids[token]
