"""The one proposer protocol: every source of draft tokens (draft model, n-gram lookup, and later
MTP, EAGLE and Medusa heads) implements these methods with these arguments.

A proposer object holds only its configuration and weights. Everything that belongs to one
generation (a draft KV cache, the token history) lives in the state that `start` returns and the
engine passes back to every call, so one proposer can serve any number of generations. The state
is a batch of rows, one per sequence; rows join and leave between steps (continuous batching).

    state = proposer.start(prompts, prompt_hidden, samplings, max_len, k, capacity, nodes)  # after the target's prefill
    loop:
        proposer.leave(state, keep)                                        # only rows `keep` stay, in that order
        proposer.join(state, prompts, prompt_hidden, samplings)            # rows appended after them
        proposal = proposer.propose(state, limits, widths, generator)     # up to limits[b] levels per row
        ... the target verifies, rows take their tokens ...
        proposer.observe(state, outcome)                                   # what was committed; roll back

Each row has its own sampling settings (`samplings[b]`), and `generator` may be one generator or
one per row (sampling.RowGenerators).

The target's features reach the proposer as arguments (`prompt_hidden` at start, `Outcome.hidden`
after each step), for heads that draft from them (MTP, EAGLE, Medusa): its final hidden states, or
the outputs of the decoder layers the proposer declares once in `features` (EAGLE), which the
target's forward returns at no extra pass. The target's cache always lags one token behind the
sequence: the newest token ("last") is fed with the next verification window [last, drafts].

A proposal may be a tree (tree.py): each draft names its parent. `widths[d]` caps the drafts at
depth d + 1 (all ones: a chain); a proposer that can branch says so with `trees = True` and lists
its main chain first (nodes 0, 1, ..), the alternatives after it; one that cannot ignores widths.

A proposer that drafts from logits may draft over a draft vocabulary (`DraftVocabulary`) and
draws its tokens with `draw`, so that every such proposer shares one definition of both.

This module knows nothing about particular proposers, verification or stopping.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ..errors import SpecdecError
from ..model import frozen_linear
from ..sampling import SamplingConfig, argmax, row_probabilities, sample
from ..tree import caterpillar_layout, chain_parents


# The most committed positions a proposer catches up on at one proposal (the older ones of a longer
# stretch of plain steps are never read: its context has a hole there, still lossless, since the
# target decides every token), so that a probe after a stretch costs what a drafting step costs.
CATCH_UP = 32


@dataclass
class Proposal:
    tokens: torch.Tensor               # (B, m) long draft tokens; row b's first lengths[b] are real
    lengths: torch.Tensor              # (B,) long, drafts proposed per row (0..limits[b])
    draft_probs: torch.Tensor | None   # (B, m, V) distributions the drafts were drawn from (after the
                                       # sampling transform; a tree's node: given the siblings before it);
                                       # None: deterministic drafts (one-hot)
    parents: torch.Tensor | None = None  # (B, m) long, each node's parent (-1: the root), tree.py; None: a chain

    @classmethod
    def empty(cls, batch_size: int, device: torch.device | str = "cpu") -> "Proposal":
        return cls(torch.zeros(batch_size, 0, dtype=torch.long, device=device),
                   torch.zeros(batch_size, dtype=torch.long, device=device), None)

    @classmethod
    def from_rows(cls, tokens: list[list[int]], parents: list[list[int]] | None, device: torch.device | str
                  ) -> "Proposal":
        """Deterministic drafts listed per row on the host (a tree's nodes with their parents; None:
        chains), padded and moved to `device` in one copy."""
        n = max(map(len, tokens), default=0)
        rows = [[len(t)] + t + [0] * (n - len(t)) for t in tokens]
        if parents is not None:
            rows = [row + p + [-1] * (n - len(p)) for row, p in zip(rows, parents)]
        both = torch.tensor(rows, dtype=torch.long).view(len(tokens), -1).to(device)
        return cls(both[:, 1:1 + n], both[:, 0], None, None if parents is None else both[:, 1 + n:])

    def trimmed(self) -> "Proposal":
        """Without the trailing columns no row uses (a proposer may pad its drafts to the limit, as
        n-gram lookup does when it finds less): the target then verifies only 1 + max(lengths).
        A tree whose real nodes all form chains 0, 1, .. is a chain."""
        m = int(self.lengths.max()) if self.lengths.numel() else 0
        parents = self.parents
        if parents is not None and bool((parents[:, :m] == chain_parents(1, m, parents.device)).all()):
            parents = None
        if m == self.tokens.shape[1] and parents is self.parents:
            return self
        probs = None if self.draft_probs is None else self.draft_probs[:, :m]
        return Proposal(self.tokens[:, :m], self.lengths, probs, None if parents is None else parents[:, :m])


@dataclass
class Outcome:
    """What one verification step committed, per row: the numbers on the host, where the engine
    read them once (a proposer that needs the tokens on the device copies them once), the target's
    features on its device."""
    accepted: list[int]       # (B,) drafts of the proposal the target accepted
    tokens: list[list[int]]   # (B, m+1) the accepted drafts, then the recovered or bonus token, zero-padded
    counts: list[int]         # (B,) tokens of `tokens` emitted: accepted + 1, fewer where the row
                              # finished inside the run, 0 for rows finished before the step
    hidden: torch.Tensor      # (B, m+1, C) target features over [last, accepted path] (final hidden states, or
                            # the declared layers' outputs concatenated: (B, m+1, len(features) * C)); the
                            # first counts[b] are now in the target's cache, hidden[b, i] predicted tokens[b, i]
    paths: list[list[int]] | None = None  # per row, the accepted nodes of a tree proposal; None: a chain
                                          # (its first accepted[b] nodes)


class Proposer(Protocol):
    name: str
    vocab_size: int | None  # token ids it can propose; None: any (it copies ids it has seen)
    trees: bool             # whether it drafts trees when widths allow (else always chains)
    max_depth: int | None   # the most levels it drafts per step; None: any
    features: tuple[int, ...]  # target decoder layers whose outputs it reads, concatenated in this order,
                               # as prompt_hidden and Outcome.hidden; () or absent: the final hidden states

    def start(self, prompts: list[list[int]], prompt_hidden: torch.Tensor,
              sampling: SamplingConfig | list[SamplingConfig], max_len: int, k: int,
              capacity: int | None = None, nodes: int | None = None) -> Any:
        """New per-generation state holding `prompts` as its rows (as `join`); prompt_hidden
        (B, P-1, ...): target features (see `features`) over each prompt without its last token
        (right-padded). sampling: one setting for every row or one per row. max_len: the longest
        sequence (prompt + generated) a row may reach; k: the most levels any row will be asked
        for per step; capacity: the most rows it will hold at once (storage allocated now; default
        len(prompts)); nodes: the most drafts a proposal may hold, a tree's included (default k)."""

    def join(self, state: Any, prompts: list[list[int]], prompt_hidden: torch.Tensor,
             samplings: list[SamplingConfig]) -> None:
        """Append rows for `prompts`. prompt_hidden (n, P-1, C): target final hidden states over
        each prompt without its last token (right-padded)."""

    def leave(self, state: Any, keep: list[int]) -> None:
        """Keep only rows `keep`, in that order (finished or cancelled rows leave)."""

    def propose(self, state: Any, limits: torch.Tensor, widths: tuple[int, ...],
                generator: torch.Generator | None) -> Proposal:
        """Draft at most limits[b] (B,) levels after each row's sequence (0: draft nothing), at
        most widths[d] nodes at depth d + 1 (len(widths) >= max(limits); all ones: a chain)."""

    def observe(self, state: Any, outcome: Outcome) -> None:
        """Learn what the target committed for the last proposal; drop what it rejected."""


