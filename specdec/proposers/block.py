"""A block head as the draft (heads/block.py): ONE head forward per step drafts the whole block of k
tokens from the target's features, which the engine hands over because the proposer declares them
(`features`: the head's layer ids).

Alignment and bookkeeping are the EAGLE proposer's (proposers/eagle.py, whose join, leave and
observe this one shares): the head's KV cache holds its entries for the context positions it has
read with target features; the positions since ("pending": features f_t and tokens x_{t+1}, at
least the newest) are fed at the next proposal. Here they are fed together with the block's mask
queries, in one forward over [pending x W (right-padded), mask x M] with explicit positions and an
explicit visibility among these inputs: the pending positions are causal and never see a mask;
mask j (at position T-1+j, T-1 the row's last pending position) sees the row's real pending
positions, the cached ones, and the masks of its block (all of them, or those before it, as the
head was trained). Block slot 0 is the output at the last pending position, slot j the output at
mask j. Then the cache is rolled back to the committed entries and the real pending ones: the
padding and the masks are dropped. The accepted positions come back with the target's features
and are fed at the next proposal, as in EAGLE.

Drafts. Slot j's draft is drawn from the head's distribution at slot j after the same sampling
transform as the target (base.draw), over its draft vocabulary, and that distribution is returned
as its draft_probs: slot j does not see the drafts before it, so the distribution it was drawn
from is its distribution given the context alone, and rejection sampling stays lossless. Greedy
drafts each slot's argmax. Trees (widths > 1): the chain with the next-best tokens of each slot
beside it (base.with_alternatives), from the same forward: no extra draft cost.

Works at any batch size, with specdec's LlamaForCausalLM as the target.
"""
from __future__ import annotations

import torch

from ..decoding.protocol import Proposal
from ..errors import SpecdecError
from ..heads.block import check_head_fits
from ..lm.device import placement
from ..lm.kv_cache import cache_for
from .base import draw, with_alternatives
from .eagle import EagleProposer, EagleState


class BlockProposer(EagleProposer):
    name = "block"
    trees = True

    drafter = "block head"
    fits = staticmethod(check_head_fits)

    def runs_natively(self) -> bool:
        return False  # its step (context positions, then the masks) is not yet one kernel call

    @property
    def max_depth(self) -> int:
        """The block it was trained for: the most drafts one forward gives."""
        return self.head.block

    def start(self, max_len, k, capacity, nodes=None) -> EagleState:
        if not 1 <= k <= self.head.block:
            raise SpecdecError(f"this block head drafts 1..{self.head.block} tokens per step (the block it was "
                               f"trained for), but k={k} was asked: use -k 1..{self.head.block}, or train a head "
                               f"with a longer block (--block-size)")
        cfg, head, (device, dtype) = self.target.config, self.head, placement(self.target)
        # the longest row's entries stay below max_len; drafts, masks and padded windows add less than this
        cache = cache_for(len(head.layers), cfg.num_key_value_heads, cfg.head_dim, capacity,
                          max_len + 2 * (k + 1) + head.block, dtype, device)
        cache.regroup([])
        features = torch.zeros(0, 0, cfg.hidden_size * len(self.features), dtype=dtype, device=device)
        return EagleState([], cache, [], features, torch.zeros(0, 0, dtype=torch.long, device=device), [])

    def block_logits(self, state: EagleState, drafts: int) -> torch.Tensor:
        """The one head forward of a step: feeds the pending positions with the masks, keeps the
        pending ones in the cache, and returns the logits (B, drafts, N) of block slots 0..drafts-1
        over the draft vocabulary (module docstring)."""
        head, cache, device = self.head, state.cache, state.ahead.device
        B, W = state.ahead.shape
        M = head.masks_for(drafts)
        n = torch.tensor(state.lengths, device=device)                                   # (B,) real pending
        steps = torch.arange(W + M, device=device)
        start = cache.lengths[:, None]                                                   # (B, 1)
        positions = torch.where(steps < W, start + steps, start + n[:, None] - 1 + steps - W + 1)  # (B, W+M)
        visible = steps[:, None] >= steps[None, :]                                        # (W+M, W+M) causal
        if not head.causal:
            visible[W:, W:] = True                                                        # the whole block
        visible = visible[None].repeat(B, 1, 1)
        visible[:, W:, :W] = steps[None, None, :W] < n[:, None, None]                    # masks: the real pending
        x = torch.cat([head.encode(self.target.token_embeddings(state.ahead), state.features),
                       head.mask_inputs(B, M)], 1)                                       # (B, W+M, C)
        h = head(x, head.window(positions.clamp(max=self.context - 1), visible, cache))  # (B, W+M, C)
        slots = torch.cat([(n.clamp(min=1) - 1)[:, None],                                 # (B, drafts)
                           W + torch.arange(drafts - 1, device=device)[None].expand(B, -1)], 1)
        out = h.gather(1, slots[..., None].expand(-1, -1, h.shape[2]))                   # (B, drafts, C)
        state.committed = [c + w for c, w in zip(state.committed, state.lengths)]
        cache.rollback(state.committed)  # the padding and the masks dropped
        state.fed = True
        return head.logits(out, self.vocab.unembedding)

    def propose(self, state: EagleState, limits, widths, draws) -> Proposal:
        limit = limits.tolist()
        if not self.drafts(state, limit):
            return Proposal.empty(len(limit), limits.device)
        m, device = max(limit), limits.device
        logits = self.block_logits(state, m)                                             # (B, m, N)
        probs, tokens, scores = zip(*(draw(logits[:, j], state.samplings, draws, j, self.vocab, self.vocab_size)
                                      for j in range(m)))
        # a one-token prompt has no features yet: no drafts
        lengths = torch.tensor([lim if n > 0 else 0 for lim, n in zip(limit, state.lengths)], device=device)
        probs = None if probs[0] is None else torch.stack(probs, 1)
        return with_alternatives(Proposal(torch.stack(tokens, 1), lengths, probs), list(scores), widths, self.vocab,
                                 self.vocab_size)
