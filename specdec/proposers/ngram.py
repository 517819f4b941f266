"""N-gram (prompt lookup) proposer: no model, no draft probabilities.

For each row, find the most recent earlier occurrence of the sequence's last n tokens (prompt and
generated text together), trying n = max_n down to min_n, and propose the tokens that followed
it. Rows without a match propose nothing. Drafts are deterministic, so verification treats them
as one-hot (draft_probs None), which keeps sampling lossless.

Each row keeps, for every n, a table from an n-gram to the latest start at which it occurred
with at least one token after it; a token appended registers the n-grams it completes the
continuation of. A lookup is then one table access per n, whatever the length of the text.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..errors import SpecdecError
from .base import Outcome, Proposal


@dataclass
class History:
    """One row's text and, per n, n-gram -> latest start followed by at least one more token."""
    sizes: range
    tokens: list[int] = field(default_factory=list)
    starts: dict[int, dict[tuple[int, ...], int]] = field(init=False)

    def __post_init__(self):
        self.starts = {n: {} for n in self.sizes}

    def extend(self, new: list[int]) -> None:
        for token in new:
            self.tokens.append(token)
            end = len(self.tokens) - 1  # the new token continues every n-gram ending just before it
            for n in self.sizes:
                if end - n >= 0:
                    self.starts[n][tuple(self.tokens[end - n:end])] = end - n

    def continuation(self, limit: int) -> list[int]:
        """Up to `limit` tokens that followed the latest earlier occurrence of the longest suffix."""
        for n in reversed(self.sizes):
            if len(self.tokens) > n:
                start = self.starts[n].get(tuple(self.tokens[-n:]))
                if start is not None:
                    return self.tokens[start + n:start + n + limit]
        return []


@dataclass
class NgramState:
    rows: list[History]


class NgramProposer:
    name = "ngram"
    features = ()  # none read; the engine's default
    vocab_size = None  # proposes only ids it has seen

    def __init__(self, max_n: int = 3, min_n: int = 1):
        if not 1 <= min_n <= max_n:
            raise SpecdecError(f"n-gram sizes need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.max_n, self.min_n = max_n, min_n

    def start(self, prompts, prompt_hidden, sampling, max_len, k) -> NgramState:
        rows = [History(range(self.min_n, self.max_n + 1)) for _ in prompts]
        for row, prompt in zip(rows, prompts):
            row.extend(prompt)
        return NgramState(rows)

    def propose(self, state: NgramState, limits, generator) -> Proposal:
        B, m = limits.shape[0], int(limits.max())
        if m == 0:
            return Proposal.empty(B)
        drafts = [row.continuation(limit) for row, limit in zip(state.rows, limits.tolist())]
        tokens = torch.tensor([d + [0] * (m - len(d)) for d in drafts], dtype=torch.long)  # (B, m)
        return Proposal(tokens, torch.tensor([len(d) for d in drafts], dtype=torch.long), None)

    def observe(self, state: NgramState, outcome: Outcome) -> None:
        for row, tokens, count in zip(state.rows, outcome.tokens.tolist(), outcome.counts.tolist()):
            row.extend(tokens[:count])