def per_row(sampling: SamplingConfig | list[SamplingConfig], rows: int) -> list[SamplingConfig]:
    """`start`'s sampling argument as one setting per row."""
    return list(sampling) if isinstance(sampling, (list, tuple)) else [sampling] * rows


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
    def ids_for(size: int | None, vocab_size: int, token_counts: torch.Tensor | None, no_counts: str,
                device: torch.device) -> torch.Tensor | None:
        """The `size` most frequent ids (sorted) on `device` (the drafter's), or None for the full
        vocabulary (size None or >= vocab_size); `no_counts` is the error when the counts were not saved."""
        if size is None or size >= vocab_size:
            return None
        if size < 1:
            raise SpecdecError(f"draft_vocab must be >= 1 token, got {size}")
        if token_counts is None:
            raise SpecdecError(no_counts)
        return token_counts.cpu().topk(size).indices.sort().values.to(device)  # counts are kept on the host


def with_alternatives(proposal: Proposal, scores: list[torch.Tensor], widths: tuple[int, ...],
                      vocab: DraftVocabulary | None, vocab_size: int) -> Proposal:
    """A chain proposal (B, k) turned into the static tree of tree.caterpillar_layout: beside the
    chain's draft at depth d + 1, the widths[d] - 1 best other tokens of that depth's draft logits
    scores[d] (B, N). The alternatives are deterministic (one-hot in draft_probs, which keeps
    multi-draft sampling exact: the residual after the chain's draft does not depend on which
    token was drawn). A row drafting l levels has the nodes of depths <= l."""
    B, k = proposal.tokens.shape
    widths = tuple(widths[:k])
    if all(w == 1 for w in widths):
        return proposal
    parents, chain = caterpillar_layout(widths)
    device = proposal.tokens.device
    tokens = torch.zeros(B, len(parents), dtype=torch.long, device=device)
    tokens[:, chain] = proposal.tokens
    for d, width in enumerate(widths):
        if width > 1:
            best = scores[d].topk(min(width, scores[d].shape[1]), dim=1).indices  # (B, w) draft-vocab ids
            best = best if vocab is None else vocab.ids[best]
            others = [[t for t in row if t != drafted][:width - 1] for row, drafted in
                      zip(best.tolist(), proposal.tokens[:, d].tolist())]
            for j in range(width - 1):  # a vocabulary smaller than the width leaves the last ones 0
                tokens[:, chain[d] + 1 + j] = torch.tensor([row[j] if j < len(row) else 0 for row in others],
                                                           device=device)
    probs = None
    if proposal.draft_probs is not None:
        probs = torch.zeros(B, len(parents), vocab_size, dtype=proposal.draft_probs.dtype, device=device)
        probs.scatter_(2, tokens[..., None], 1.0)
        probs[:, chain] = proposal.draft_probs
    starts = [0, *itertools.accumulate(widths)]
    lengths = torch.tensor([starts[n] for n in proposal.lengths.tolist()], device=device)
    return Proposal(tokens, lengths, probs, torch.tensor(parents, device=device).expand(B, -1).clone())


