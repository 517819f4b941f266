"""A separate, smaller causal LM drafts tokens autoregressively with its own KV cache.

Drafts are drawn with the same sampling transform (temperature, top-k, top-p) as the target, and
their distributions are returned as draft_probs for rejection sampling. The draft's cache holds
the committed sequence except the tokens committed since its last proposal ("pending": at least
the newest one); a proposal feeds the pending tokens and then its own drafts 1..m-1, and after
verification the cache is rolled back to the committed part, keeping the accepted drafts.

Works with specdec's LlamaForCausalLM at any batch size and with a transformers causal LM at
batch size 1 (see lm.py). It needs the target's token ids (same tokenizer); the engine checks
the vocabulary sizes agree.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import SpecdecError
from ..lm import causal_lm, context_length, next_positions, prefill_all_but_last
from ..model import LlamaForCausalLM
from ..sampling import SamplingConfig
from .base import DraftVocabulary, Outcome, Proposal, draw


@dataclass
class DraftState:
    cache: object
    sampling: SamplingConfig
    pending: list[list[int]]  # per row: committed tokens not yet in the draft cache (at least the newest)
    committed: list[int]      # per row: cache entries holding committed tokens only
    fed_drafts: int = 0       # drafts of the last proposal written into the cache after `committed`


class DraftModelProposer:
    name = "draft-model"
    features = ()  # none read; the engine's default

    def __init__(self, model, draft_vocab: int | None = None, token_counts: torch.Tensor | None = None):
        """draft_vocab N: draft over the N most frequent token ids of `token_counts` (V,) — the
        counts of the training tokens, saved with the draft — through an unembedding of N rows
        instead of V. Lossless: the draft's probability is 0 outside them, which rejection sampling
        accounts for; it only lowers the draft's cost."""
        self.model = causal_lm(model, role="draft model")
        self.vocab_size = self.model.config.vocab_size
        self.context = context_length(self.model)
        ids = DraftVocabulary.ids_for(
            draft_vocab, self.vocab_size, token_counts,
            "this draft model was saved without the token counts of its training data, so no draft "
            "vocabulary can be chosen: draft over the full vocabulary, or add them (checkpoint.save_token_counts)")
        if ids is not None and not isinstance(self.model, LlamaForCausalLM):
            raise SpecdecError("a draft vocabulary needs specdec's own LlamaForCausalLM as the draft model")
        self.vocab = None if ids is None else DraftVocabulary(ids, self.model.lm_head.weight)

    @property
    def draft_ids(self) -> torch.Tensor | None:
        """(N,) the token ids drafted over; None: all V."""
        return None if self.vocab is None else self.vocab.ids

    def start(self, prompts, prompt_hidden, sampling, max_len, k) -> DraftState:
        if max_len - 1 > self.context:
            raise SpecdecError(f"the draft model's context ({self.context} tokens) is shorter than the "
                               f"{max_len - 1} positions this generation needs: shorten the prompt or "
                               "max_new_tokens, or use a draft model with a longer context")
        # room for padding: a row may be written up to k + 1 slots past its longest sequence
        cache = self.model.new_cache(len(prompts), max_len + k + 1)
        prefill_all_but_last(self.model, cache, prompts)
        return DraftState(cache, sampling, [[p[-1]] for p in prompts], [len(p) - 1 for p in prompts])

    def forward(self, tokens: torch.Tensor, cache, logits_index=None) -> torch.Tensor:
        """Logits (B, N) at the last position (or logits_index (B, 1)) over the draft vocabulary."""
        extra = {} if self.vocab is None else {"unembedding": self.vocab.unembedding}
        out = self.model(tokens, positions=next_positions(cache, tokens.shape[1], self.context), cache=cache,
                         logits_index=logits_index, **extra)
        return out.logits[:, -1]

    def propose(self, state: DraftState, limits, generator) -> Proposal:
        limit = limits.tolist()
        B, m = len(limit), max(limit)
        state.fed_drafts = 0
        if m == 0:
            return Proposal.empty(B)
        # feed the pending tokens; rows that draft nothing keep theirs pending
        lengths = [len(p) for p in state.pending]
        width = max(lengths)
        window = torch.tensor([p + [0] * (width - len(p)) for p in state.pending])  # (B, W)
        last = torch.tensor([[max(n - 1, 0)] for n in lengths]) if width > 1 else None  # (B, 1)
        logits = self.forward(window, state.cache, last)
        for b in range(B):
            if limit[b]:
                state.committed[b] += lengths[b]
                state.pending[b] = []
        state.cache.rollback(torch.tensor(state.committed))
        tokens, probs = [], []
        for i in range(m):
            p, token = draw(logits, state.sampling, generator, self.vocab, self.vocab_size)  # (B, V), (B,)
            tokens.append(token)
            probs.append(p)
            if i + 1 < m:
                logits = self.forward(token[:, None], state.cache)
        state.fed_drafts = m - 1
        probs = None if state.sampling.greedy else torch.stack(probs, 1)
        return Proposal(torch.stack(tokens, 1), limits.clone(), probs)

    def observe(self, state: DraftState, outcome: Outcome) -> None:
        # accepted drafts already in the cache stay; the rest of the committed tokens become pending
        for b, (tokens, n, emitted) in enumerate(zip(outcome.tokens.tolist(), outcome.accepted.tolist(),
                                                     outcome.counts.tolist())):
            kept = min(n, state.fed_drafts, emitted)
            state.committed[b] += kept
            state.pending[b] += tokens[kept:emitted]
        state.cache.rollback(torch.tensor(state.committed))
