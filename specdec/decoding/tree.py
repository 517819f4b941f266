"""Draft trees: the shape of a proposal whose drafts branch, and what verifying one needs.

A proposal of m draft nodes names each node's parent (B, m): -1 is the root, the newest committed
token ("last") that opens the verification window [last, d_1..d_m]; parents[b, i] < i, so nodes
come in topological order and a chain is the degenerate tree parents = [-1, 0, 1, ..]. Window
column 0 is the root and column 1 + i is node i. The target verifies all nodes in one forward:
node i sits at position (row's cache length + its depth) and sees the committed prefix, the root,
its ancestors and itself — the tree attention mask — so its logits are those of its path decoded
alone. Acceptance walks from the root down (verify.py); the accepted path is a list of node
indices, and the cache then keeps the root and the path's entries, moved to follow each other
(`KVCache.compact`).

Padding nodes (i >= lengths[b]) hang off the root; their outputs are never read and their cache
entries lie past the row's kept length. A chain's window (a plain step's too) sits at the model's
default positions, after each row's cache length, except near the end of the context, where its
padding is clamped (`chain_positions`); the engine lays out every window here.

This module is pure index arithmetic on host lists and small tensors; it knows nothing about
models, sampling or proposers.
"""
from __future__ import annotations

import torch

from ..errors import SpecdecError


def chain_parents(batch_size: int, m: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """(B, m) the parents of a chain of m drafts: -1, 0, 1, .., m-2."""
    return (torch.arange(m, device=device) - 1).expand(batch_size, m).clone()


def check_parents(parents: list[list[int]], lengths: list[int]) -> None:
    """Refuse a malformed tree: a parent that is not an earlier real node of the same row (which
    also rules out cycles)."""
    for b, (row, n) in enumerate(zip(parents, lengths)):
        for i, p in enumerate(row[:n]):
            if not -1 <= p < i:
                raise SpecdecError(f"malformed draft tree in row {b}: node {i} names parent {p}, but a parent "
                                   "must be an earlier node (0..i-1) or -1 for the root; list nodes parent first")


def children(parents: list[int], n: int) -> dict[int, list[int]]:
    """node (-1: root) -> its children among the first n nodes, in node order."""
    kids: dict[int, list[int]] = {}
    for i, p in enumerate(parents[:n]):
        kids.setdefault(p, []).append(i)
    return kids


def depths(parents: list[int]) -> list[int]:
    """Depth of each node (root's children: 1)."""
    out: list[int] = []
    for p in parents:
        out.append(1 if p < 0 else out[p] + 1)
    return out


def on_chain(path: list[int], chain: list[int]) -> int:
    """How many leading nodes of the accepted path are the proposer's main chain (its node indices
    `chain`, one per depth): the drafts a proposer that fed its chain onward may keep."""
    n = 0
    while n < len(path) and n < len(chain) and path[n] == chain[n]:
        n += 1
    return n


def caterpillar_layout(widths: tuple[int, ...]) -> tuple[list[int], list[int]]:
    """A main chain with widths[d] - 1 alternatives beside its node at each depth d + 1, in depth
    order (each depth's chain node first): the parents of all nodes, and the chain's node indices.
    Static trees of the drafters that feed only their chain onward (draft model, MTP heads)."""
    parents, chain = [], []
    for width in widths:
        parent = chain[-1] if chain else -1
        chain.append(len(parents))
        parents += [parent] * width
    return parents, chain


def chain_positions(cache_lengths: list[int], width: int, context: int, device: torch.device | str = "cpu"
                    ) -> torch.Tensor | None:
    """Positions (B, width) of a chain's window (a plain step's: width 1) after each row's
    `cache_lengths`, or None where they are the model's default (no row reaches the context's end).
    Rows that draft fewer tokens than the widest are padded, and near the end of a row that padding
    may run past the context: its positions are clamped to stay valid (outputs at padding are never
    read, and its cache entries lie past the row's length)."""
    if max(cache_lengths) + width <= context:
        return None
    return torch.tensor([[min(n + i, context - 1) for i in range(width)] for n in cache_lengths], device=device)


def window_layout(parents: torch.Tensor, lengths: list[int], cache_lengths: list[int],
                  context: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The verification window's positions (B, 1+m) and tree mask (B, 1+m, 1+m) (True: may see).
    Positions past the context (padding, or a tree deeper than the context allows) are refused
    for real nodes and clamped for padding. Rows of one tree shape share its depths and mask."""
    rows = parents.tolist()
    check_parents(rows, lengths)
    shapes: dict[tuple, int] = {}                          # (parents, real nodes) -> index into `layouts`
    layouts: list[tuple[list[int], list[list[bool]]]] = []  # (depths, mask) of each shape
    which, positions = [], []
    for b, (row, n, start) in enumerate(zip(rows, lengths, cache_lengths)):
        key = (tuple(row), n)
        if key not in shapes:
            shapes[key] = len(layouts)
            layouts.append(tree_layout([p if i < n else -1 for i, p in enumerate(row)]))  # padding: off the root
        depth = layouts[shapes[key]][0]
        if n and start + max(depth[:n]) >= context:
            raise SpecdecError(f"draft tree of row {b} reaches depth {max(depth[:n])} after {start + 1} tokens: "
                               f"beyond the target's context of {context} positions; draft fewer levels")
        positions.append([start] + [min(start + d, context - 1) for d in depth])
        which.append(shapes[key])
    masks = torch.tensor([mask for _, mask in layouts])  # built on the host, moved once
    return (torch.tensor(positions, device=parents.device),
            masks[torch.tensor(which, dtype=torch.long)].to(parents.device))


def tree_layout(parents: list[int]) -> tuple[list[int], list[list[bool]]]:
    """One tree's node depths and its mask over [root, nodes] (1+m, 1+m): each node sees the root,
    its ancestors and itself; the root sees itself."""
    m = len(parents)
    mask = [[True] + [False] * m]
    for i, p in enumerate(parents):
        sees = list(mask[1 + p])  # the parent's ancestors (root: column 0) ...
        sees[1 + i] = True         # ... and itself
        mask.append(sees)
    return depths(parents), mask


def levels_reached(parents: torch.Tensor, lengths: list[int], paths: list[list[int]]) -> list[int]:
    """Per row, the depths whose drafts the target got to judge: the accepted path's, and one more
    where the path's last node (or the root) has children."""
    reached = []
    for row, n, path in zip(parents.tolist(), lengths, paths):
        end = path[-1] if path else -1
        reached.append(len(path) + (end in row[:n]))
    return reached


def chain_runs(parents: torch.Tensor, paths: list[list[int]]) -> list[int]:
    """Per row, how many of the accepted path's leading nodes are each the first child of their
    parent: the drafts a chain of the tree's first children (the proposer's best guess at each depth,
    tried first) would have had accepted."""
    runs = []
    for row, path in zip(parents.tolist(), paths):
        n = 0
        while n < len(path) and row.index(row[path[n]]) == path[n]:  # the first node with that parent
            n += 1
        runs.append(n)
    return runs


def path_columns(paths: list[list[int]], width: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """(B, width) window columns of the root and each row's accepted path first (then column 0 as
    filler): gathers what the target computed at the committed tokens, in sequence order."""
    return torch.tensor([[0] + [1 + i for i in path] + [0] * (width - 1 - len(path)) for path in paths],
                        device=device)
