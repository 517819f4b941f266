"""The engine's hook for constrained rows (constraint.py): masks at every verified position, drafts
cut where they leave the grammar, and the grammar's forced tokens proposed as free drafts.

Exactness. The target's logits at a window column are masked to the tokens the grammar allows
after [sequence, drafts before it] (-inf elsewhere), then the row's own sampling transform and
acceptance rule run on them: the output is the target's distribution masked and renormalised at
every position, with or without speculation. A draft the grammar refuses has masked probability 0,
so no rule accepts it and the columns after it are never reached; the chain is cut there (saving
their forward) where that changes nothing: the draft was deterministic (its q one-hot, so the
residual after it is the masked target itself) or the row is greedy or seeded (argmax rules). A
sampled draft of a model drafter stays (its residual max(0, p - q) needs it) and the unreachable
columns after it get its column's mask. Trees are masked node by node along each node's path.

Forced drafts. Where the grammar forces a run of tokens (llguidance's fast-forward tokens: the
keys, punctuation and enum tails of a schema), that run replaces the drafter's proposal for the
row: deterministic drafts, verified like any other, so nothing about the distribution changes; the
drafter hears that none of its drafts were accepted and the committed tokens follow (as after a
rejection). Where the drafter's chain already begins with the forced run and goes further, it is
kept as it is. `forced` counts the emitted tokens that their grammar forced, however they were
drafted or picked (`forced_in`: a property of the output, the same for every drafter). A
proposal of forced runs alone (`forced_only`) needs no acceptance decision: each draft is the one
token its grammar allows (masked probability 1), so the engine computes the target's logits only
at the column after each run.

Masked drafts. A drafter that draws from logits (proposers/base.py's `draw`: draft models, the
self-draft, EAGLE and MTP chains, parallel and block drafts) draws under the grammar
(`DraftGrammar`): at each depth its logits are masked to what the row's grammar allows after its
drafts so far and renormalised, so its drafts stay inside the grammar, and the q it reports is the
one it drew from (exact as any q). A drafter that reads several tokens in one forward (a draft
model: base.draft_chain's `feed`) takes a run the grammar forces after a draft as it is, without
a forward or a draw per token (`DraftGrammar.forced_run`). Dynamic trees (EAGLE-2) rank unmasked
nodes: the window masks refuse what they must. A lookup drafter walks the grammar row by row
instead (`row_forced`, `row_take`: proposers/guided_ngram.py splices the forced runs with the
lookup continuations the grammar allows, and the EOS where only the end may come).

A healed prompt's row (pipeline.py) is constrained by its first token's rule alone
(constraint.FirstToken): masked at that token like any grammar, it leaves the guide once the token is
committed, and when no row is left constrained no step spends anything on masks.

The matcher of each row always stands at its committed sequence: the drafts it walks through to
make masks are rolled back before the step ends, and the committed tokens are then consumed.

This module knows nothing about models, proposers or acceptance rules.
"""
from __future__ import annotations

import itertools

import numpy as np
import torch

from ..errors import SpecdecError
from .constraint import Matcher, flags, masked
from .protocol import Joining, Outcome, Proposal
from .tree import chain_parents


