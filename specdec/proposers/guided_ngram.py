"""N-gram lookup that drafts through the grammar (structured output): each constrained row's chain
splices the runs its grammar forces with lookup continuations its grammar allows, so one step can
cover a forced run, the free tokens after it that repeat earlier text, the next forced run, and so on.

Why. Under a grammar, n-gram lookup (ngram.py) proposes the continuation of the latest occurrence
of the longest matching suffix whether the grammar allows it or not, and where the grammar forces
a run, that run replaces its chain (guided.Guide.propose) and the step ends after it. Here, at each
depth of a row's chain:

1. the run the grammar forces after the chain so far is taken whole (certain drafts);
2. where none is forced, the first token of the first earlier continuation of the text with the
   chain so far (longest n first, most recent first, as ngram.History orders them) that the grammar
   allows: a refused match no longer ends the chain where another one fits;
3. where only the end may come, the EOS (certain too), and the chain ends;
4. else the chain ends.

On SmolLM2's structured workload (docs/structured.md) the free tokens this finds are the ones that
repeat: a key's closing `":` and opening `"`, names and cities copied from the prompt after their
first tokens, the tail of a string written twice.

The drafts are deterministic (draft_probs None), like any lookup's, so verification stays exact.
Rows without a constraint, a proposal without any, and trees draft as NgramProposer does: this is
the registry's "ngram" drafter (proposers/drafters.py), the same lookup wherever no grammar is walked.
"""
from __future__ import annotations

from collections.abc import Iterator

from ..decoding.protocol import Proposal
from .ngram import History, NgramProposer, NgramState


class GuidedNgramProposer(NgramProposer):
    def propose(self, state: NgramState, limits, widths, draws) -> Proposal:
        grammar = draws.grammar  # guided.DraftGrammar, or None: no constrained row
        if grammar is None or max(widths[:int(limits.max())], default=1) > 1:
            return super().propose(state, limits, widths, draws)
        chains = [spliced(row, limit, grammar, b) if limit else [] for b, (row, limit) in
                  enumerate(zip(state.rows, limits.tolist()))]
        return Proposal.from_rows(chains, None, limits.device)


def spliced(row: History, limit: int, grammar, b: int) -> list[int]:
    """Row b's chain of at most `limit` drafts (module docstring), walked through its grammar
    (guided.DraftGrammar's row walk); an unconstrained row's is the n-gram continuation."""
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
            token = next((t for t in next_tokens(row, chain) if grammar.row_take(b, [t])), None)
            if token is None:
                break
            chain.append(token)
        if not grammar.following[b]:  # the end was drafted
            break
    return chain


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
