"""A separate, smaller causal LM drafts tokens autoregressively with its own KV cache.

Drafts are drawn with the same sampling transform (temperature, top-k, top-p) as the target, and
their distributions are returned as draft_probs for rejection sampling. The draft's cache holds
the committed sequence except the tokens committed since its last proposal ("pending": at least
the newest one); a proposal feeds the pending tokens and then its own drafts 1..m-1, and after
verification the cache is rolled back to the committed part, keeping the accepted drafts.

Works with specdec's LlamaForCausalLM at any batch size and with a transformers causal LM at
batch size 1 (see lm/interface.py). It needs the target's token ids (same tokenizer); the engine checks
the vocabulary sizes agree.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..decoding.costmodel import VerifyCurve, predicted_speedup
from ..decoding.protocol import Outcome, Proposal
from ..decoding.sampling import SamplingConfig
from ..decoding.tree import caterpillar_layout, on_chain, window_layout
from ..errors import SpecdecError
from ..heads.vocabulary import DraftVocabulary
from ..lm.device import placement
from ..lm.interface import body_size, causal_lm, context_length, next_positions
from ..lm.kv_cache import KVCache
from ..lm.model import Linear
from .base import FEED, catch_up, draft_chain, fed, grow_tree, with_alternatives


# The acceptance `chosen_vocab` assumes of a draft over the full vocabulary (adaptive.PRIOR's optimism
# would favour long chains; the Qwen2.5-Coder pair measures 0.7 to 0.8 per draft on code)
VOCAB_ALPHA = 0.75
VOCAB_HALVINGS = 9  # the sizes weighed: V, V/2, ... V/256 ids


def chosen_vocab(draft, target, token_counts: torch.Tensor) -> int | None:
    """The draft vocabulary the cost model favours for `draft` drafting for `target` (None: the full
    one), by the bytes each forward reads: a draft step reads the draft's matrices, its unembedding
    in proportion to the N rows kept; a verification reads the target's (decoding at batch 1 is
    bound by them: the verify curve taken flat). A draft over N ids proposes a token outside them
    never, so each draft is accepted with VOCAB_ALPHA times the share of the counted tokens the N
    hold. Predicted speedup (costmodel.predicted_speedup) at the best chain length up to 8, for N
    among V, V/2, ... (VOCAB_HALVINGS sizes): the N of the highest."""
    V = draft.config.vocab_size
    head = draft.lm_head.stored.nbytes if draft.lm_head.stored is not None else draft.lm_head.weight.nbytes
    body = stored_bytes(draft) - head
    curve = VerifyCurve({1: float(stored_bytes(target)), 9: float(stored_bytes(target))})
    share = token_counts.double().sort(descending=True).values.cumsum(0) / token_counts.sum().double()

    def speedup(n: int) -> float:
        alpha = VOCAB_ALPHA * float(share[n - 1])
        return max(predicted_speedup([alpha] * k, k * (body + head * n / V), curve) for k in range(1, 9))

    best = max((max(V >> i, 1) for i in range(VOCAB_HALVINGS)), key=speedup)
    return None if best == V else best


def stored_bytes(model) -> int:
    """The bytes of a model's matrices as its forward reads them (stored, else its float weights)."""
    return sum(m.stored.nbytes if m.stored is not None else m.weight.nbytes
               for m in model.modules() if isinstance(m, Linear))


@dataclass
class DraftState:
    cache: object
    samplings: list[SamplingConfig]  # per row
    pending: list[list[int]]  # per row: committed tokens not yet in the draft cache (at least the newest)
    committed: list[int]      # per row: cache entries holding committed tokens only
    fed_drafts: int = 0       # drafts of the last proposal written into the cache after `committed`
    chain: list[int] | None = None  # the last proposal's chain nodes when it was a tree
    shared: bool = False      # the cache is the target's (`start`'s target_cache): pending is each row's newest
    # token, and `committed` is read from the cache's lengths at each proposal (the engine moves them between)


