"""What proposers share beyond the protocol (decoding/protocol.py): drafting over a draft
vocabulary (heads/vocabulary.py) and drawing tokens with `draw`, so that every proposer that drafts
from logits shares one definition of both; chains and trees grown from logits; per-row settings;
the rows of target features and tokens a head has yet to read (MTP heads, EAGLE), kept ragged.

This module knows nothing about particular proposers, verification or stopping.
"""
from __future__ import annotations

import itertools

import torch

from ..decoding.protocol import Proposal
from ..decoding.sampling import Draws, SamplingConfig, argmax, of_rows, row_probabilities, sample
from ..decoding.tree import caterpillar_layout
from ..lm.interface import next_positions, pad_right
from ..heads.vocabulary import DraftVocabulary

# The most pending tokens of a row a drafter with its own KV cache feeds in one forward when it
# catches up (its whole history since it last drafted: a prompt, a stretch of plain steps), so that
# its cache needs FEED entries of room past the longest sequence, whatever the other rows hold.
FEED = 64


def per_row(sampling: SamplingConfig | list[SamplingConfig], rows: int) -> list[SamplingConfig]:
    """`start`'s sampling argument as one setting per row."""
    return list(sampling) if isinstance(sampling, (list, tuple)) else [sampling] * rows


def catch_up(model, context: int, state, limit: list[int], keep: int) -> None:
    """Feed each drafting row's (limit[b] > 0) pending tokens but its last `keep` into its draft KV
    cache, at most FEED columns per forward of `model` (of `context` positions); they become committed.
    Rows with as many go in one forward; where they differ and padding would be most of the forward
    (a joined row's prompt beside rows a few tokens behind), each row with tokens to feed goes alone on a
    cache of blocks (its `row`), none padded: a row's numbers are the same either way. `state` has
    `pending` (per row, tokens not yet in the cache), `committed` (per row, the cache's length) and `cache`."""
    device = state.cache.lengths.device
    while True:
        chunks = [p[:max(len(p) - keep, 0)][:FEED] if n else [] for p, n in zip(state.pending, limit)]
        width = max(map(len, chunks), default=0)
        if width == 0:
            return
        if getattr(state.cache, "pool", None) is not None and 2 * sum(map(len, chunks)) < width * len(chunks):
            for b, chunk in enumerate(chunks):
                if chunk:
                    alone = state.cache.row(b)
                    model(torch.tensor([chunk], device=device), positions=next_positions(alone, len(chunk), context),
                          cache=alone, logits_index=torch.zeros(1, 1, dtype=torch.long, device=device))
                    state.cache.put_row(b, alone)
        else:
            window = torch.tensor([c + [0] * (width - len(c)) for c in chunks], device=device)
            model(window, positions=next_positions(state.cache, width, context),
                  cache=state.cache, logits_index=torch.zeros(len(chunks), 1, dtype=torch.long, device=device))
        fed(state, list(map(len, chunks)))


def fed(state, counts: list[int]) -> None:
    """Each row's first counts[b] pending tokens are in its draft KV cache now: they become committed,
    and the cache is rolled back to the committed entries (what a forward wrote past them, padding,
    masks or drafts, is dropped). `state` as `catch_up`'s."""
    for b, n in enumerate(counts):
        state.committed[b] += n
        state.pending[b] = state.pending[b][n:]
    state.cache.rollback(state.committed)


