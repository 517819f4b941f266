"""An EAGLE-3 head as the draft (heads/eagle.py): it drafts from the target's features, which the engine
hands over because the proposer declares them (`features`: the head's layer ids).

Alignment. The sequence is x_0..x_T (x_T the newest token, not yet in the target's cache), so the
target's features are known at positions 0..T-1, and f_{T-1} is the one that predicted x_T. The
head's KV cache holds its entries for the positions it has read with target features; the
positions since ("pending": features f_t and tokens x_{t+1}, at least the newest) are fed at the
next proposal, whose last output drafts d_1 = x_{T+1}. Each further draft is one head step on its
own output and the token it just drafted (d_j at position T-1+j), written into the cache after the
committed entries. After verification those draft entries are dropped (the cache is rolled back to
the committed part): the accepted positions come back with the target's own features and are fed
at the next proposal, as in EAGLE. So it drafts any k, one decoder-layer step per draft.

Drafts are drawn from the head's distribution after the same sampling transform as the target
(sampling.probabilities) over its draft vocabulary (base.draw), and those distributions are
returned as draft_probs, so rejection sampling stays lossless; greedy drafts its argmax. With
`draft_vocab=M` the head drafts over only the M of its ids most frequent in its training tokens
(those rows of its unembedding): a cheaper unembedding, still lossless (the draft's probability
is 0 elsewhere), acceptance tells what it loses.

Works at any batch size, with specdec's LlamaForCausalLM as the target (the head shares its
embedding and reads its decoder layers' outputs).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..decoding.protocol import Outcome, Proposal
from ..decoding.sampling import SamplingConfig
from ..errors import SpecdecError
from ..heads.eagle import EagleHead, check_head_fits
from ..lm.device import placement
from ..lm.interface import abilities, next_positions
from ..lm.kv_cache import KVCache, cache_for
from ..lm.model import LlamaForCausalLM
from ..heads.vocabulary import DraftVocabulary, linear_rows
from .base import appended_pending, draft_chain, joined_pending, with_alternatives


@dataclass
class EagleState:
    samplings: list[SamplingConfig]  # per row
    cache: KVCache          # the head's: lengths (B,) = entries read with target features (during a
                            # proposal, plus its drafts)
    committed: list[int]    # (B,) those entries, kept on the host
    features: torch.Tensor  # (B, W, nC) pending target features, right-padded
    ahead: torch.Tensor     # (B, W) the token after each pending position
    lengths: list[int]      # (B,) pending positions per row
    fed: bool = False       # did the last proposal feed the pending positions into the cache?


class EagleProposer:
    """Static trees (widths > 1): the chain it drafts, with the next-best tokens of each step beside
    it (base.with_alternatives)."""
    name = "eagle"
    trees = True
    max_depth = None  # its own output feeds the next step: any depth

    drafter = "EAGLE head"                  # what the messages call the head
    fits = staticmethod(check_head_fits)  # refuses a head built for another target

    def __init__(self, head: EagleHead, target: LlamaForCausalLM, draft_vocab: int | None = None):
        if not abilities(target).layers:
            raise SpecdecError(f"an {self.drafter} drafts from specdec's own LlamaForCausalLM target, not "
                               f"{type(target).__name__}")
        self.fits(head, target)
        self.head, self.target = head, target
        self.features = head.layer_ids  # declared once: the engine hands these layers' outputs over
        self.vocab_size = target.config.vocab_size
        self.context = target.config.max_position_embeddings
        counts = None if head.token_counts is None else head.token_counts[head.draft_ids.cpu()]  # of its own ids
        ids = DraftVocabulary.ids_for(
            draft_vocab, head.draft_vocab_size, counts,
            f"this {self.drafter} was saved without its training token counts, so no smaller draft vocabulary can "
            "be chosen: draft over its own, or retrain it with this version of specdec", head.draft_ids.device)
        self.vocab = (DraftVocabulary.trained(head.draft_ids, head.lm_head) if ids is None else  # rows of its own
                      DraftVocabulary.trained(head.draft_ids[ids], linear_rows(head.lm_head, ids)))
        self.native = self.runs_natively()

    def runs_natively(self) -> bool:
        """Decided once: each step as one kernel call, where the head's layer runs as one and its
        matrices are packed."""
        head = self.head
        return ((head.layout == "eagle3" or head.proj.stored is not None)
                and self.vocab.unembedding.stored is not None and self.target.drafts_in_one_call(head))

    def native_step(self, ahead, prev, cache, positions, columns):
        """The head's step as ONE kernel call (LlamaForCausalLM.draft_block): ahead (B, W) tokens, prev
        (B, W, C) g or its own output -> (argmax, logits (B, m, N), output (B, m, C)) at columns (B, m)."""
        return self.target.draft_block(ahead, cache, positions, columns, self.vocab.unembedding.stored, self.vocab.ids,
                                       True, head=self.head, prev=prev)

    @property
    def draft_ids(self) -> torch.Tensor:
        """(N,) the token ids drafted over."""
        return self.vocab.ids

    def start(self, max_len, k, capacity, nodes=None) -> EagleState:
        if k < 1:
            raise SpecdecError(f"an EAGLE head drafts k >= 1 tokens per step, got k={k}: use k >= 1 (k = 0 is "
                               "plain decoding: leave out the draft)")
        cfg, (device, dtype) = self.target.config, placement(self.target)
        # the longest row's entries stay below max_len; a window pads every row to the widest pending
        # stretch (a prompt, the plain steps since the head last drafted: < max_len) and drafts add < 2 (k + 1);
        # one layer's entries: the room costs little
        cache = cache_for(1, cfg.num_key_value_heads, cfg.head_dim, capacity, 2 * max_len + 2 * (k + 1), dtype, device)
        cache.regroup([])
        features = torch.zeros(0, 0, cfg.hidden_size * len(self.features), dtype=dtype, device=device)
        return EagleState([], cache, [], features, torch.zeros(0, 0, dtype=torch.long, device=device), [])

    def join(self, state: EagleState, prompts, prompt_hidden, samplings) -> None:
        """New rows: their prompts' features are pending (read with their first proposal)."""
        if not prompts:
            return
        state.cache.regroup(list(range(len(state.committed))), empty=len(prompts))
        state.samplings += samplings
        state.committed += [0] * len(prompts)
        state.features, state.ahead, state.lengths = joined_pending(state.features, state.ahead, state.lengths,
                                                                    prompts, prompt_hidden)

    def leave(self, state: EagleState, keep: list[int]) -> None:
        state.cache.regroup(keep)
        index = torch.tensor(keep, dtype=torch.long, device=state.ahead.device)
        state.features, state.ahead = state.features[index], state.ahead[index]
        state.samplings, state.committed, state.lengths = ([rows[b] for b in keep] for rows in (
            state.samplings, state.committed, state.lengths))

    def drafts(self, state: EagleState, limit: list[int]) -> bool:
        """A proposal's start: whether any row drafts and features are pending (none before a
        prompt's second token)."""
        state.fed = False
        return max(limit) > 0 and state.features.shape[1] > 0

    def propose(self, state: EagleState, limits, widths, draws) -> Proposal:
        limit = limits.tolist()
        if not self.drafts(state, limit):
            return Proposal.empty(len(limit), limits.device)
        B, m, W, device = len(limit), max(limit), state.features.shape[1], limits.device
        head, embed = self.head, self.target.token_embeddings
        positions = next_positions(state.cache, W, self.context)
        last = torch.tensor([max(n, 1) - 1 for n in state.lengths], device=device)[:, None]  # (B, 1)
        if self.native:  # the head over the pending positions, its norm and unembedding at the last: one call
            _, logits, prev = self.native_step(state.ahead, head.fuse(state.features), state.cache, positions, last)
        else:
            h = head(embed(state.ahead), head.fuse(state.features), head.window(positions, state.cache, W))  # (B, W, C)
            prev = h.gather(1, last[..., None].expand(B, 1, h.shape[2]))                                    # (B, 1, C)
            logits = head.logits(prev[:, 0], self.vocab.unembedding)
        state.committed = [n + w for n, w in zip(state.committed, state.lengths)]
        state.cache.rollback(state.committed)
        state.fed = True
        first = torch.zeros(B, 1, dtype=torch.long, device=device)

        def advance(j, token):  # d_{j+2} from position T+j: the draft just made, its own output as the feature
            nonlocal prev
            positions = next_positions(state.cache, 1, self.context)
            if self.native:
                _, logits, prev = self.native_step(token[:, None], prev, state.cache, positions, first)
                return logits[:, 0]
            prev = head(embed(token[:, None]), prev, head.window(positions, state.cache, 1))
            state.cache.advance(1)
            return head.logits(prev[:, 0], self.vocab.unembedding)

        tokens, probs, scores = draft_chain(logits.reshape(B, -1), m, advance, state.samplings, draws,
                                            self.vocab, self.vocab_size)
        # a one-token prompt has no features yet: no drafts
        lengths = torch.tensor([lim if n > 0 else 0 for lim, n in zip(limit, state.lengths)], device=device)
        return with_alternatives(Proposal(tokens, lengths, probs), scores, widths, self.vocab, self.vocab_size)

    def observe(self, state: EagleState, outcome: Outcome) -> None:
        """outcome.hidden (B, m+1, nC): the declared features over [last, drafts]; the first counts[b]
        predicted the emitted tokens, which become pending (after the unfed ones, if any)."""
        state.cache.rollback(state.committed)  # drop the draft entries
        drop = list(state.lengths) if state.fed else [0] * len(state.lengths)
        state.features, state.ahead, state.lengths = appended_pending(state.features, state.ahead, state.lengths,
                                                                      drop, outcome)
        state.fed = False  # consumed: a plain stretch's outcome follows no proposal