class Guide:
    """The constrained rows of the engine's batch, in cache order (None: unconstrained)."""

    def __init__(self, vocab: int, forced_drafts: bool = True):
        self.vocab, self.words, self.forced_drafts = vocab, (vocab + 31) // 32, forced_drafts
        self.matchers: list[Matcher | None] = []
        self.replaced: list[bool] = []     # (B,) rows whose drafts this step are the grammar's forced run
        self.heads: list[list[int] | None] = []  # (B,) the run each row's grammar forces at its sequence, where known
        self.tree = False                  # whether the drafter proposed a tree this step
        self.drafts: DraftGrammar | None = None  # the grammar the drafter drew this step's drafts under
        self.active = False                # whether any row is constrained (kept by join and leave)
        self.forced = 0                    # emitted tokens that their grammar forced

    def join(self, joining: Joining) -> None:
        """The joining rows' constraints (None: unconstrained): until the first constrained row joins, no step
        spends anything on grammars."""
        self.matchers += [None if c is None else c.matcher() for c in joining.constraints]
        self.replaced, self.heads = [], []
        self.active = any(m is not None for m in self.matchers)

    def leave(self, keep: list[int]) -> None:
        self.matchers = [self.matchers[b] for b in keep]
        self.replaced, self.heads = [], []
        self.active = any(m is not None for m in self.matchers)

    def next_masks(self) -> np.ndarray | None:
        """(B, W) int32 bitmasks (constraint.py) of the tokens each row may emit next (all bits set:
        unconstrained); None without constraints."""
        if not self.active:
            return None
        bits = np.full((len(self.matchers), self.words), -1, dtype=np.int32)
        for b, m in enumerate(self.matchers):
            if m is not None:
                m.mask_into(bits[b])
        return bits

    def drafting(self) -> "DraftGrammar | None":
        """The grammar the drafter draws this step's drafts under (None without constraints); `propose`
        rolls its walk back."""
        self.drafts = DraftGrammar(self.matchers, self.words) if self.active else None
        return self.drafts

    def propose(self, proposal: Proposal, limits: list[int], cut: list[bool]) -> Proposal:
        """The forced runs in place of the drafter's drafts (where there is one, forced drafts are on,
        and the drafter's chain does not already begin with it and go further), then each chain cut at
        its first draft the grammar refuses where `cut[b]` (module docstring: where cutting is exact).
        Returns the proposal to verify."""
        if self.drafts is not None:  # the matchers back at the committed sequences
            self.drafts.release()
            self.drafts = None
        B = len(self.matchers)
        self.replaced = [False] * B
        self.tree = proposal.parents is not None  # the drafter's proposal: it expects paths in its outcome
        tokens, lengths = proposal.tokens.tolist(), proposal.lengths.tolist()
        self.heads = [None if m is None else m.forced() for m in self.matchers]
        forced = [[] if head is None or not self.forced_drafts else head[:limit]
                  for head, limit in zip(self.heads, limits)]
        if proposal.parents is None:  # a chain that begins with the forced run and goes on is kept
            forced = [[] if n > len(run) and row[:len(run)] == run else run
                      for run, row, n in zip(forced, tokens, lengths)]
        if any(forced):
            proposal = self.with_forced(proposal, forced)
            tokens, lengths = proposal.tokens.tolist(), proposal.lengths.tolist()
        if proposal.parents is not None or not any(cut):
            return proposal
        kept = list(lengths)
        for b, m in enumerate(self.matchers):
            if m is None or not cut[b] or self.replaced[b]:
                continue
            n = 0
            while n < lengths[b] and m.accepts(tokens[b][n]):
                n += 1
            kept[b] = n + (n < lengths[b] and m.ends(tokens[b][n]))  # an EOS the grammar allows after them
            m.rollback(n)
        if kept == lengths:
            return proposal
        return Proposal(proposal.tokens, torch.tensor(kept, device=proposal.lengths.device), proposal.draft_probs)

    def forced_only(self, proposal: Proposal) -> bool:
        """Whether the proposal (a chain) holds forced runs and no other drafts: each is then the one
        token its grammar allows, accepted with probability 1 under every rule, and only the column
        after each row's run needs the target's logits (Engine.after_forced)."""
        return (self.active and proposal.parents is None and any(self.replaced)
                and all(r or n == 0 for r, n in zip(self.replaced, proposal.lengths.tolist())))

    def with_forced(self, proposal: Proposal, forced: list[list[int]]) -> Proposal:
        """Rows with a forced run take it as their drafts (deterministic: one-hot q where the drafter
        gave distributions; a chain inside a tree)."""
        B, m = proposal.tokens.shape
        width = max(m, max(map(len, forced)))
        device = proposal.tokens.device
        tokens = torch.zeros(B, width, dtype=torch.long, device=device)
        tokens[:, :m] = proposal.tokens
        lengths = proposal.lengths.clone()
        probs = parents = None
        if proposal.draft_probs is not None:
            probs = proposal.draft_probs.new_zeros(B, width, proposal.draft_probs.shape[-1])
            probs[:, :m] = proposal.draft_probs
        if proposal.parents is not None:
            parents = torch.full((B, width), -1, dtype=torch.long, device=device)
            parents[:, :m] = proposal.parents
        for b, run in enumerate(forced):
            if not run:
                continue
            self.replaced[b] = True
            row = torch.tensor(run, device=device)
            tokens[b], lengths[b] = 0, len(run)
            tokens[b, :len(run)] = row
            if probs is not None:
                probs[b] = 0
                probs[b, torch.arange(len(run), device=device), row] = 1
            if parents is not None:
                parents[b] = -1
                parents[b, :len(run)] = chain_parents(1, len(run), device)[0]
        return Proposal(tokens, lengths, probs, parents)

    def window_masks(self, proposal: Proposal) -> np.ndarray:
        """(B, 1+m, W) int32 bitmasks: at each window column, the tokens the grammar allows after the
        row's sequence and the drafts on the path to that column (all tokens in unconstrained rows)."""
        B, m = proposal.tokens.shape
        bits = np.full((B, 1 + m, self.words), -1, dtype=np.int32)
        tokens, lengths = proposal.tokens.tolist(), proposal.lengths.tolist()
        parents = None if proposal.parents is None else proposal.parents.tolist()
        for b, matcher in enumerate(self.matchers):
            if matcher is None:
                continue
            matcher.mask_into(bits[b, 0])
            if parents is None:
                self.chain_masks(matcher, tokens[b][:lengths[b]], bits[b])
            else:
                self.tree_masks(matcher, tokens[b][:lengths[b]], parents[b][:lengths[b]], bits[b])
        return bits

    def after_masks(self, proposal: Proposal) -> np.ndarray:
        """(B, W) int32 bitmasks: the tokens each row's grammar allows after all its drafts (a chain;
        a forced window's only column that decides: Engine.after_forced)."""
        bits = np.full((len(self.matchers), self.words), -1, dtype=np.int32)
        for b, (matcher, row, n) in enumerate(zip(self.matchers, proposal.tokens.tolist(), proposal.lengths.tolist())):
            if matcher is not None:
                walked = 0
                while walked < n and matcher.accepts(row[walked]):
                    walked += 1
                matcher.mask_into(bits[b])
                matcher.rollback(walked)
        return bits

    @staticmethod
    def chain_masks(matcher: Matcher, drafts: list[int], bits: np.ndarray) -> None:
        """bits (1+m, W): column i + 1 after drafts[:i + 1]; from a refused draft on, its column's mask
        (those columns are never reached)."""
        n = 0
        while n < len(drafts) and matcher.accepts(drafts[n]):
            n += 1
            matcher.mask_into(bits[n])
        bits[n + 1:] = bits[n]
        matcher.rollback(n)

    @staticmethod
    def tree_masks(matcher: Matcher, drafts: list[int], parents: list[int], bits: np.ndarray) -> None:
        """bits (1+m, W): column c + 1 after the path of node c (parents precede their children);
        a node the grammar refuses, and its subtree, get its parent's column (never reached)."""
        path: list[int] = []   # the nodes the matcher has consumed, root first
        valid = [True] * len(drafts)
        for c, p in enumerate(parents):
            if p >= 0 and not valid[p]:  # below a refused node: never reached
                valid[c] = False
                bits[c + 1] = bits[p + 1]
                continue
            want = [] if p < 0 else path_to(parents, p)
            common = 0
            while common < min(len(path), len(want)) and path[common] == want[common]:
                common += 1
            matcher.rollback(len(path) - common)
            path = path[:common]
            for node in want[common:]:
                matcher.advance([drafts[node]])
                path.append(node)
            if matcher.accepts(drafts[c]):
                path.append(c)
                matcher.mask_into(bits[c + 1])
            else:
                valid[c] = False
                bits[c + 1] = bits[p + 1]
        matcher.rollback(len(path))

    def commit(self, runs: list[list[int]], counts: list[int]) -> None:
        """The rows' emitted tokens (runs[b][:counts[b]]) move their matchers on; those their grammar
        forced are counted (`forced_in`), however they were drafted or picked. A row whose rule
        restricts nothing more (`free`: a healed row after its first token) leaves the guide."""
        for b, (m, run, n) in enumerate(zip(self.matchers, runs, counts)):
            if m is not None and n:
                self.forced += forced_in(m, run[:n], self.heads[b] if self.heads else None)
        self.heads = []
        self.matchers = [None if m is not None and m.free else m for m in self.matchers]
        self.active = any(m is not None for m in self.matchers)

    def outcome(self, outcome: Outcome) -> Outcome:
        """What the drafter hears: rows that verified a forced run accepted none of its drafts; a
        drafter that proposed a tree hears paths even where the verified proposal became a chain."""
        if not any(self.replaced):
            return outcome
        accepted = [0 if r else n for r, n in zip(self.replaced, outcome.accepted)]
        paths = outcome.paths
        if paths is None and self.tree:
            paths = [list(range(n)) for n in outcome.accepted]  # a chain's accepted nodes: the tree's main chain
        if paths is not None:
            paths = [[] if r else p for r, p in zip(self.replaced, paths)]
        return Outcome(accepted, outcome.tokens, outcome.counts, outcome.hidden, paths)