def with_alternatives(proposal: Proposal, scores: list[torch.Tensor], widths: tuple[int, ...],
                      vocab: DraftVocabulary | None, vocab_size: int) -> Proposal:
    """A chain proposal (B, k) turned into the static tree of tree.caterpillar_layout: beside the
    chain's draft at depth d + 1, the widths[d] - 1 best other tokens of that depth's draft logits
    scores[d] (B, N). The alternatives are deterministic (one-hot in draft_probs, which keeps
    multi-draft sampling exact: the residual after the chain's draft does not depend on which
    token was drawn). A row drafting l levels has the nodes of depths <= l."""
    B, k = proposal.tokens.shape
    widths = tuple(widths[:k])
    if all(w == 1 for w in widths):
        return proposal
    parents, chain = caterpillar_layout(widths)
    device = proposal.tokens.device
    tokens = torch.zeros(B, len(parents), dtype=torch.long, device=device)
    tokens[:, chain] = proposal.tokens
    for d, width in enumerate(widths):
        if width > 1:
            best = scores[d].topk(min(width, scores[d].shape[1]), dim=1).indices  # (B, w) draft-vocab ids
            best = best if vocab is None else vocab.ids[best]
            others = [[t for t in row if t != drafted][:width - 1] for row, drafted in
                      zip(best.tolist(), proposal.tokens[:, d].tolist())]
            for j in range(width - 1):  # a vocabulary smaller than the width leaves the last ones 0
                tokens[:, chain[d] + 1 + j] = torch.tensor([row[j] if j < len(row) else 0 for row in others],
                                                           device=device)
    probs = None
    if proposal.draft_probs is not None:
        probs = torch.zeros(B, len(parents), vocab_size, dtype=proposal.draft_probs.dtype, device=device)
        probs.scatter_(2, tokens[..., None], 1.0)
        probs[:, chain] = proposal.draft_probs
    starts = [0, *itertools.accumulate(widths)]
    lengths = torch.tensor([starts[n] for n in proposal.lengths.tolist()], device=device)
    return Proposal(tokens, lengths, probs, torch.tensor(parents, device=device).expand(B, -1).clone())


def grow_tree(root_logits: torch.Tensor, children_logits, widths: tuple[int, ...], limits: list[int],
              vocab: DraftVocabulary | None, samplings: list[SamplingConfig], draws: Draws) -> Proposal:
    """A dynamic draft tree (EAGLE-2): the widths[0] best tokens of root_logits (B, N) open it;
    then, depth by depth, every node of the newest level proposes its widths[d] best children and
    the widths[d] candidates of highest score (the product of the draft probabilities along their
    path) form the next level, wherever they hang. Row b grows limits[b] levels.
    children_logits(tokens (B, n), parents (B, n), frontier (B, f)) returns the draft logits
    (B, f, N) after the frontier nodes (node indices into tokens; padding nodes hang off the root).
    The nodes are deterministic drafts (draft_probs None, one-hot for rejection sampling). A seeded
    row ranks by its perturbed log-probabilities (`Draws`): its best child is the draft it would draw."""
    B, depth, device = root_logits.shape[0], max(limits, default=0), root_logits.device
    if depth == 0:
        return Proposal.empty(B, device)

    def ranked(logits: torch.Tensor, d: int) -> torch.Tensor:  # (B, f, N) -> log-probabilities to rank by
        logp = torch.log_softmax(logits.float(), -1)
        seeded, noisy = draws.scores(logits, samplings, d, None if vocab is None else vocab.ids)
        if seeded:
            logp[torch.tensor(seeded, device=device)] = noisy
        return logp

    tokens = [[] for _ in range(B)]
    parents = [[] for _ in range(B)]
    scores = [[] for _ in range(B)]
    frontier = [[] for _ in range(B)]
    logp = ranked(root_logits[:, None], 0)                                     # (B, 1, N)
    for d in range(depth):
        width = widths[d]
        best = logp.topk(min(width, logp.shape[-1]), dim=-1)                      # (B, f, w)
        ids = best.indices if vocab is None else vocab.ids[best.indices]
        for b in range(B):
            if d >= limits[b]:
                frontier[b] = []
                continue
            at = frontier[b] if d else [-1]
            base = [scores[b][i] if i >= 0 else 0.0 for i in at]
            candidates = sorted(((base[f] + v, t, at[f]) for f in range(len(at))
                                 for v, t in zip(best.values[b, f].tolist(), ids[b, f].tolist())), reverse=True)
            frontier[b] = []
            for score, token, parent in candidates[:width]:
                frontier[b].append(len(tokens[b]))
                tokens[b].append(token)
                parents[b].append(parent)
                scores[b].append(score)
        if d + 1 < depth:
            n, f = max(map(len, tokens)), max(map(len, frontier))
            logp = ranked(children_logits(
                torch.tensor([t + [0] * (n - len(t)) for t in tokens], device=device),
                torch.tensor([p + [-1] * (n - len(p)) for p in parents], device=device),
                torch.tensor([fr + [0] * (f - len(fr)) for fr in frontier], device=device)), d + 1)  # (B, f, N)
    return Proposal.from_rows(tokens, parents, device)


