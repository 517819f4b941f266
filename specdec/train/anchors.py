"""Training a parallel drafter on random anchors: the layout of one forward that holds a window's
tokens and, after them, one block of mask slots per anchor, and the greedy acceptance of the
blocks it drafts.

A parallel drafter (proposers/parallel.py, proposers/block.py) drafts k tokens in one forward:
after the sequence x_0..x_a it reads k-1 mask slots, and block slot i (0..k-1) predicts x_{a+1+i}
— slot 0 is the ordinary output at x_a, slot j >= 1 the output at mask j — without seeing the
drafts before it. Training reproduces exactly that attention (Pard, An et al. 2025): a window of S
tokens is followed by A blocks of k-1 mask slots; mask j of anchor a sits at position a + j and
sees x_0..x_a and the masks of its own block (those before it, or all of them: `causal`), nothing
else; the window's own tokens see each other causally and never a mask. One forward over
S + A (k-1) inputs then trains every slot of every anchor, and the window's tokens give slot 0 of
every position for free.

The label of block slot i at anchor a is the target's distribution at position a + i (which
predicts x_{a+1+i}) given the true prefix. Greedy acceptance (`block_acceptance`) is exact for
greedy drafting from these contexts: slot i counts where slots < i were accepted and the window's
tokens x_{a+1..a+i-1} are the target's greedy ones (what drafting would have had as prefix).

This module knows nothing about models, losses or optimisers.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class BlockLayout:
    positions: torch.Tensor  # (L,) long, L = S + A (k-1): rotary positions of the window, then of every mask slot
    visible: torch.Tensor    # (L, L) bool, visible[q, s]: input q sees input s (itself included)
    slots: torch.Tensor      # (A, k) long: the input whose output is block slot i of anchor a
    labels: torch.Tensor     # (A, k) long: the window position whose target distribution labels that slot (a + i)

    @property
    def window(self) -> int:
        """How many inputs are the window's tokens (the rest are mask slots)."""
        return int(self.positions.shape[0] - self.slots.shape[0] * (self.slots.shape[1] - 1))


def random_anchors(window: int, k: int, count: int, generator: torch.Generator | None = None,
                   device: torch.device | str = "cpu") -> torch.Tensor:
    """`count` distinct anchors (sorted) among the positions 0..window-k, whose k block slots all have
    a label inside a window of `window` tokens (fewer when the window has fewer such positions)."""
    room = window - k + 1
    if room < 1:
        raise ValueError(f"a window of {window} tokens has no room for a block of {k}: lower k or raise seq_len")
    picked = torch.randperm(room, generator=generator)[:min(count, room)]
    return picked.sort().values.to(device)


def block_layout(window: int, anchors: torch.Tensor, k: int, causal: bool = True) -> BlockLayout:
    """The layout of a window of `window` tokens followed by k-1 mask slots per anchor (A,)."""
    device = anchors.device
    A, m = anchors.shape[0], k - 1
    L = window + A * m
    j = torch.arange(1, k, device=device)                                    # (m,) mask index in its block
    mask_pos = (anchors[:, None] + j[None]).reshape(-1)                       # (A m,)
    positions = torch.cat([torch.arange(window, device=device), mask_pos])
    visible = torch.zeros(L, L, dtype=torch.bool, device=device)
    visible[:window, :window] = torch.ones(window, window, dtype=torch.bool, device=device).tril()
    block = torch.arange(A, device=device).repeat_interleave(m)              # (A m,) the anchor of each mask
    # a mask sees the window up to its anchor ...
    visible[window:, :window] = torch.arange(window, device=device)[None] <= anchors[block][:, None]
    # ... and the masks of its own block (before it, or all of them)
    same = block[:, None] == block[None]
    if causal:
        same &= torch.arange(A * m, device=device)[None] <= torch.arange(A * m, device=device)[:, None]
    visible[window:, window:] = same
    slots = torch.cat([anchors[:, None], window + torch.arange(A * m, device=device).view(A, m)], 1)
    labels = anchors[:, None] + torch.arange(k, device=device)[None]
    return BlockLayout(positions, visible, slots, labels)


def block_acceptance(drafts: torch.Tensor, greedy: torch.Tensor, tokens: torch.Tensor,
                     layout: BlockLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy acceptance of the drafted blocks: drafts (B, A, k) target ids, greedy (B, S) the
    target's argmax at each window position, tokens (B, S+1) the window with its next token.
    Returns (accepted, reached), each (k,) counts over the B A blocks (module docstring)."""
    labels = layout.labels                                                   # (A, k)
    B, A, k = drafts.shape
    wanted = greedy[:, labels]                                               # (B, A, k) the target's token
    # prefix of slot i: x_{a+1..a+i-1} must be the target's greedy tokens, i.e. tokens[a+i] == greedy[a+i-1]
    on_greedy = tokens[:, labels[:, 1:]] == greedy[:, labels[:, :-1]]       # (B, A, k-1)
    hit = drafts == wanted
    reached = torch.ones_like(hit)
    for i in range(1, k):
        reached[..., i] = reached[..., i - 1] & hit[..., i - 1] & on_greedy[..., i - 1]
    return (reached & hit).sum((0, 1)), reached.sum((0, 1))
