"""N-gram lookup that drafts through the grammar (structured output): each constrained row's chain
splices the runs its grammar forces with lookup continuations its grammar allows, so one step can
cover a forced run, the free tokens after it that repeat earlier text, the next forced run, and so on.

Why. Under a grammar, n-gram lookup (ngram.py) proposes the continuation of the latest occurrence
of the longest matching suffix whether the grammar allows it or not, and where the grammar forces
a run, that run replaces its chain (guided.Guide.propose) and the step ends after it. Here, at each
depth of a row's chain:

1. the run the grammar forces after the chain so far is taken whole (certain drafts);
2. where none is forced but the grammar forces bytes that several tokenizations can write (`":"`
   after a key: one token, or `":` then `"`), the token the target began those bytes with the last
   time it wrote them (`splits`, learned from the proposer's earlier outputs, all requests together);
3. else the first token of the first earlier continuation of the text with the chain so far
   (longest n first, most recent first, as ngram.History orders them) that the grammar allows: a
   refused match no longer ends the chain where another one fits;
4. where only the end may come, the EOS (certain too), and the chain ends;
5. else the chain ends.

On SmolLM2's structured workload (docs/structured.md) the free tokens this finds are the ones that
repeat: a key's closing `":` and opening `"` (SmolLM2 writes `":"` as two tokens, never the one
token that encodes it), names and cities copied from the prompt after their first tokens, the tail
of a string written twice. The splits hold no content of an answer, only how the target tokenizes
what the grammar forces: one token per forced byte string.

The drafts are deterministic (draft_probs None), like any lookup's, so verification stays exact.
Rows without a constraint, a proposal without any, and trees draft as NgramProposer does: this is
the registry's "ngram" drafter (proposers/drafters.py), the same lookup wherever no grammar is walked.
"""
from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field

from ..decoding.protocol import Outcome, Proposal
from .ngram import History, NgramProposer, NgramState


@dataclass
class GuidedState(NgramState):
    # per row: (position, forced bytes, the chain's drafts before that position) of the free positions
    # of its last chain where the grammar forced bytes: what the target wrote there teaches `splits`
    asked: list[list[tuple[int, bytes, list[int]]]] = field(default_factory=list)


class GuidedNgramProposer(NgramProposer):
    def __init__(self, max_n: int = 3, min_n: int = 1):
        super().__init__(max_n, min_n)
        self.splits: dict[bytes, int] = {}  # forced bytes -> the token the target began them with, last time

    def start(self, max_len, k, capacity, nodes=None) -> GuidedState:
        return GuidedState([])

    def join(self, state: GuidedState, prompts, prompt_hidden, samplings) -> None:
        super().join(state, prompts, prompt_hidden, samplings)
        state.asked += [[] for _ in prompts]

    def leave(self, state: GuidedState, keep: list[int]) -> None:
        super().leave(state, keep)
        state.asked = [state.asked[b] for b in keep]

    def propose(self, state: GuidedState, limits, widths, draws) -> Proposal:
        grammar = draws.grammar  # guided.DraftGrammar, or None: no constrained row
        if grammar is None or max(widths[:int(limits.max())], default=1) > 1:
            return super().propose(state, limits, widths, draws)
        chains = [self.spliced(row, limit, grammar, b, state.asked[b]) if limit else []
                  for b, (row, limit) in enumerate(zip(state.rows, limits.tolist()))]
        return Proposal.from_rows(chains, None, limits.device)

    def spliced(self, row: History, limit: int, grammar, b: int, asked: list) -> list[int]:
        """Row b's chain of at most `limit` drafts (module docstring), walked through its grammar
        (guided.DraftGrammar's row walk); an unconstrained row's is the n-gram continuation. The
        free positions where the grammar forced bytes are noted in `asked`."""
        if grammar.matchers[b] is None:
            return row.continuation(limit)
        chain: list[int] = []
        while len(chain) < limit:
            run = grammar.row_forced(b)[:limit - len(chain)]
            if run:
                taken = grammar.row_take(b, run)
                chain += run[:taken]
                if taken < len(run):
                    break
            else:
                forced = grammar.row_forced_bytes(b)
                split = [self.splits[forced]] if forced in self.splits else []
                if forced:
                    asked.append((len(row.tokens) + len(chain), forced, list(chain)))
                token = next((t for t in itertools.chain(split, next_tokens(row, chain)) if grammar.row_take(b, [t])),
                             None)
                if token is None:
                    break
                chain.append(token)
            if not grammar.following[b]:  # the end was drafted
                break
        return chain

    def observe(self, state: GuidedState, outcome: Outcome) -> None:
        """The rows' texts grow; where the target wrote at a position its last chain noted, after the
        same drafts, the token it began the forced bytes with is learned."""
        super().observe(state, outcome)
        for row, asked in zip(state.rows, state.asked):
            for position, forced, before in asked:
                start = position - len(before)
                if len(row.tokens) > position and row.tokens[start:position] == before:
                    self.splits[forced] = row.tokens[position]
            asked.clear()


def next_tokens(row: History, chain: list[int]) -> Iterator[int]:
    """The distinct tokens that followed earlier occurrences of the suffixes of the row's text with
    `chain` after it: the longest n first, the most recent occurrence first."""
    tail = row.tokens[-row.sizes.stop:] + chain
    seen = set()
    for n in reversed(row.sizes):
        if len(tail) < n:
            continue
        for start in reversed(row.starts[n].get(tuple(tail[-n:]), ())):
            token = row.tokens[start + n]
            if token not in seen:
                seen.add(token)
                yield token