def draw(logits: torch.Tensor, samplings: list[SamplingConfig], draws: Draws, depth: int,
         vocab: DraftVocabulary | None, vocab_size: int) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """Draft logits (B, N) (N = V without a draft vocabulary) at depth `depth` (0-based) -> the
    distribution each row's draft is drawn from under its own sampling settings, over the full
    vocabulary (B, V), the drawn target ids (B,), and the scores (B, N) that rank a depth's
    alternatives (with_alternatives): the logits, a seeded row's perturbed by its noise, so that its
    draft is their argmax (`Draws`). The distribution is None where no row is sampled without a seed
    (greedy verification, and a seeded row's, greedy on its perturbed log-probabilities, read none);
    a greedy or seeded row among ones sampled without a seed gets its own (one-hot for a greedy row).
    Under a grammar (draws.grammar) the logits are first masked to each row's grammar after its
    drafts so far, and the drafts drawn move it on: depths are drawn once each, in order."""
    ids = None if vocab is None else vocab.ids
    if draws.grammar is not None:
        logits = draws.grammar.masked(logits, depth, ids)
    p, scores = None, logits
    if all(cfg.greedy for cfg in samplings):
        token = argmax(logits)
    else:
        token = argmax(logits)  # a greedy row's
        seeded, noisy = draws.scores(logits, samplings, depth, ids)
        coupled = set(seeded)
        drawn = [b for b, cfg in enumerate(samplings) if not cfg.greedy and b not in coupled]
        if drawn:  # sampled rows without a seed: one draw each from the generator
            p = row_probabilities(logits, samplings)
            index = torch.tensor(drawn, device=logits.device)
            token[index] = sample(p[index], of_rows(draws.generator, drawn)).to(token.device)
        if seeded:
            index = torch.tensor(seeded, device=logits.device)
            token[index] = argmax(noisy).to(token.device)
            scores = noisy if len(seeded) == len(samplings) else logits.float().index_copy(0, index, noisy)
        if p is not None and vocab is not None:
            p = p.new_zeros(p.shape[0], vocab_size).index_copy_(1, vocab.ids, p)
    token = token if vocab is None else vocab.ids[token]
    if draws.grammar is not None:
        draws.grammar.took(token, depth)
    return p, token, scores


def draft_chain(logits: torch.Tensor, steps: int, advance, samplings: list[SamplingConfig], draws: Draws,
                vocab: DraftVocabulary | None, vocab_size: int, feed=None, stop_below: float | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None, list[torch.Tensor]]:
    """Draft `steps` tokens one after another: d_1 is drawn (`draw`) from logits (B, N), and
    advance(j, d_{j+1}) returns the logits (B, N) draft j+2 is drawn from. Under a grammar, with
    feed(tokens (B, n)) -> the logits (B, N) after them (a drafter that reads several tokens in one
    forward), the run of tokens the rows' grammars force after a draft (guided.DraftGrammar.forced_run)
    is taken as it is, without a forward or a draw per token (its distributions one-hot, as drawn
    under the mask), and fed with that draft; the chain's last draft is always drawn. Returns the
    drafts (B, s), the distributions they were drawn from (B, s, V) or None (all rows greedy), and
    each step's scores (`draw`; those of base.with_alternatives). s = steps, or fewer with
    `stop_below`: the chain stops after a draft whose logits' top probability (at temperature 1)
    is below it in every row (the draft unsure of what comes next; whether it drafts on depends on
    the draft alone, so verification stays exact)."""
    tokens, probs, scores = [], [], []
    while len(tokens) < steps:
        j = len(tokens)
        p, token, score = draw(logits, samplings, draws, j, vocab, vocab_size)  # (B, V) or None, (B,), (B, N)
        tokens.append(token)
        probs.append(p)
        scores.append(score)
        if stop_below is not None and float(torch.softmax(logits.float(), -1).amax(-1).max()) < stop_below:
            break
        run = None if feed is None or draws.grammar is None else draws.grammar.forced_run(j + 1, steps - j - 2)
        if run is not None:
            run = torch.tensor(run, device=token.device)                        # (B, r)
            for forced in run.unbind(1):
                tokens.append(forced)
                probs.append(None if p is None else torch.nn.functional.one_hot(forced, vocab_size).to(p.dtype))
                scores.append(torch.full_like(score, float("-inf")))
            logits = feed(torch.cat([token[:, None], run], 1))
        elif j + 1 < steps:
            logits = advance(j, token)
    return torch.stack(tokens, 1), None if probs[0] is None else torch.stack(probs, 1), scores


