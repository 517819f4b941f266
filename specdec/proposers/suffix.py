"""Suffix-tree proposer (SuffixDecoding, Oliaro et al. 2024; vLLM's method `suffix`): no model, no
draft probabilities, trees of the continuations the text has already shown, ranked by frequency.

Two suffix tries, each bounded in depth (a path holds at most `trie_depth` tokens):
- per row, over that row's prompt and generated tokens;
- one shared by every generation this proposer object serves, over generated tokens only (the
  prompts stay in their rows). It is written at each `observe`: the protocol never says when a
  row's generation ends (a finished row just commits 0 tokens), and writing as tokens arrive also
  lets concurrent rows of a batch draft from each other's text. It is bounded by `shared_nodes`
  and, once past it, starts afresh (a cache flush, simpler than evicting whole requests; recent
  text is relearned as it is generated): its epoch counts the flushes, and a row that saw an
  older epoch drops its places in it. It is the one thing a proposer object holds beyond its
  configuration.

A trie lives in flat lists of ints and one dict (SuffixTrie), not one object per node: a long
history makes hundreds of thousands of nodes, and per-node containers would make every garbage
collection walk them all. Appending a token costs one step down from each of the (at most
trie_depth) nodes that end the text: the row keeps that list (`open`), so nothing is rebuilt.

propose: per trie, the longest suffix of the row's text (at most `max_match` tokens, none shorter
than `min_match`) that occurred earlier with a continuation; from that node, candidates are scored
by the product of empirical conditional frequencies along their path (a child's count over the
sum of its siblings' counts), and taken best first while the best scores >= `min_score`, at most
widths[d] at depth d + 1, at most min(limits[b], int(factor * match length)) deep: a longer match
earns a deeper draft. Equal
scores go to the continuation first seen latest. Of the two tries' trees the one with the larger
expected number of accepted tokens (the sum of its scores) is proposed, the row's own on a tie.
Trees come in depth order, siblings by score (tree.py); with all widths 1 a chain.

Drafts are deterministic (draft_probs None: one-hot), which keeps sampling lossless; they depend
only on committed text, never on the target's randomness for the step they are verified in.

This module knows nothing about models, verification or stopping.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass

from ..decoding.protocol import Outcome, Proposal
from ..errors import SpecdecError


class SuffixTrie:
    """Every suffix of the text(s) written into it, cut at trie_depth tokens, with counts. Node 0 is
    the root; node i holds count[i] (suffixes passing through it), token[i], its newest child
    first[i] and its next older sibling sibling[i] (0: none, as the root is nobody's child)."""

    def __init__(self, trie_depth: int):
        self.trie_depth = trie_depth
        self.edges: dict[int, int] = {}  # parent << 32 | token -> child
        self.count, self.token, self.first, self.sibling = [0], [0], [0], [0]

    def __len__(self) -> int:
        """Nodes beside the root."""
        return len(self.count) - 1

    def extend(self, open_nodes: list[int], token: int) -> list[int]:
        """Append a token to a text whose suffixes of lengths 0, 1, .. end at open_nodes (root
        first): each gains a child for it. Returns the new list (lengths 0..trie_depth-1)."""
        edges, count = self.edges, self.count
        grown = [0]
        for node in open_nodes:
            key = node << 32 | token
            child = edges.get(key)
            if child is None:
                child = edges[key] = len(count)
                count.append(1)
                self.token.append(token)
                self.first.append(0)
                self.sibling.append(self.first[node])
                self.first[node] = child
            else:
                count[child] += 1
            grown.append(child)
        if len(grown) > self.trie_depth:  # a suffix of trie_depth tokens is a leaf: it grows no further
            grown.pop()
        return grown

    def follow(self, cursor: list[int], token: int, max_match: int) -> list[int]:
        """Read-only: the nodes of the text's suffixes of lengths 1.. (at most max_match) that the
        trie holds after appending a token, from those before it (cursor[j] has length j + 1). A
        suffix's own suffixes are in the trie whenever it is, so the first miss ends the list."""
        edges = self.edges
        child = edges.get(token)
        if child is None:
            return []
        found = [child]
        for node in cursor[:max_match - 1]:
            child = edges.get(node << 32 | token)
            if child is None:
                break
            found.append(child)
        return found

    def longest_match(self, suffixes: list[int], max_match: int) -> tuple[int, int]:
        """The deepest of the suffix nodes (suffixes[j] has length j + 1) with a continuation, and
        its length; (0, 0) when none has one."""
        first = self.first
        for j in range(min(len(suffixes), max_match) - 1, -1, -1):
            if first[suffixes[j]]:  # it occurred earlier and went on
                return suffixes[j], j + 1
        return 0, 0

    def grow(self, node: int, widths: tuple[int, ...], min_score: float) -> tuple[list[int], list[int], float]:
        """The speculation tree from a matched node, at most widths[d] nodes at depth d + 1
        (len(widths) levels): candidates best first by path score while it is >= min_score.
        Returns its tokens and parents in depth order (siblings by score) and the sum of its
        scores (the expected accepted drafts, were the frequencies the target's probabilities)."""
        count, first, sibling = self.count, self.first, self.sibling
        heap: list[tuple[float, int, int, int, int]] = []  # (-score, order, depth, parent in taken, node)
        order = 0

        def push(node: int, score: float, depth: int, parent: int) -> None:
            nonlocal order
            kids, child = [], first[node]
            while child:  # newest first: a tie goes to it
                kids.append(child)
                child = sibling[child]
            total = sum(count[c] for c in kids)
            for child in kids:
                s = score * count[child] / total
                if s >= min_score:
                    heapq.heappush(heap, (-s, order, depth, parent, child))
                    order += 1

        push(node, 1.0, 1, -1)
        taken: list[tuple[int, int, int, float]] = []  # (depth, parent in taken, node, score), best first
        used = [0] * len(widths)
        while heap:
            negative, _, depth, parent, child = heapq.heappop(heap)
            if used[depth - 1] == widths[depth - 1]:
                continue  # that depth is full: neither this candidate nor its subtree fits
            used[depth - 1] += 1
            taken.append((depth, parent, child, -negative))
            if depth < len(widths):
                push(child, -negative, depth + 1, len(taken) - 1)
        levels: list[list[int]] = [[] for _ in widths]  # per depth, indices into taken, best first
        for i, (depth, *_) in enumerate(taken):
            levels[depth - 1].append(i)
        index = {-1: -1}  # taken -> depth order
        tokens, parents = [], []
        for level in levels:
            level.sort(key=lambda i: index[taken[i][1]])  # stable: siblings stay best first
            for i in level:
                index[i] = len(tokens)
                tokens.append(self.token[taken[i][2]])
                parents.append(index[taken[i][1]])
        return tokens, parents, sum(score for *_, score in taken)


@dataclass
class RowTries:
    """One row's own trie and where its text ends in both tries."""
    trie: SuffixTrie          # the row's prompt and generated tokens
    open: list[int]           # its nodes of the text's suffixes of lengths 0..trie_depth-1
    writer: list[int]         # the shared trie: nodes of the generated text's suffixes, lengths 0..
    cursor: list[int]         # the shared trie: nodes of the whole text's suffixes, lengths 1..max_match
    epoch: int                # the shared trie's epoch those two lists belong to


@dataclass
class SuffixState:
    rows: list[RowTries]


class SuffixProposer:
    name = "suffix"
    vocab_size = None  # proposes only ids it has seen
    trees = True
    max_depth = None   # levels per step: as many as the match allows (factor), within the limits
    prompt_features = False  # joins without reading prompt_hidden

    def __init__(self, trie_depth: int = 24, max_match: int = 12, min_score: float = 0.1, factor: float = 1.0,
                 shared_nodes: int = 1_000_000, min_match: int = 1):
        """trie_depth: tokens a trie path holds (match + continuation); max_match: the longest suffix
        matched; min_score: the lowest path score drafted; factor: draft at most factor x match
        length levels; shared_nodes: the shared trie's node budget (0: no shared trie); min_match:
        the shortest match drafted from (a shorter one drafts nothing)."""
        if not (isinstance(trie_depth, int) and trie_depth >= 2):
            raise SpecdecError(f"suffix trie_depth must be an integer >= 2 (a matched token and one to draft), "
                               f"got {trie_depth!r}")
        if not (isinstance(max_match, int) and 1 <= max_match < trie_depth):
            raise SpecdecError(f"suffix max_match must be an integer from 1 to trie_depth - 1 = {trie_depth - 1} "
                               f"(a match must leave room to draft), got {max_match!r}; lower it or raise trie_depth")
        if not (isinstance(min_match, int) and 1 <= min_match <= max_match):
            raise SpecdecError(f"suffix min_match must be an integer from 1 to max_match = {max_match}, "
                               f"got {min_match!r}")
        if not 0 <= min_score <= 1:
            raise SpecdecError(f"suffix min_score is a path probability, so it must lie in [0, 1], got {min_score!r}")
        if not factor > 0:
            raise SpecdecError(f"suffix factor (levels drafted per matched token) must be > 0, got {factor!r}")
        if not (isinstance(shared_nodes, int) and shared_nodes >= 0):
            raise SpecdecError(f"suffix shared_nodes must be an integer >= 0 (0 turns the shared trie off), "
                               f"got {shared_nodes!r}")
        self.trie_depth, self.max_match, self.min_score, self.factor = trie_depth, max_match, min_score, factor
        self.shared_nodes, self.min_match = shared_nodes, min_match
        self.shared, self.epoch = SuffixTrie(trie_depth), 0

    def start(self, max_len, k, capacity, nodes=None) -> SuffixState:
        return SuffixState([])

    def forget(self) -> None:
        """Empty the shared trie, a flush (a benchmark's next repeat: a prompt decoded again must not
        find its own earlier answer there). The proposer stays the same object, so what `k="auto"`
        learned of it (its costs, its acceptance: decoding/adaptive.py) stays too."""
        self.shared, self.epoch = SuffixTrie(self.trie_depth), self.epoch + 1

    def join(self, state: SuffixState, prompts, prompt_hidden, samplings) -> None:
        for prompt in prompts:
            trie, open_nodes, cursor = SuffixTrie(self.trie_depth), [0], []
            for token in prompt:
                open_nodes = trie.extend(open_nodes, token)
            if self.shared_nodes:
                for token in prompt[-self.max_match:]:
                    cursor = self.shared.follow(cursor, token, self.max_match)
            state.rows.append(RowTries(trie, open_nodes, [0], cursor, self.epoch))

    def leave(self, state: SuffixState, keep: list[int]) -> None:
        state.rows = [state.rows[b] for b in keep]

    def draft(self, row: RowTries, limit: int, widths: tuple[int, ...]) -> tuple[list[int], list[int]]:
        """One row's tree (tokens, parents in depth order) of at most `limit` levels."""
        best: tuple[list[int], list[int], float] = ([], [], 0.0)
        sources = [(row.trie, row.open[1:])]
        if self.shared_nodes:
            sources.append((self.shared, self.shared_places(row).cursor))
        for trie, suffixes in sources:
            node, length = trie.longest_match(suffixes, self.max_match)
            depth = min(limit, int(self.factor * length)) if length >= self.min_match else 0
            if depth:
                tree = trie.grow(node, widths[:depth], self.min_score)
                if tree[2] > best[2]:
                    best = tree
        return best[0], best[1]

    def propose(self, state: SuffixState, limits, widths, draws) -> Proposal:
        return Proposal.looked_up(limits, widths, state.rows, self.draft)

    def observe(self, state: SuffixState, outcome: Outcome) -> None:
        shared, match = self.shared, self.max_match
        for row, tokens, count in zip(state.rows, outcome.tokens, outcome.counts):
            if self.shared_nodes and count:
                self.shared_places(row)
            for token in tokens[:count]:
                row.open = row.trie.extend(row.open, token)
                if self.shared_nodes:
                    row.writer = shared.extend(row.writer, token)
                    row.cursor = shared.follow(row.cursor, token, match)
        if len(shared) > self.shared_nodes:
            self.forget()

    def shared_places(self, row: RowTries) -> RowTries:
        """The row, its places in the shared trie dropped if the trie was flushed since it took them."""
        if row.epoch != self.epoch:
            row.writer, row.cursor, row.epoch = [0], [], self.epoch
        return row
