"""Training objectives: next-token prediction (NTP) and multi-token prediction (MTP).

A window of tokens (B, S+1) gives the trunk S positions. The trunk's own output ("head 0")
predicts x_{t+1}; MTP head j (1..depth, heads.py) predicts x_{t+1+j}. The MTP loss is

    loss = w_0 CE_0 + sum_j w_j CE_j,   w_0 = 1 (0 when the trunk is frozen),
    w_j = lambda(step) * beta^(j-1)

- Gloeckle et al. 2024 (parallel heads): lambda = 1, beta = 1, the plain sum of the n = depth+1
  cross-entropies.
- DeepSeek-V3 (sequential modules): lambda / depth per module, lambda 0.3 for the first part of
  training, then 0.1 (`lambda_late` from `lambda_switch` x steps on).

Two orders of computing the same gradient:
- naive: every head's logits (B, S, V) stay alive until one backward at the end;
- memory-saving (Gloeckle et al.): the trunk's hidden state is detached; each head's logits,
  loss and backward run in turn, their gradient collecting at the detached hidden state (for
  chained heads, at each module's detached output), and only then is the rest backpropagated
  through the heads (in reverse) and once through the trunk. At most one (B, S, V) logits tensor
  is alive at a time.

This module knows nothing about data, optimisers, checkpoints or distribution over processes.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..errors import SpecdecError
from ..heads import MTPHeads, teacher_forced

OBJECTIVES = ("next-token", "mtp-parallel", "mtp-sequential")


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """logits (B, T, V), targets (B, T) -> mean cross-entropy in nats (computed in fp32)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def next_token_loss(model, batch: torch.Tensor) -> torch.Tensor:
    """batch (B, S+1) -> the next-token cross-entropy over its S positions."""
    return cross_entropy(model(batch[:, :-1]).logits, batch[:, 1:])


@dataclass(frozen=True)
class LossWeights:
    """w_j = lambda(step) * beta^(j-1) for MTP head j; lambda switches to lambda_late at
    round(lambda_switch * steps) when lambda_late is set."""
    depth: int
    lam: float = 1.0
    lam_late: float | None = None
    lam_switch: float = 0.7
    beta: float = 1.0

    def __post_init__(self):
        if self.lam < 0 or (self.lam_late is not None and self.lam_late < 0) or self.beta < 0:
            raise SpecdecError("MTP loss weights (lambda, lambda_late, beta) must be >= 0")
        if not 0 <= self.lam_switch <= 1:
            raise SpecdecError(f"lambda_switch is a fraction of the steps in [0, 1], got {self.lam_switch}")

    def at(self, step: int, steps: int) -> list[float]:
        late = self.lam_late is not None and step >= round(self.lam_switch * steps)
        lam = self.lam_late if late else self.lam
        return [lam * self.beta ** j for j in range(self.depth)]


def mtp_losses(trunk, heads: MTPHeads, batch: torch.Tensor, train_trunk: bool) -> list[torch.Tensor]:
    """Naive forward: [CE_0, CE_1, .., CE_depth] as tensors in one autograd graph (CE_0 outside
    the graph when the trunk is frozen)."""
    with torch.set_grad_enabled(train_trunk and torch.is_grad_enabled()):
        out = trunk(batch[:, :-1])
    losses = [cross_entropy(out.logits, batch[:, 1:])]
    for j, _, leaf, targets in teacher_forced(heads, trunk, out.hidden, batch):
        losses.append(cross_entropy(heads.logits(j, trunk, leaf), targets))
    return losses


def mtp_backward(trunk, heads: MTPHeads, batch: torch.Tensor, weights: list[float], scale: float,
                 train_trunk: bool, memory_saving: bool) -> list[float | None]:
    """Accumulate the gradient of scale * loss into the parameters (the trunk's only when
    train_trunk); return the losses [CE_0, CE_1, .., CE_depth] as floats. CE_0 is None where it
    was not computed: the memory-saving order with a frozen trunk skips the trunk's logits."""
    if not memory_saving:
        losses = mtp_losses(trunk, heads, batch, train_trunk)
        total = sum(w * l for w, l in zip(weights, losses[1:]))
        if train_trunk:
            total = total + losses[0]
        (total * scale).backward()
        return [l.item() for l in losses]

    with torch.set_grad_enabled(train_trunk):
        hidden = trunk_hidden(trunk, batch[:, :-1])  # (B, S, C)
    leaf = hidden.detach().requires_grad_(train_trunk)
    result: list[float | None] = [None]
    if train_trunk:
        loss = cross_entropy(trunk.lm_head(leaf), batch[:, 1:])
        (loss * scale).backward()
        result[0] = loss.item()
    pending = []  # chained heads: (output, its detached leaf), backpropagated once all are done
    for j, out, out_leaf, targets in teacher_forced(heads, trunk, leaf, batch, detach=True):
        loss = cross_entropy(heads.logits(j, trunk, out_leaf), targets)
        (loss * (weights[j] * scale)).backward()  # logits freed here; gradient waits at out_leaf
        result.append(loss.item())
        pending.append((out, out_leaf))
        if not heads.chained:
            out.backward(out_leaf.grad)
            pending.clear()
    for out, out_leaf in reversed(pending):  # the next module has added its part to out_leaf.grad
        out.backward(out_leaf.grad)
    if train_trunk:
        hidden.backward(leaf.grad)
    return result


def trunk_hidden(trunk, tokens: torch.Tensor) -> torch.Tensor:
    """The trunk's final hidden state (B, S, C) over tokens (B, S), without unembedding every
    position (the memory-saving order unembeds head by head)."""
    return trunk(tokens, logits_index=tokens.new_zeros(tokens.shape[0], 1)).hidden