class DraftGrammar:
    """The grammar as a drafter sees it while it draws one proposal, depth by depth (proposers/base.py's
    `draw`): each constrained row's draft logits are masked to the tokens its grammar allows after
    the row's drafts so far, and its draft then moves its matcher on; `release` rolls the matchers
    back. Masked and renormalised, a drafter's q never leaves the grammar; the q it reports is the
    one it drew from, so the verifier stays exact. A row is no longer masked after a draft its
    grammar does not consume (an EOS: nothing after it is emitted) or where none of the tokens the
    drafter can draw is allowed (a draft vocabulary without them); its drafts are then the
    drafter's own, and the verifier's masks refuse what they must. A drafter without logits walks
    the rows one by one instead (`row_forced`, `row_take`)."""

    def __init__(self, matchers: list[Matcher | None], words: int):
        self.matchers, self.words = matchers, words
        self.following = [m is not None for m in matchers]  # (B,) rows whose drafts are masked
        self.walked = [0] * len(matchers)                     # (B,) drafts each matcher consumed
        self.depth = 0                                        # the depth of the next drafts

    def masked(self, logits: torch.Tensor, depth: int, ids: torch.Tensor | None) -> torch.Tensor:
        """Draft logits (B, N) at depth `depth` (0-based) over the token ids `ids` (N,) (None: all)
        -> the same with -inf where each row's grammar refuses the token."""
        if depth != self.depth:
            raise SpecdecError(f"drafts under a grammar are drawn depth by depth: depth {depth} came after "
                               f"{self.depth} drafts; draw each depth once, in order")
        bits = np.full((len(self.matchers), self.words), -1, dtype=np.int32)   # (B, W)
        for b, m in enumerate(self.matchers):
            if self.following[b]:
                m.mask_into(bits[b])
        columns = None if ids is None else ids.cpu().numpy()
        if columns is not None:
            for b in np.flatnonzero(~flags(bits, 32 * self.words)[:, columns].any(1)):
                bits[b], self.following[b] = -1, False
        return masked(logits, bits, columns)

    def took(self, tokens: torch.Tensor, depth: int) -> None:
        """The drafts (B,) drawn at depth `depth` move the matchers of the rows still followed on."""
        for b, token in enumerate(tokens.tolist()):
            if self.following[b]:
                self.following[b] = self.matchers[b].accepts(token)
                self.walked[b] += self.following[b]
        self.depth = depth + 1

    def forced_run(self, depth: int, most: int) -> list[list[int]] | None:
        """The tokens every row's grammar forces after its drafts so far, from depth `depth` on: (B, r)
        with r the shortest of the rows' runs, at most `most`, walked through (drafts of probability 1
        under the mask, taken without drawing); None where a row has none (or is not followed)."""
        if depth != self.depth:
            raise SpecdecError(f"drafts under a grammar are drawn depth by depth: a forced run at depth {depth} "
                               f"came after {self.depth} drafts")
        if most < 1 or not all(self.following):
            return None
        runs = [list(itertools.takewhile(lambda t: t not in m.eos, m.forced()[:most])) for m in self.matchers]
        r = min(map(len, runs))
        if not r:
            return None
        for b, m in enumerate(self.matchers):
            m.advance(runs[b][:r])
            self.walked[b] += r
        self.depth = depth + r
        return [run[:r] for run in runs]

    def row_forced(self, b: int) -> list[int]:
        """Row by row (a lookup drafter's walk, with `row_take`; a proposal walks its rows either depth
        by depth or row by row): the run row b's grammar forces after its drafts so far, or its EOS
        where only the end may come; [] where the next token is free, the row is unconstrained or its
        walk has ended."""
        m = self.matchers[b]
        if m is None or not self.following[b]:
            return []
        return m.forced() or ([min(m.eos)] if m.stopped else [])

    def row_forced_bytes(self, b: int) -> bytes:
        """The bytes row b's grammar forces after its drafts so far (Matcher.forced_bytes); b'' where
        none are, the row is unconstrained or its walk has ended."""
        m = self.matchers[b]
        return m.forced_bytes() if m is not None and self.following[b] else b""

    def row_take(self, b: int, tokens: list[int]) -> int:
        """Row b's grammar walks through the longest prefix of `tokens` it allows and returns its
        length (all of them in an unconstrained row); an EOS it allows is taken and ends the walk:
        nothing after it is emitted."""
        m, n = self.matchers[b], 0
        if m is None:
            return len(tokens)
        self.depth = None  # row walks: no depth-by-depth drawing after them (masked, took, forced_run refuse)
        while n < len(tokens) and self.following[b]:
            if m.accepts(tokens[n]):
                self.walked[b] += 1
            elif m.ends(tokens[n]):
                self.following[b] = False
            else:
                break
            n += 1
        return n

    def release(self) -> None:
        for m, n in zip(self.matchers, self.walked):
            if m is not None:
                m.rollback(n)
        self.walked = [0] * len(self.matchers)