def grow_tree(root_logits: torch.Tensor, children_logits, widths: tuple[int, ...], limits: list[int],
              vocab: DraftVocabulary | None) -> Proposal:
    """A dynamic draft tree (EAGLE-2): the widths[0] best tokens of root_logits (B, N) open it;
    then, depth by depth, every node of the newest level proposes its widths[d] best children and
    the widths[d] candidates of highest score (the product of the draft probabilities along their
    path) form the next level, wherever they hang. Row b grows limits[b] levels.
    children_logits(tokens (B, n), parents (B, n), frontier (B, f)) returns the draft logits
    (B, f, N) after the frontier nodes (node indices into tokens; padding nodes hang off the root).
    The nodes are deterministic drafts (draft_probs None, one-hot for rejection sampling)."""
    B, depth, device = root_logits.shape[0], max(limits, default=0), root_logits.device
    if depth == 0:
        return Proposal.empty(B, device)
    tokens = [[] for _ in range(B)]
    parents = [[] for _ in range(B)]
    scores = [[] for _ in range(B)]
    frontier = [[] for _ in range(B)]
    logp = torch.log_softmax(root_logits.float(), -1)[:, None]                   # (B, 1, N)
    for d in range(depth):
        width = widths[d]
        best = logp.topk(min(width, logp.shape[-1]), dim=-1)                      # (B, f, w)
        ids = best.indices if vocab is None else vocab.ids[best.indices]
        for b in range(B):
            if d >= limits[b]:
                frontier[b] = []
                continue
            at = frontier[b] if d else [-1]
            base = [scores[b][i] if i >= 0 else 0.0 for i in at]
            candidates = sorted(((base[f] + v, t, at[f]) for f in range(len(at))
                                 for v, t in zip(best.values[b, f].tolist(), ids[b, f].tolist())), reverse=True)
            frontier[b] = []
            for score, token, parent in candidates[:width]:
                frontier[b].append(len(tokens[b]))
                tokens[b].append(token)
                parents[b].append(parent)
                scores[b].append(score)
        if d + 1 < depth:
            n, f = max(map(len, tokens)), max(map(len, frontier))
            logp = torch.log_softmax(children_logits(
                torch.tensor([t + [0] * (n - len(t)) for t in tokens], device=device),
                torch.tensor([p + [-1] * (n - len(p)) for p in parents], device=device),
                torch.tensor([fr + [0] * (f - len(fr)) for fr in frontier], device=device)).float(), -1)  # (B, f, N)
    return Proposal.from_rows(tokens, parents, device)


