"""A parallel draft model (PARD, An et al. 2025): a small causal LM with a mask token of its own that
drafts a whole block of k tokens in ONE forward.

Per step the draft reads [the committed tokens not yet in its cache ("pending", at least the newest),
mask x (m-1)]: the output at the last pending token is d_1, the output at mask j is d_{j+1}. So each
draft is drawn from the draft's distribution given the committed prefix only, never given the
drafts before it; those per-slot distributions are returned as draft_probs, and rejection
sampling with exactly them is lossless (at slot i the draft token is independent of the earlier
drafts and of the acceptance draws, so accepting it with min(1, target_probs / draft_probs) and
resampling from the residual gives the target's distribution given the accepted prefix). The mask
slots' cache entries are dropped after the forward: the cache holds committed tokens only, and
everything the target commits (accepted drafts included) is fed with the next proposal.

Static trees (widths > 1): beside the block's draft at depth d + 1, the next-best tokens of the
same slot (base.with_alternatives): the top-w of one block forward is a tree at no extra draft cost.

The model is stored as a transformers checkpoint with one token more than the target's vocabulary
(its mask token, the last id) and metadata naming the mask id, the block it was trained for and the
target's hash (checkpoint.PARALLEL_KIND; train/loop.py writes it). It needs specdec's own
LlamaForCausalLM at any batch size.
"""
from __future__ import annotations

import torch

from ..decoding.protocol import Outcome, Proposal
from ..errors import SpecdecError
from ..heads.vocabulary import DraftVocabulary
from ..lm.device import placement
from ..lm.interface import next_positions
from ..lm.kv_cache import KVCache
from ..lm.model import LlamaForCausalLM
from .base import FEED, draw_block, fed, with_alternatives
from .draft_model import DraftModelProposer, DraftState


class ParallelDraftProposer(DraftModelProposer):
    name = "parallel"
    trees = True

    def __init__(self, model: LlamaForCausalLM, mask_token_id: int, block: int, draft_vocab: int | None = None,
                 token_counts: torch.Tensor | None = None):
        """model: the parallel draft (vocabulary: the target's ids, then the mask token
        `mask_token_id`); block: the most drafts per step it was trained for (its max_depth).
        draft_vocab N: draft over the N most frequent ids of `token_counts` (as DraftModelProposer)."""
        if not isinstance(model, LlamaForCausalLM):
            raise SpecdecError(f"a parallel draft is specdec's own LlamaForCausalLM, not {type(model).__name__}")
        if mask_token_id != model.config.vocab_size - 1:
            raise SpecdecError(f"a parallel draft's mask token is its last id ({model.config.vocab_size - 1}), "
                               f"got {mask_token_id}: the checkpoint's metadata does not match its weights")
        if block < 1:
            raise SpecdecError(f"a parallel draft drafts a block of >= 1 tokens, got {block}")
        self.tree, self.model, self.mask, self.max_depth = "static", model, mask_token_id, block
        self.vocab_size = mask_token_id  # the target's ids: every id but the mask
        self.context = model.config.max_position_embeddings
        ids = DraftVocabulary.ids_for(
            draft_vocab, self.vocab_size, token_counts,
            "this parallel draft was saved without the token counts of its training data, so no draft "
            "vocabulary can be chosen: draft over the full vocabulary", placement(model).device)
        if ids is None:  # every target id: the unembedding without the mask token's row
            ids = torch.arange(self.vocab_size, device=placement(model).device)
        self.vocab = DraftVocabulary(ids, model.lm_head)
        # decided once: the step as one kernel call where the layers run as one and the unembedding is packed
        self.native = self.vocab.unembedding.stored is not None and model.drafts_in_one_call()

    def start(self, max_len, k, capacity, nodes=None) -> DraftState:
        if k > self.max_depth:
            raise SpecdecError(f"this parallel draft was trained for blocks of {self.max_depth} drafts; k={k} is "
                               f"longer: use k <= {self.max_depth} (or -k auto)")
        return super().start(max_len, k, capacity, nodes)

    def new_cache(self, rows: int, max_len: int, k: int, nodes: int | None) -> KVCache:
        # a window is the pending tokens (at most FEED: base.catch_up feeds older ones first) and m - 1 masks, padded
        return self.model.new_cache(rows, max_len + FEED + 2 * (k + 2))

    def propose(self, state: DraftState, limits, widths, draws) -> Proposal:
        limit = limits.tolist()
        B, m, lengths = len(limit), max(limit), self.pending_window(state, limit)
        if lengths is None:
            return Proposal.empty(B, limits.device)
        width = max(lengths) + m - 1
        # per row: [pending, mask x (m-1), padding] and the m columns whose outputs are the block: one copy
        both = torch.tensor([p[:n] + [self.mask] * (m - 1) + [0] * (width - n - m + 1)
                             + list(range(max(n, 1) - 1, max(n, 1) + m - 1)) for p, n in zip(state.pending, lengths)],
                            device=limits.device)
        window, columns = both[:, :width], both[:, width:]                  # (B, W), (B, m)
        positions = next_positions(state.cache, width, self.context)
        greedy = all(cfg.greedy for cfg in state.samplings)
        tree = max(widths[:m], default=1) > 1
        if self.native:  # the whole step in one kernel call
            tokens, logits, _ = self.model.draft_block(window, state.cache, positions, columns,
                                                       self.vocab.unembedding.stored, self.vocab.ids,
                                                       not greedy or tree)
        else:
            logits = self.model(window, positions=positions, cache=state.cache, logits_index=columns,
                                unembedding=self.vocab.unembedding).logits   # (B, m, N)
        fed(state, [n if lim else 0 for n, lim in zip(lengths, limit)])  # the masks' entries dropped
        if not (self.native and greedy):
            tokens, probs, scores = draw_block(logits, state.samplings, draws, self.vocab, self.vocab_size)
        else:  # greedy in the kernel: the logits came back only for a tree's alternatives
            probs, scores = None, list(logits.unbind(1)) if tree else None
        return with_alternatives(Proposal(tokens, limits.clone(), probs), scores, widths, self.vocab, self.vocab_size)

    def observe(self, state: DraftState, outcome: Outcome) -> None:
        # no draft was written into the cache: every committed token is pending
        state.pending = [pending + tokens[:emitted]
                         for pending, tokens, emitted in zip(state.pending, outcome.tokens, outcome.counts)]
