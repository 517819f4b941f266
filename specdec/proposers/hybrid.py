"""Lookup first where it is sure, a model drafter elsewhere (a draft model, an EAGLE head): each
step, suffix-tree lookup drafts the rows whose text ends in a long match (at least `min_match`
tokens seen before, and continued: code repeats its names, an answer quotes its question; such a
copy costs next to nothing and is long and right), and the model drafts the others, in one batched
call over just those rows, at most `model_depth` levels deep. A draft model whose forward costs a
third of the target's pays only where its drafts are accepted often; lookup spares it the steps
where a copy is at hand. A short match is left to the draft model: on HumanEval with
Qwen2.5-Coder-1.5B, suffix drafts from matches of 1-3 tokens had 0.5-1.1 tokens accepted per step,
from matches of 5 or more 3.4-6.5 (8 prompts, 317 steps), where the 0.5B draft model's steps have
about 3 (SURE_MATCH). An EAGLE head's drafts are accepted less often (about 0.5 a level on
SmolLM2's HumanEval answers): lookup takes over from shorter matches, and the head drafts its own
best depth while lookup drafts as deep as the step allows (the registry's eagle-hybrid).

Both proposers see every row's committed tokens: the draft model reads a row's tokens since it last
drafted for that row lazily (its pending tokens, draft_model.py), so a row that lookup drafts for
many steps costs it nothing until it drafts for that row again; an EAGLE head keeps the target's
features of those tokens pending likewise (the hybrid asks for the features its model reads). The
model learns a step's outcome as a plain stretch for the rows it did not draft (none of their
drafts is in its cache).

Lossless as its parts: lookup drafts are deterministic (one-hot), the model's carry their
distributions, and the merged proposal keeps each row's own. Trees where lookup drafts them; the
model drafts chains here.

This module knows nothing about particular lookup methods or model drafters beyond the protocol.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch

from ..decoding.protocol import Outcome, Proposal, Proposer
from ..decoding.tree import chain_parents

SURE_MATCH = 5  # the shortest suffix match lookup drafts from before a draft model (its SuffixProposer's min_match)


@dataclass
class HybridState:
    lookup: Any
    model: Any
    by_model: list[bool] = field(default_factory=list)  # per row: the last proposal's drafts came from the model


class HybridProposer:
    max_depth = None

    def __init__(self, lookup: Proposer, model: Proposer, model_depth: int | None = None, name: str = "hybrid"):
        """model_depth: the most levels the model drafts in a step (None: as many as the step allows)."""
        self.lookup, self.model, self.model_depth, self.name = lookup, model, model_depth, name
        self.vocab_size = model.vocab_size
        self.trees = lookup.trees
        self.features = getattr(model, "features", ())  # lookup reads tokens only
        self.prompt_features = getattr(model, "prompt_features", True)
        self.reading_size = getattr(model, "reading_size", 0)  # lookup reads for free

    def forget(self) -> None:
        """Lookup's shared memory of earlier generations dropped (SuffixProposer.forget)."""
        self.lookup.forget()

    def start(self, max_len, k, capacity, nodes=None) -> HybridState:
        return HybridState(self.lookup.start(max_len, k, capacity, nodes), self.model.start(max_len, k, capacity, k))

    def join(self, state: HybridState, prompts, prompt_hidden, samplings) -> None:
        self.lookup.join(state.lookup, prompts, prompt_hidden, samplings)
        self.model.join(state.model, prompts, prompt_hidden, samplings)

    def leave(self, state: HybridState, keep: list[int]) -> None:
        self.lookup.leave(state.lookup, keep)
        self.model.leave(state.model, keep)

    def unread(self, state: HybridState) -> list[int] | None:
        """The model's (lookup reads every token as it comes); None where the model does not tell."""
        reader = getattr(self.model, "unread", None)
        return None if reader is None else reader(state.model)

    def propose(self, state: HybridState, limits, widths, draws) -> Proposal:
        found = self.lookup.propose(state.lookup, limits, widths, draws)
        depth = limits if self.model_depth is None else limits.clamp(max=self.model_depth)
        rest = torch.where(found.lengths > 0, 0, depth)  # rows lookup left empty
        drafted = self.model.propose(state.model, rest, (1,) * len(widths), draws)
        state.by_model = (drafted.lengths > 0).tolist()
        return merged(found, drafted, self.vocab_size)

    def observe(self, state: HybridState, outcome: Outcome) -> None:
        self.lookup.observe(state.lookup, outcome)
        by_model = state.by_model or [False] * len(outcome.accepted)  # a plain step: no drafts at all
        accepted = [n if model else 0 for n, model in zip(outcome.accepted, by_model)]
        self.model.observe(state.model, replace(outcome, accepted=accepted, paths=None))
        state.by_model = []  # consumed: a plain stretch's outcome follows no proposal


def merged(found: Proposal, drafted: Proposal, vocab_size: int) -> Proposal:
    """One proposal of the rows' own drafts: `found`'s where it drafted, else `drafted`'s (a row
    drafts in at most one of them). Lookup drafts are one-hot where the draft model's carry
    distributions; a tree's parents where lookup drafted a tree, the chain's elsewhere."""
    B, device = found.lengths.shape[0], found.lengths.device
    m = max(found.tokens.shape[1], drafted.tokens.shape[1])
    if m == 0:
        return Proposal.empty(B, device)
    by_lookup = (found.lengths > 0)[:, None]  # (B, 1)

    def widened(t: torch.Tensor, fill: int) -> torch.Tensor:  # (B, n, ...) -> (B, m, ...)
        return torch.nn.functional.pad(t, (0, 0) * (t.dim() - 2) + (0, m - t.shape[1]), value=fill)

    tokens = torch.where(by_lookup, widened(found.tokens, 0), widened(drafted.tokens, 0))
    probs = None
    if drafted.draft_probs is not None:
        one_hot = torch.nn.functional.one_hot(tokens, vocab_size).to(drafted.draft_probs.dtype)
        probs = torch.where(by_lookup[..., None], one_hot, widened(drafted.draft_probs, 0))
    parents = None
    if found.parents is not None:
        parents = torch.where(by_lookup, widened(found.parents, -1), chain_parents(B, m, device))
    return Proposal(tokens, found.lengths + drafted.lengths, probs, parents)