def draw_block(logits: torch.Tensor, samplings: list[SamplingConfig], draws: Draws, vocab: DraftVocabulary | None,
               vocab_size: int) -> tuple[torch.Tensor, torch.Tensor | None, list[torch.Tensor]]:
    """A parallel drafter's block: logits (B, m, N) of m slots from one forward -> the drafts (B, m),
    each drawn from its own slot's distribution without seeing the others (`draw`, slot j at depth
    j), those distributions (B, m, V), or None when every row is greedy (one argmax over the whole
    block, without a grammar), and each slot's scores (`draw`)."""
    if all(cfg.greedy for cfg in samplings) and draws.grammar is None:
        token = argmax(logits)
        return token if vocab is None else vocab.ids[token], None, list(logits.unbind(1))
    drawn = [draw(slot, samplings, draws, j, vocab, vocab_size) for j, slot in enumerate(logits.unbind(1))]
    probs = None if drawn[0][0] is None else torch.stack([p for p, _, _ in drawn], 1)
    return torch.stack([token for _, token, _ in drawn], 1), probs, [score for _, _, score in drawn]


# --- the per-row target features and tokens a head has yet to read (MTP heads, EAGLE) ---

def joined_pending(features: torch.Tensor, ahead: torch.Tensor, lengths: list[int], prompts: list[list[int]],
                   prompt_hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """A head's pending target features (B, W, nC), the token after each of their positions (B, W)
    and the real positions per row (B,), with rows for new `prompts` after them: the prompt's
    features prompt_hidden (n, P-1, nC), each followed by the prompt's next token."""
    after, _ = pad_right([p[1:] for p in prompts], device=ahead.device)  # (n, P-1)
    return (stack_rows(features, prompt_hidden.to(features.dtype)), stack_rows(ahead, after),
            lengths + [len(p) - 1 for p in prompts])


def appended_pending(features: torch.Tensor, ahead: torch.Tensor, lengths: list[int], drop: list[int],
                     outcome) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """The pending features, tokens and lengths (as `joined_pending`) after a step: each row's first
    drop[b] positions dropped (the head has read them), then the features outcome.hidden
    (B, m+1, nC) over [last, drafts] of its outcome.counts[b] emitted tokens, each followed by the
    token it predicted."""
    tokens = torch.tensor(outcome.tokens, device=ahead.device)  # (B, m+1)
    index, lengths = ragged_concat_index(features.shape[1], tokens.shape[1], lengths, drop, outcome.counts,
                                         tokens.device)
    return (gather_rows(torch.cat([features, outcome.hidden.to(features.dtype)], 1), index),
            gather_rows(torch.cat([ahead, tokens], 1), index), lengths)


def ragged_concat_index(old_width: int, new_width: int, old_len: list[int], drop: list[int],
                        new_len: list[int], device: torch.device) -> tuple[torch.Tensor, list[int]]:
    """Columns of cat([old, new], 1) that give row b old[b, drop[b]:old_len[b]] then
    new[b, :new_len[b]], left-aligned and right-padded (padding: any column): (B, W'), lengths."""
    total = [n - d + m for n, d, m in zip(old_len, drop, new_len)]
    width, last = max(total), old_width + new_width - 1
    index = [[min(d + c if c < n - d else old_width + c - (n - d), last) for c in range(width)]
             for n, d in zip(old_len, drop)]
    return torch.tensor(index, device=device).view(len(total), width), total


def stack_rows(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """(B, W, ...) and (n, W', ...) -> (B + n, max(W, W'), ...), each right-padded with zeros."""
    width = max(old.shape[1], new.shape[1])
    pad = [(0, 0)] * (old.dim() - 2)
    return torch.cat([torch.nn.functional.pad(t, [x for p in pad for x in p] + [0, width - t.shape[1]])
                      for t in (old, new)])


def gather_rows(both: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """both (B, W, ...) -> (B, W', ...) the columns index (B, W') of each row."""
    return both.gather(1, index.view(*index.shape, *[1] * (both.dim() - 2)).expand(-1, -1, *both.shape[2:]))
