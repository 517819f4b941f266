"""The one proposer protocol: every source of draft tokens (a draft model or a parallel draft,
n-gram and suffix lookup, MTP heads, EAGLE and block heads) implements these methods with these
arguments.

A proposer object holds only its configuration and weights. Everything that belongs to one
generation (a draft KV cache, the token history) lives in the state that `start` returns and the
engine passes back to every call, so one proposer can serve any number of generations. The state
is a batch of rows, one per sequence; rows join and leave between steps (continuous batching).

    state = proposer.start(max_len, k, capacity, nodes)                   # no rows yet
    loop:
        proposer.leave(state, keep)                                        # only rows `keep` stay, in that order
        proposer.join(state, prompts, prompt_hidden, samplings)            # rows appended after them
        proposal = proposer.propose(state, limits, widths, draws)         # up to limits[b] levels per row
        ... the target verifies, rows take their tokens ...
        proposer.observe(state, outcome)                                   # what was committed; roll back

Each row has its own sampling settings (`samplings[b]`). `draws` (sampling.Draws) says where random
choices come from: its generator (one, or one per row: sampling.RowGenerators) for sampled rows, and
for a seeded row the Gumbel noise of the positions its drafts will be verified at (`draws.positions`,
from the engine), which couples its drafts to the target's draws.

The target's features reach the proposer as arguments (`prompt_hidden` when rows join, after the
target's prefill of their prompts; `Outcome.hidden` after each step), for heads that draft from
them (MTP, EAGLE, block): its final hidden states, or
the outputs of the decoder layers the proposer declares once in `features` (EAGLE), which the
target's forward returns at no extra pass. The target's cache always lags one token behind the
sequence: the newest token ("last") is fed with the next verification window [last, drafts].
A proposer whose layers have the target's shapes (the self-draft) may say `reads_target_cache = True`:
`start` then gets the target's KV cache (`target_cache=`) and the proposer keeps none of its own. It
attends to the target's keys and values of the committed tokens, writes those of what it feeds (each
row's "last", its drafts) past the rows' lengths, where the verification then writes the target's,
and leaves the lengths as it found them; the engine alone regroups that cache.

A proposal may be a tree (tree.py): each draft names its parent. `widths[d]` caps the drafts at
depth d + 1 (all ones: a chain); a proposer that can branch says so with `trees = True` and lists
its main chain first (nodes 0, 1, ..), the alternatives after it; one that cannot ignores widths.

The engine's row seam (`RowState`): everything that keeps state per row beside the engine's own lists
(the target's cache, the proposer through `Drafting`, the constraint guide, the `Schedule` of depths)
hears of rows joining (`Joining`, in that order: the cache's prefill fills in the prompts' features
the others read) and leaving through the same two calls.

This module knows nothing about particular proposers, verification or stopping.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from .sampling import Draws, SamplingConfig
from .tree import chain_parents


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

    @classmethod
    def looked_up(cls, limits: torch.Tensor, widths: tuple[int, ...], rows: list, draft: Callable) -> "Proposal":
        """Deterministic drafts found by lookup: draft(row, n, widths) -> (tokens, parents in depth
        order) for each of `rows` that drafts n > 0 tokens (limits (B,)), the widths cut at the
        deepest; chains (parents None) where every width is 1."""
        limit = limits.tolist()
        m = max(limit)
        if m == 0:
            return cls.empty(len(limit), limits.device)
        widths = tuple(widths[:m])
        trees = [draft(row, n, widths) if n else ([], []) for row, n in zip(rows, limit)]
        return cls.from_rows([t for t, _ in trees], None if max(widths) == 1 else [p for _, p in trees],
                             limits.device)

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
    prompt_features: bool   # whether `join` reads prompt_hidden (absent: it does); one that does not lets
                            # rows map the cached blocks of a prompt's leading tokens without prefilling them
    reading_size: int       # multiply-adds its network spends on a committed token it reads (a draft
                            # model's body, lm/interface.body_size); absent or 0: reading costs next to nothing
    # unread(state) -> list[int] | None, optional: per row, the committed tokens its next proposal reads
    # before drafting (a draft model's pending tokens); absent or None: the engine counts them (adaptive.py)

    def start(self, max_len: int, k: int, capacity: int, nodes: int | None = None) -> Any:
        """New per-generation state without rows (they `join`). max_len: the longest sequence
        (prompt + generated) a row may reach; k: the most levels any row will be asked for per
        step; capacity: the most rows it will hold at once (storage allocated now); nodes: the
        most drafts a proposal may hold, a tree's included (default k)."""

    def join(self, state: Any, prompts: list[list[int]], prompt_hidden: torch.Tensor,
             samplings: list[SamplingConfig]) -> None:
        """Append rows for `prompts`, each with its sampling settings. prompt_hidden (n, P-1, ...):
        target features (see `features`) over each prompt without its last token (right-padded)."""

    def leave(self, state: Any, keep: list[int]) -> None:
        """Keep only rows `keep`, in that order (finished or cancelled rows leave)."""

    def propose(self, state: Any, limits: torch.Tensor, widths: tuple[int, ...], draws: Draws) -> Proposal:
        """Draft at most limits[b] (B,) levels after each row's sequence (0: draft nothing), at
        most widths[d] nodes at depth d + 1 (len(widths) >= max(limits); all ones: a chain)."""

    def observe(self, state: Any, outcome: Outcome) -> None:
        """Learn what the target committed for the last proposal; drop what it rejected."""



