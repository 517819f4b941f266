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
from ..sampling import SamplingConfig, probabilities, sample
from .base import Outcome, Proposal, append_ragged, drop_prefix


@dataclass
class DraftState:
    cache: object
    sampling: SamplingConfig
    pending: torch.Tensor      # (B, W) committed tokens not yet in the draft cache, right-padded
    pending_len: torch.Tensor  # (B,)
    committed: torch.Tensor    # (B,) cache length holding committed tokens only
    fed_drafts: int = 0        # drafts of the last proposal written into the cache after `committed`


class DraftModelProposer:
    name = "draft-model"

    def __init__(self, model):
        self.model = causal_lm(model, role="draft model")
        self.vocab_size = self.model.config.vocab_size
        self.context = context_length(self.model)

    def start(self, prompts, prompt_hidden, sampling, max_len, k) -> DraftState:
        if max_len - 1 > self.context:
            raise SpecdecError(f"the draft model's context ({self.context} tokens) is shorter than the "
                               f"{max_len - 1} positions this generation needs: shorten the prompt or "
                               "max_new_tokens, or use a draft model with a longer context")
        B = len(prompts)
        # room for padding: a row may be written up to k + 1 slots past its longest sequence
        cache = self.model.new_cache(B, max_len + k + 1)
        prefill_all_but_last(self.model, cache, prompts)
        last = torch.tensor([[p[-1]] for p in prompts])  # (B, 1)
        return DraftState(cache, sampling, last, torch.ones(B, dtype=torch.long), cache.lengths.clone())

    def propose(self, state: DraftState, limits, generator) -> Proposal:
        B, m = limits.shape[0], int(limits.max())
        state.fed_drafts = 0
        if m == 0:
            return Proposal.empty(B)
        active = limits > 0
        cache = state.cache
        # feed the pending tokens; rows that draft nothing keep theirs pending
        out = self.model(state.pending, positions=next_positions(cache, state.pending.shape[1], self.context),
                         cache=cache, logits_index=(state.pending_len - 1).clamp(min=0)[:, None])
        state.committed = state.committed + torch.where(active, state.pending_len, 0)
        cache.rollback(state.committed)
        state.pending_len = torch.where(active, 0, state.pending_len)
        logits = out.logits[:, 0]  # (B, V)
        tokens, probs = [], []
        for i in range(m):
            p = probabilities(logits, state.sampling)  # (B, V)
            token = p.argmax(-1) if state.sampling.greedy else sample(p, generator)  # (B,)
            tokens.append(token)
            probs.append(p)
            if i + 1 < m:
                logits = self.model(token[:, None], positions=next_positions(cache, 1, self.context),
                                    cache=cache).logits[:, 0]
        state.fed_drafts = m - 1
        return Proposal(torch.stack(tokens, 1), limits.clone(), torch.stack(probs, 1))

    def observe(self, state: DraftState, outcome: Outcome) -> None:
        # accepted drafts already in the cache stay; the rest of the committed tokens become pending
        kept = torch.minimum(outcome.accepted.clamp(max=state.fed_drafts), outcome.counts)  # (B,)
        state.committed = state.committed + kept
        state.cache.rollback(state.committed)
        new, new_len = drop_prefix(outcome.tokens, kept, outcome.counts)
        state.pending, state.pending_len = append_ragged(state.pending, state.pending_len, new, new_len)