def forced_in(matcher: Matcher, tokens: list[int], head: list[int] | None = None) -> int:
    """Consume the tokens (Matcher.advance) and return how many of them the grammar forced (a run
    of Matcher.forced: the one token it allows at each of their positions); head: the run forced
    before the first token, where already known."""
    forced, i = 0, 0
    while i < len(tokens):
        run = head if head is not None and i == 0 else matcher.forced()
        n = 0
        while n < len(run) and i + n < len(tokens) and tokens[i + n] == run[n]:
            n += 1
        matcher.advance(tokens[i:i + max(n, 1)])  # the forced run, or one token the grammar left free
        forced += n
        i += max(n, 1)
    return forced


def path_to(parents: list[int], node: int) -> list[int]:
    """The nodes from the root down to `node`."""
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


class GrammarDrafts:
    """A proposer that drafts nothing itself: with forced drafts on, a constrained row's only drafts
    are the runs its grammar forces (the "forced drafts alone" configuration; with k = 0, plain
    constrained decoding through the engine)."""
    name = "grammar"
    vocab_size = None
    trees = False
    max_depth = None
    features = ()
    prompt_features = False  # joins without reading prompt_hidden

    def start(self, max_len: int, k: int, capacity: int, nodes: int | None = None) -> list[int]:
        return [0]  # the number of rows

    def join(self, state: list[int], prompts: list[list[int]], prompt_hidden: torch.Tensor, samplings) -> None:
        state[0] += len(prompts)

    def leave(self, state: list[int], keep: list[int]) -> None:
        state[0] = len(keep)

    def propose(self, state: list[int], limits: torch.Tensor, widths: tuple[int, ...], draws) -> Proposal:
        return Proposal.empty(state[0], limits.device)

    def observe(self, state: list[int], outcome: Outcome) -> None:
        """Nothing to learn: it keeps no history."""