class DraftModelProposer:
    """Trees (widths > 1): static ones, the chain it drafts with the next-best tokens of each step
    beside it (base.with_alternatives), or dynamic ones (tree="dynamic", EAGLE-2: base.grow_tree),
    every level of the tree so far fed in one draft forward with a tree mask."""
    name = "draft-model"
    trees = True
    max_depth = None
    features = ()  # none read; the engine's default
    prompt_features = False  # joins without reading prompt_hidden

    def __init__(self, model, draft_vocab: int | None = None, token_counts: torch.Tensor | None = None,
                 tree: str = "static", stop_below: float | None = None):
        """draft_vocab N: draft over the N most frequent token ids of `token_counts` (V,) — the
        counts of the training tokens, saved with the draft — through an unembedding of N rows
        instead of V. Lossless: the draft's probability is 0 outside them, which rejection sampling
        accounts for; it only lowers the draft's cost. tree: "static" or "dynamic" (see above).
        stop_below: a chain ends early after a draft whose top probability is below it
        (base.draft_chain; None: always the depth asked for)."""
        if tree not in ("static", "dynamic"):
            raise SpecdecError(f"a draft model's trees are static or dynamic, not {tree!r}")
        if stop_below is not None and not 0 < stop_below < 1:
            raise SpecdecError(f"stop_below is a probability between 0 and 1 (exclusive), got {stop_below}")
        self.tree, self.stop_below = tree, stop_below
        self.model = causal_lm(model, role="draft model")
        self.vocab_size = self.model.config.vocab_size
        self.reading_size = body_size(self.model)
        self.context = context_length(self.model)
        ids = DraftVocabulary.ids_for(
            draft_vocab, self.vocab_size, token_counts,
            "this draft model was saved without the token counts of its training data, so no draft "
            "vocabulary can be chosen: draft over the full vocabulary, or add them (checkpoint.save_token_counts)",
            placement(self.model).device)
        if ids is not None and not self.model.abilities.draft_vocab:
            raise SpecdecError("a draft vocabulary needs specdec's own LlamaForCausalLM as the draft model")
        self.vocab = None if ids is None else DraftVocabulary(ids, self.model.lm_head)

    @property
    def draft_ids(self) -> torch.Tensor | None:
        """(N,) the token ids drafted over; None: all V."""
        return None if self.vocab is None else self.vocab.ids

    def start(self, max_len, k, capacity, nodes=None, target_cache: KVCache | None = None) -> DraftState:
        """target_cache: the target's own KV cache, for a draft whose layers have the target's shapes
        (`reads_target_cache`): the draft attends to the target's keys and values of everything
        committed, writes only those of the tokens it feeds (each row's newest, then its drafts) past
        the rows' lengths, where the verification writes the target's own, and leaves the lengths as
        it found them. It then has no cache, no prefill and no catch-up of its own."""
        if max_len - 1 > self.context:
            raise SpecdecError(f"the draft model's context ({self.context} tokens) is shorter than the "
                               f"{max_len - 1} positions this generation needs: shorten the prompt or "
                               "max_new_tokens, or use a draft model with a longer context")
        if target_cache is not None:
            cfg, store = self.model.config, target_cache.pool.store
            if (store.shape[2], store.shape[3], store.shape[5]) != (cfg.num_hidden_layers, cfg.num_key_value_heads,
                                                                    cfg.head_dim):
                raise SpecdecError("this draft's layers do not have the target's shapes, so it cannot read the "
                                   "target's cache: build the self-draft from the target it drafts for")
            return DraftState(target_cache, [], [], [], shared=True)
        cache = self.new_cache(capacity, max_len, k, nodes)
        cache.regroup([])
        return DraftState(cache, [], [], [])

    def new_cache(self, rows: int, max_len: int, k: int, nodes: int | None) -> KVCache:
        # room past the longest sequence: a catch-up window of FEED tokens (padded for the other rows),
        # k + 1 drafts, a dynamic tree's nodes after the committed tokens
        return self.model.new_cache(rows, max_len + max(FEED, k, nodes or 0) + 1)

    def join(self, state: DraftState, prompts, prompt_hidden, samplings) -> None:
        """New rows start empty, their whole prompt pending: the draft reads it with its first
        proposal (one forward), so a generation that never drafts (k=auto choosing plain
        decoding) never pays the draft's prefill."""
        if not prompts:
            return
        state.samplings += samplings
        if state.shared:  # the engine has prefilled the target's cache with each prompt but its last token
            state.pending += [[p[-1]] for p in prompts]
            state.committed += [len(p) - 1 for p in prompts]
            return
        state.cache.regroup(list(range(len(state.pending))), empty=len(prompts))
        state.pending += [list(p) for p in prompts]
        state.committed += [0] * len(prompts)

    def leave(self, state: DraftState, keep: list[int]) -> None:
        if not state.shared:  # the target's cache is regrouped by the engine
            state.cache.regroup(keep)
        state.samplings, state.pending, state.committed = ([rows[b] for b in keep] for rows in (
            state.samplings, state.pending, state.committed))

    def forward(self, tokens: torch.Tensor, cache, logits_index=None) -> torch.Tensor:
        """Logits (B, N) at the last position (or logits_index (B, 1)) over the draft vocabulary."""
        extra = {} if self.vocab is None else {"unembedding": self.vocab.unembedding}
        out = self.model(tokens, positions=next_positions(cache, tokens.shape[1], self.context), cache=cache,
                         logits_index=logits_index, **extra)
        return out.logits[:, -1]

    def unread(self, state: DraftState) -> list[int]:
        """Per row, the committed tokens its next proposal for the row reads before its own (protocol.py)."""
        return [max(len(p) - 1, 0) for p in state.pending]

    def pending_window(self, state: DraftState, limit: list[int]) -> list[int] | None:
        """A proposal's start: None where no row drafts; else the pending tokens each row feeds with
        this proposal's window (the older ones fed first, when more than FEED: catch_up): a drafting
        row's, none of a row that drafts nothing (it keeps them pending, and the window is as wide as
        the drafting rows need: a row a hybrid's lookup drafts for may hold a long stretch unread)."""
        state.fed_drafts, state.chain = 0, None
        if max(limit) == 0:
            return None
        # every drafting row left with as many pending tokens as the one with fewest (at most FEED): the
        # window that feeds them and drafts pads none
        keep = max(1, min(FEED, min(len(p) for p, n in zip(state.pending, limit) if n)))
        catch_up(self.model, self.context, state, limit, keep)
        return [len(p) if n else 0 for p, n in zip(state.pending, limit)]

    def propose(self, state: DraftState, limits, widths, draws) -> Proposal:
        if not state.shared:
            return self.draft(state, limits, widths, draws)
        pending, lengths = [list(p) for p in state.pending], list(state.cache.held)
        state.committed = list(lengths)
        proposal = self.draft(state, limits, widths, draws)
        # the target's cache as the draft found it: the verification writes [newest, drafts] there itself
        state.pending, state.committed, state.fed_drafts, state.chain = pending, lengths, 0, None
        state.cache.rollback(lengths)
        return proposal

    def draft(self, state: DraftState, limits, widths, draws) -> Proposal:
        """`propose` on the draft's own cache, or on the target's as `propose` restores it after."""
        limit = limits.tolist()
        B, m, lengths = len(limit), max(limit), self.pending_window(state, limit)
        if lengths is None:
            return Proposal.empty(B, limits.device)
        width = max(lengths)
        # the window (B, W) and, where it is wider than 1, each row's last position (B, 1): one copy
        both = torch.tensor([p[:n] + [0] * (width - n) + [max(n - 1, 0)] for p, n in zip(state.pending, lengths)],
                            device=limits.device)
        window, last = both[:, :width], (both[:, width:] if width > 1 else None)
        logits = self.forward(window, state.cache, last)
        fed(state, [n if lim else 0 for n, lim in zip(lengths, limit)])
        if self.tree == "dynamic" and max(widths[:m]) > 1:
            return grow_tree(logits, lambda *tree: self.tree_logits(state, *tree), tuple(widths), limit, self.vocab,
                             state.samplings, draws)
        tokens, probs, scores = draft_chain(logits, m, lambda j, token: self.forward(token[:, None], state.cache),
                                            state.samplings, draws, self.vocab, self.vocab_size,
                                            feed=lambda window: self.forward(window, state.cache),
                                            stop_below=self.stop_below)
        drafted = tokens.shape[1]  # m, or fewer where the draft stopped unsure (stop_below)
        state.fed_drafts = drafted - 1
        proposal = with_alternatives(Proposal(tokens, limits.clamp(max=drafted), probs), scores, widths, self.vocab,
                                     self.vocab_size)
        if proposal.parents is not None:
            state.chain = caterpillar_layout(tuple(widths[:drafted]))[1]
        return proposal

    def tree_logits(self, state: DraftState, tokens, parents, frontier) -> torch.Tensor:
        """Draft logits (B, f, N) after the frontier nodes of a tree (base.grow_tree): the whole
        tree fed after the committed tokens with its tree mask, then dropped from the cache."""
        B, n = tokens.shape
        # the committed tokens end with the root: depth 1 sits right after them
        positions, mask = window_layout(parents, [n] * B, [c - 1 for c in state.committed], self.context)
        extra = {} if self.vocab is None else {"unembedding": self.vocab.unembedding}
        out = self.model(tokens, positions=positions[:, 1:], cache=state.cache, attention_mask=mask[:, 1:, 1:],
                         logits_index=frontier, **extra)
        state.cache.rollback(state.committed)
        return out.logits

    def observe(self, state: DraftState, outcome: Outcome) -> None:
        if state.shared:  # the target's cache holds what was committed but each row's newest token
            for b, (tokens, emitted) in enumerate(zip(outcome.tokens, outcome.counts)):
                if emitted:
                    state.pending[b] = [tokens[emitted - 1]]
            return
        # accepted drafts already in the cache stay; the rest of the committed tokens become pending
        chained = outcome.accepted if state.chain is None else [
            on_chain(path, state.chain) for path in outcome.paths]  # accepted drafts of the fed chain
        for b, (tokens, n, emitted) in enumerate(zip(outcome.tokens, chained, outcome.counts)):
            kept = min(n, state.fed_drafts, emitted)
            state.committed[b] += kept
            state.pending[b] += tokens[kept:emitted]
        state.cache.rollback(state.committed)
        state.fed_drafts, state.chain = 0, None  # consumed: a plain stretch's outcome follows no proposal