class NoDraft:
    """The proposer of plain decoding (engine.Engine(target, None, 0, ...)): it proposes nothing and
    keeps no state, so every step is a plain step of the target."""
    name = "plain"
    vocab_size = None
    trees = False
    max_depth = 0
    features = ()
    prompt_features = False

    def start(self, max_len: int, k: int, capacity: int, nodes: int | None = None) -> None:
        return None

    def join(self, state: None, prompts: list[list[int]], prompt_hidden: torch.Tensor,
             samplings: list[SamplingConfig]) -> None:
        return None

    def leave(self, state: None, keep: list[int]) -> None:
        return None

    def propose(self, state: None, limits: torch.Tensor, widths: tuple[int, ...],
                generator: torch.Generator | None) -> Proposal:
        return Proposal.empty(limits.shape[0], limits.device)

    def observe(self, state: None, outcome: Outcome) -> None:
        return None


@dataclass
class Joining:
    """Requests joining the batch, as each holder of per-row state hears of them."""
    prompts: list[list[int]]
    samplings: list[SamplingConfig]
    constraints: list                   # each one's grammar (guided.py) or None
    promises: list[int]                 # blocks of KV cache set aside for each (Engine.promise)
    hidden: torch.Tensor | None = None  # the target's features of the prompts, once its cache has prefilled them


class RowState(Protocol):
    """What keeps state per row of the engine's batch, in the batch's order."""

    def join(self, joining: Joining) -> None:
        """Append rows for the joining requests."""

    def leave(self, keep: list[int]) -> None:
        """Keep only rows `keep`, in that order."""


class Schedule(RowState, Protocol):
    """How deep each step drafts and in what shape (widths per depth), a holder of rows: `Fixed`, or
    chosen from what pays on this machine (adaptive.Adaptive, k="auto"). A depth of 0 is a stretch of
    plain steps, for as many steps as `choose` says (math.inf: until the batch changes)."""
    depth: int  # the deepest it drafts

    def read(self, unread: list[int] | None) -> None:
        """Per row, what the proposer has not read yet (Drafting.unread), before `choose`."""

    def choose(self, horizon: float, tokens: float) -> tuple[int, tuple[int, ...], int | float]:
        """(depth, widths per depth, steps); horizon: the most steps the batch may still run (math.inf
        while rows may come); tokens: the most tokens the rows in hand may still emit."""

    def observe(self, limits: list[int], accepted: list[int], width: int, draft_seconds: float,
                step_seconds: float, forward_seconds: float, chain: list[int] | None = None) -> None:
        """What a drafting step did and cost (adaptive.Adaptive.observe)."""

    def observe_plain(self, steps: int, seconds: float, forward_seconds: float) -> None:
        """What a stretch of plain steps cost."""

    def finish(self) -> dict | None:
        """The run ended: what it chose and why (metrics.SpecMetrics.adaptive), or None."""


@dataclass
class Fixed:
    """The schedule of a fixed k: `widths` (one per depth) every step; none (k = 0): plain decoding throughout."""
    widths: tuple[int, ...]

    @property
    def depth(self) -> int:
        return len(self.widths)

    def choose(self, horizon: float, tokens: float) -> tuple[int, tuple[int, ...], int | float]:
        return self.depth, self.widths, 1 if self.depth else math.inf

    def join(self, joining: Joining) -> None: ...
    def leave(self, keep: list[int]) -> None: ...
    def read(self, unread: list[int] | None) -> None: ...
    def observe(self, *step) -> None: ...
    def observe_plain(self, steps: int, seconds: float, forward_seconds: float) -> None: ...
    def finish(self) -> None: ...


@dataclass
class Drafting:
    """A proposer and its generation's state: a holder of rows that drafts for them and hears what was committed."""
    proposer: Proposer
    state: Any

    def join(self, joining: Joining) -> None:
        self.proposer.join(self.state, joining.prompts, joining.hidden, joining.samplings)

    def leave(self, keep: list[int]) -> None:
        self.proposer.leave(self.state, keep)

    def propose(self, limits: torch.Tensor, widths: tuple[int, ...], draws: Draws) -> Proposal:
        return self.proposer.propose(self.state, limits, widths, draws)

    def observe(self, outcome: Outcome) -> None:
        self.proposer.observe(self.state, outcome)

    def unread(self) -> list[int] | None:
        """Per row, what the proposer has not read yet, where it tells (Proposer.unread)."""
        reader = getattr(self.proposer, "unread", None)
        return None if reader is None else reader(self.state)