def draw(logits: torch.Tensor, samplings: list[SamplingConfig], generator, vocab: DraftVocabulary | None,
         vocab_size: int) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Draft logits (B, N) (N = V without a draft vocabulary) -> the distribution each row's draft
    is drawn from under its own sampling settings, over the full vocabulary (B, V), and the drawn
    target ids (B,). When every row is greedy: None (greedy verification reads no draft
    distribution) and the argmax; a greedy row among sampled ones gets the one-hot of its argmax."""
    if all(cfg.greedy for cfg in samplings):
        token = argmax(logits)
        return None, token if vocab is None else vocab.ids[token]
    p = row_probabilities(logits, samplings)
    token = sample(p, generator)
    if vocab is None:
        return p, token
    return p.new_zeros(p.shape[0], vocab_size).index_copy_(1, vocab.ids, p), vocab.ids[token]


def draft_chain(logits: torch.Tensor, steps: int, advance, samplings: list[SamplingConfig], generator,
                vocab: DraftVocabulary | None, vocab_size: int
                ) -> tuple[torch.Tensor, torch.Tensor | None, list[torch.Tensor]]:
    """Draft `steps` tokens one after another: d_1 is drawn (`draw`) from logits (B, N), and
    advance(j, d_{j+1}) returns the logits (B, N) draft j+2 is drawn from. Returns the drafts
    (B, steps), the distributions they were drawn from (B, steps, V) or None (all rows greedy), and
    each step's logits (the scores of base.with_alternatives)."""
    tokens, probs, scores = [], [], []
    for j in range(steps):
        p, token = draw(logits, samplings, generator, vocab, vocab_size)  # (B, V) or None, (B,)
        tokens.append(token)
        probs.append(p)
        scores.append(logits)
        if j + 1 < steps:
            logits = advance(j, token)
    return torch.stack(tokens, 1), None if probs[0] is None else torch.stack(probs, 1), scores


def draw_block(logits: torch.Tensor, samplings: list[SamplingConfig], generator, vocab: DraftVocabulary | None,
               vocab_size: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A parallel drafter's block: logits (B, m, N) of m slots from one forward -> the drafts (B, m),
    each drawn from its own slot's distribution without seeing the others (`draw`), and those
    distributions (B, m, V), or None when every row is greedy (one argmax over the whole block)."""
    if all(cfg.greedy for cfg in samplings):
        token = argmax(logits)
        return token if vocab is None else vocab.ids[token], None
    drawn = [draw(slot, samplings, generator, vocab, vocab_size) for slot in logits.unbind(1)]
    return torch.stack([token for _, token in drawn], 1), torch.stack([p for p, _ in drawn], 1)
