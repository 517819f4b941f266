"""N-gram (prompt lookup) proposer: no model, no draft probabilities.

For each row, find the most recent earlier occurrence of the sequence's last n tokens (prompt and
generated text together), trying n = max_n down to min_n, and propose the tokens that followed
it. Rows without a match propose nothing. Drafts are deterministic, so verification treats them
as one-hot (draft_probs None), which keeps sampling lossless.

Each row keeps, for every n, a table from an n-gram to its latest starts (the most recent
`MATCHES`) at which it occurred with at least one token after it; a token appended registers the
n-grams it completes the continuation of. A lookup is then one table access per n, whatever the
length of the text.

Trees: where the widths allow more than one draft per depth, the continuations of several earlier
occurrences (most recent first, longest n first) are merged into a trie, at most widths[d] nodes
at depth d + 1; the most recent continuation is its main chain.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..decoding.protocol import Outcome, Proposal
from ..errors import SpecdecError

MATCHES = 8  # earlier occurrences remembered per n-gram (trees draw their branches from them)


@dataclass
class History:
    """One row's text and, per n, n-gram -> latest starts (oldest first) followed by at least one
    more token."""
    sizes: range
    tokens: list[int] = field(default_factory=list)
    starts: dict[int, dict[tuple[int, ...], list[int]]] = field(init=False)

    def __post_init__(self):
        self.starts = {n: {} for n in self.sizes}

    def extend(self, new: list[int]) -> None:
        for token in new:
            self.tokens.append(token)
            end = len(self.tokens) - 1  # the new token continues every n-gram ending just before it
            for n in self.sizes:
                if end - n >= 0:
                    starts = self.starts[n].setdefault(tuple(self.tokens[end - n:end]), [])
                    starts.append(end - n)
                    del starts[:-MATCHES]

    def continuations(self, limit: int, count: int) -> list[list[int]]:
        """Up to `count` distinct continuations of at most `limit` tokens that followed earlier
        occurrences of the text's suffix: the longest matching suffix first, most recent first."""
        found: list[list[int]] = []
        for n in reversed(self.sizes):
            if len(self.tokens) > n:
                for start in reversed(self.starts[n].get(tuple(self.tokens[-n:]), ())):
                    continuation = self.tokens[start + n:start + n + limit]
                    if continuation not in found:
                        found.append(continuation)
                        if len(found) == count:
                            return found
        return found

    def continuation(self, limit: int) -> list[int]:
        """Up to `limit` tokens that followed the latest earlier occurrence of the longest suffix."""
        found = self.continuations(limit, 1)
        return found[0] if found else []


def lookup(row: History, limit: int, widths: tuple[int, ...]) -> tuple[list[int], list[int]]:
    """One row's drafts of at most `limit` levels: the latest continuation as a chain, or where a
    level may branch, the continuations merged into a tree of `widths`."""
    if max(widths) == 1:
        return row.continuation(limit), []
    return trie(row.continuations(limit, max(widths)), widths[:limit])


def trie(continuations: list[list[int]], widths: tuple[int, ...]) -> tuple[list[int], list[int]]:
    """Merge continuations (the first is the main chain) into a tree of at most widths[d] nodes at
    depth d + 1: its tokens and parents in depth order (tree.py)."""
    levels: list[list[tuple[int, int]]] = [[] for _ in widths]  # per depth: (parent key, token)
    keys: list[dict[tuple[int, int], int]] = [{} for _ in widths]
    for continuation in continuations:
        parent = -1
        for d, token in enumerate(continuation[:len(widths)]):
            key = (parent, token)
            if key not in keys[d]:
                if len(levels[d]) == widths[d]:
                    break
                keys[d][key] = len(levels[d])
                levels[d].append(key)
            parent = keys[d][key]
    tokens, parents, offset, previous = [], [], 0, 0
    for d, level in enumerate(levels):
        for parent, token in level:
            tokens.append(token)
            parents.append(-1 if d == 0 else previous + parent)
        previous, offset = offset, offset + len(level)
    return tokens, parents


@dataclass
class NgramState:
    rows: list[History]


class NgramProposer:
    name = "ngram"
    features = ()  # none read; the engine's default
    prompt_features = False  # joins without reading prompt_hidden
    vocab_size = None  # proposes only ids it has seen
    trees = True
    max_depth = None

    def __init__(self, max_n: int = 3, min_n: int = 1):
        if not 1 <= min_n <= max_n:
            raise SpecdecError(f"n-gram sizes need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.max_n, self.min_n = max_n, min_n

    def start(self, max_len, k, capacity, nodes=None) -> NgramState:
        return NgramState([])

    def join(self, state: NgramState, prompts, prompt_hidden, samplings) -> None:
        for prompt in prompts:
            state.rows.append(History(range(self.min_n, self.max_n + 1)))
            state.rows[-1].extend(prompt)

    def leave(self, state: NgramState, keep: list[int]) -> None:
        state.rows = [state.rows[b] for b in keep]

    def propose(self, state: NgramState, limits, widths, draws) -> Proposal:
        return Proposal.looked_up(limits, widths, state.rows, lookup)

    def observe(self, state: NgramState, outcome: Outcome) -> None:
        for row, tokens, count in zip(state.rows, outcome.tokens, outcome.counts):
            row.extend(tokens[:count])
