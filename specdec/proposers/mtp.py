"""MTP heads as the draft ("native" or self-speculative decoding): the target's own MTP heads
(heads/mtp.py) draft from the target's final hidden states, which the engine hands over.

Alignment. The sequence is x_0..x_T (x_T the newest token, not yet in the target's cache), so the
target's hidden states are known at positions 0..T-1, and h_{T-1} is the one that predicted x_T.
Head j (0-based) at position t predicts x_{t+2+j}, so at position T-1 it drafts d_{j+1} = x_{T+1+j}:
k heads draft k tokens per step, and asking for more is refused (see `start`).

- parallel heads read only h_t: their KV caches hold final entries, one forward per head over the
  positions committed since the last step;
- sequential modules read x_{t+j+1} too: module j at position T-1 reads x_{T+j}, i.e. the draft
  of module j-1, and in general its entries at positions after T-1-j read drafts. Each step
  therefore recomputes a window of positions [F, T-1] with F = T - k (all heads share it), in
  which module j reads the committed tokens and then the drafts d_1..d_j, as in training; after
  verification the caches keep only the entries whose inputs were committed.

Drafts are drawn from the heads' distributions after the same sampling transform as the target
(sampling.probabilities), and those distributions are returned as draft_probs, so rejection
sampling stays lossless and accepts well at temperature > 0 (greedy drafting at temperature > 0
would be lossless too, but accepts only with probability target_probs[d]).

Draft vocabulary. Unembedding is most of a head's cost here (the lm_head has V x C weights, a
head's transformer layer about 5 C^2). With `draft_vocab=N`, heads draft over only the N token
ids most frequent in their training tokens (their lm_head rows, gathered once): the draft
distribution is zero elsewhere, which rejection sampling handles like any other draft
distribution, so the output stays lossless; only drafts the target would have picked outside
those N tokens are lost, and acceptance tells how many.

Works at any batch size, with specdec's LlamaForCausalLM as the target (the heads share its
embedding and lm_head).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..decoding.protocol import Outcome, Proposal
from ..decoding.sampling import SamplingConfig
from ..decoding.tree import caterpillar_layout, on_chain
from ..errors import SpecdecError
from ..heads.mtp import MTPHeads, check_mtp_fits
from ..heads.vocabulary import DraftVocabulary
from ..lm.device import placement
from ..lm.interface import abilities, next_positions
from ..lm.kv_cache import KVCache, cache_for
from ..lm.model import LlamaForCausalLM, frozen_linear
from .base import appended_pending, draft_chain, joined_pending, with_alternatives


@dataclass
class MTPState:
    samplings: list[SamplingConfig]  # per row
    k: int                # heads run per step (the first k)
    cache: KVCache        # layer j: head j; lengths (B,): the window's first position F per row
    first: list[int]      # (B,) F, the cache's lengths before the last proposal wrote (kept on the host)
    hidden: torch.Tensor  # (B, W, C) target hidden states at positions F..T-1, right-padded
    ahead: torch.Tensor   # (B, W) tokens x_{F+1}..x_T, aligned with `hidden`
    lengths: list[int]    # (B,) window length per row, T - F
    written: int = 0      # window columns the last proposal wrote into the cache (0: it ran no head)
    chain: list[int] | None = None  # the last proposal's chain nodes when it was a tree


class MTPProposer:
    """Static trees: the chain the heads draft, with each head's next-best tokens beside it
    (base.with_alternatives)."""
    name = "mtp"
    trees = True
    features = ()  # the target's final hidden states

    def __init__(self, heads: MTPHeads, target: LlamaForCausalLM, draft_vocab: int | None = None):
        if not abilities(target).layers:
            raise SpecdecError(f"MTP heads draft from specdec's own LlamaForCausalLM target, not "
                               f"{type(target).__name__}")
        check_mtp_fits(heads, target)
        self.heads, self.target = heads, target
        self.vocab_size = V = target.config.vocab_size
        self.context = target.config.max_position_embeddings
        ids = DraftVocabulary.ids_for(
            draft_vocab, V, heads.token_counts,
            "these MTP heads were saved without their training token counts, so no draft vocabulary can be "
            "chosen: draft over the full vocabulary, or retrain the heads with this version of specdec",
            placement(target).device)
        self.vocab = None if ids is None else DraftVocabulary(ids, target.lm_head)
        self.unembedding = frozen_linear(target.lm_head.dense()) if ids is None else self.vocab.unembedding

    @property
    def max_depth(self) -> int:
        """The most drafts per step: one per head."""
        return self.heads.depth

    @property
    def draft_ids(self) -> torch.Tensor | None:
        """(N,) the token ids drafted over; None: all V."""
        return None if self.vocab is None else self.vocab.ids

    def start(self, max_len, k, capacity, nodes=None) -> MTPState:
        if k > self.heads.depth:
            raise SpecdecError(f"these {self.heads.kind} heads draft at most {self.heads.depth} tokens per step "
                               f"(one per head), but k={k} was asked: use k <= {self.heads.depth}. (Reusing the "
                               "last head for later positions, as some engines do, drafts tokens it was never "
                               "trained to predict, so their acceptance would collapse.)")
        cfg, (device, dtype) = self.target.config, placement(self.target)
        # positions written stay below max_len + the widest window (every row padded to the widest pending
        # stretch: a prompt, the plain steps since the heads last drafted: < max_len) + 3 (k + 1)
        cache = cache_for(k, cfg.num_key_value_heads, cfg.head_dim, capacity, 2 * max_len + 3 * (k + 1), dtype, device)
        cache.regroup([])
        return MTPState([], k, cache, [], torch.zeros(0, 0, cfg.hidden_size, dtype=dtype, device=device),
                        torch.zeros(0, 0, dtype=torch.long, device=device), [])

    def join(self, state: MTPState, prompts, prompt_hidden, samplings) -> None:
        if not prompts:
            return
        state.cache.regroup(list(range(len(state.first))), empty=len(prompts))
        state.samplings += samplings
        state.first += [0] * len(prompts)
        state.hidden, state.ahead, state.lengths = joined_pending(state.hidden, state.ahead, state.lengths, prompts,
                                                                  prompt_hidden)

    def leave(self, state: MTPState, keep: list[int]) -> None:
        state.cache.regroup(keep)
        width = max((state.lengths[b] for b in keep), default=0)
        index = torch.tensor(keep, dtype=torch.long, device=state.ahead.device)
        state.hidden, state.ahead = state.hidden[index, :width], state.ahead[index, :width]
        state.samplings, state.first, state.lengths = ([rows[b] for b in keep] for rows in (
            state.samplings, state.first, state.lengths))

    def propose(self, state: MTPState, limits, widths, draws) -> Proposal:
        limit = limits.tolist()
        B, m, W, device = len(limit), max(limit), state.hidden.shape[1], limits.device
        state.written, state.chain = 0, None
        if m == 0 or W == 0:
            return Proposal.empty(B, device)
        heads, trunk, k = self.heads, self.target, state.k
        positions = next_positions(state.cache, W, self.context)
        ctx = heads.context(positions, state.hidden.dtype, state.cache, W)
        # (B, 2): the window's last column, then the next
        columns = torch.tensor([[max(n - 1, 0), n] for n in state.lengths], device=device)
        last = columns[:, :1, None].expand(B, 1, state.hidden.shape[2])      # (B, 1, C)
        ahead = torch.cat([state.ahead, state.ahead.new_zeros(B, k)], 1)  # (B, W+k): then drafts at lengths+j
        out = None

        def head_logits(j, prev):  # head j over the window; its logits (B, N) after the window's last column
            nonlocal out
            out = heads.forward_head(j, trunk, prev, ahead[:, j:j + W], ctx)  # (B, W, C)
            return self.unembedding(heads.normed(j, trunk, out.gather(1, last))[:, 0])

        def advance(j, token):  # head j+1 reads the draft head j just made
            ahead.scatter_(1, columns[:, 1:] + j, token[:, None])
            return head_logits(j + 1, heads.next_prev(state.hidden, out))

        # every head writes the window, even beyond m: they share the cache lengths
        tokens, probs, scores = draft_chain(head_logits(0, state.hidden), k, advance, state.samplings, draws,
                                            self.vocab, self.vocab_size)
        state.cache.advance(W)
        state.written = W
        # a one-token prompt has no hidden state yet: no drafts
        lengths = torch.tensor([lim if n > 0 else 0 for lim, n in zip(limit, state.lengths)], device=device)
        probs = None if probs is None else probs[:, :m]
        proposal = with_alternatives(Proposal(tokens[:, :m], lengths, probs), scores, widths, self.vocab,
                                     self.vocab_size)
        if proposal.parents is not None:
            state.chain = caterpillar_layout(tuple(widths[:m]))[1]
        return proposal

    def observe(self, state: MTPState, outcome: Outcome) -> None:
        lookahead = state.k if self.heads.reads_ahead else 0
        keep_to, drop = [], []
        counts = outcome.counts
        # entries read the chain's drafts: past a node off the chain, they read tokens not committed
        valid = counts if state.chain is None else [min(c, on_chain(path, state.chain) + 1)
                                                    for c, path in zip(counts, outcome.paths)]
        for first, n, emitted in zip(state.first, state.lengths, valid):
            end = first + n  # T: the window's end
            # keep entries whose inputs were all committed: every head at positions < T' - lookahead
            # (accepted drafts equal the committed tokens); nothing is kept that was not written
            keep_to.append(max(min(end + emitted - lookahead, end if state.written else first), first))
            drop.append(keep_to[-1] - first)
        state.cache.rollback(keep_to)
        state.first = keep_to
        state.hidden, state.ahead, state.lengths = appended_pending(state.hidden, state.ahead, state.lengths, drop,
                                                                    outcome)
        state.written, state.chain = 0, None  # consumed: a plain stretch's outcome follows no proposal
