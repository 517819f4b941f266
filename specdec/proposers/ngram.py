"""N-gram (prompt lookup) proposer: no model, no draft probabilities.

For each row, find the most recent earlier occurrence of the sequence's last n tokens (prompt and
generated text together), trying n = max_n down to min_n, and propose the tokens that followed
it. Rows without a match propose nothing. Drafts are deterministic, so verification treats them
as one-hot (draft_probs None), which keeps sampling lossless.

The search runs over the whole batch at once on a right-padded history tensor.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..decode import pad_right
from ..errors import SpecdecError
from .base import Outcome, Proposal, append_ragged


@dataclass
class NgramState:
    history: torch.Tensor  # (B, W) prompt + committed tokens, right-padded
    lengths: torch.Tensor  # (B,)


class NgramProposer:
    name = "ngram"
    vocab_size = None  # proposes only ids it has seen

    def __init__(self, max_n: int = 3, min_n: int = 1):
        if not 1 <= min_n <= max_n:
            raise SpecdecError(f"n-gram sizes need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.max_n, self.min_n = max_n, min_n

    def start(self, prompts, prompt_hidden, sampling, max_len, k) -> NgramState:
        return NgramState(*pad_right(prompts))

    def propose(self, state: NgramState, limits, generator) -> Proposal:
        B, m = limits.shape[0], int(limits.max())
        if m == 0:
            return Proposal.empty(B)
        history, lengths = state.history, state.lengths
        W = history.shape[1]
        follow = torch.full((B,), -1)  # (B,) index where the proposed continuation starts, -1: none yet
        for n in range(min(self.max_n, W - 1), self.min_n - 1, -1):
            windows = history.unfold(1, n, 1)                                             # (B, W-n+1, n)
            suffix = history.gather(1, (lengths[:, None] - n + torch.arange(n)).clamp(min=0))  # (B, n)
            start = torch.arange(W - n + 1)[None]
            # an earlier occurrence, followed by at least one token before the suffix's end
            match = (windows == suffix[:, None]).all(-1) & (start < (lengths - n)[:, None])  # (B, W-n+1)
            latest = torch.where(match, start, -1).max(1).values                             # (B,)
            follow = torch.where((follow < 0) & (latest >= 0), latest + n, follow)
        counts = torch.where(follow >= 0, torch.minimum(limits, lengths - follow), 0)
        cols = (follow.clamp(min=0)[:, None] + torch.arange(m)[None]).clamp(max=W - 1)
        return Proposal(history.gather(1, cols), counts, None)

    def observe(self, state: NgramState, outcome: Outcome) -> None:
        state.history, state.lengths = append_ragged(state.history, state.lengths, outcome.tokens, outcome.counts)
