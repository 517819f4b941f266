"""The losses and validation figures of the training objectives (objectives.py), as pure functions:
next-token prediction, multi-token prediction, distillation of a draft from a frozen target, EAGLE,
block and parallel drafting (what each computes: docs/guide/train.md, "The losses"). It knows
nothing about data, optimisers, checkpoints or distribution over processes.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..errors import SpecdecError
from ..heads.vocabulary import DraftVocabulary
from ..heads.block import BlockHead
from ..heads.eagle import EagleHead
from ..heads.mtp import MTPHeads, teacher_forced
from .anchors import BlockLayout, block_acceptance, block_layout, random_anchors


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


@dataclass(frozen=True)
class TeacherTargets:
    """The frozen target's next-token distribution, at the distillation temperature, on a batch's
    S positions: log-probabilities over the whole vocabulary (indices None), or over its top-k
    tokens (indices: their token ids) followed by the log of the mass of all other tokens."""
    log_probs: torch.Tensor              # (B, S, V) or (B, S, k+1), fp32
    indices: torch.Tensor | None = None  # (B, S, k) token ids, or None for the whole vocabulary


@torch.no_grad()
def teacher_targets(teacher, tokens: torch.Tensor, temperature: float = 1.0,
                    top_k: int | None = None) -> TeacherTargets:
    """tokens (B, S) -> the teacher's (target's) distribution at each of the S positions."""
    logits = teacher(tokens).logits.float() / temperature  # (B, S, V)
    if top_k is None or top_k >= logits.shape[-1]:
        return TeacherTargets(F.log_softmax(logits, dim=-1))
    indices = logits.topk(top_k, dim=-1).indices  # (B, S, k)
    return TeacherTargets(top_k_and_rest(F.log_softmax(logits, dim=-1), indices), indices)


def top_k_and_rest(log_probs: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """log_probs (B, S, V), indices (B, S, k) -> (B, S, k+1): the k tokens' log-probabilities and
    the log of the mass of every other token (log-sum-exp with the k masked out: no 1 - sum)."""
    rest = log_probs.scatter(-1, indices, float("-inf")).logsumexp(-1, keepdim=True)  # (B, S, 1)
    return torch.cat([log_probs.gather(-1, indices), rest], dim=-1)


def distill_kl(student_logits: torch.Tensor, teacher: TeacherTargets, temperature: float = 1.0) -> torch.Tensor:
    """Mean over positions of T^2 KL(target || draft) at temperature T; student_logits (B, S, V).
    With a top-k teacher the sum runs over the teacher's k tokens and the bucket of all others."""
    student_log_probs = F.log_softmax(student_logits.float() / temperature, dim=-1)  # (B, S, V)
    if teacher.indices is not None:
        student_log_probs = top_k_and_rest(student_log_probs, teacher.indices)  # (B, S, k+1)
    target_probs = teacher.log_probs.exp()
    # a target probability of 0 contributes 0 (x log x -> 0), not 0 * inf
    kl = torch.where(target_probs > 0, target_probs * (teacher.log_probs - student_log_probs), 0.0).sum(-1)  # (B, S)
    return kl.mean() * temperature ** 2


def distill_loss(model, teacher, batch: torch.Tensor, temperature: float = 1.0,
                 top_k: int | None = None) -> torch.Tensor:
    """batch (B, S+1) -> the distillation loss of `model` (the draft) against the frozen `teacher`
    over the S input positions (the batch's last token is never an input, as in next_token_loss)."""
    tokens = batch[:, :-1]
    targets = teacher_targets(teacher, tokens, temperature, top_k)
    return distill_kl(model(tokens).logits, targets, temperature)


@torch.no_grad()
def distill_metrics(model, teacher, batch: torch.Tensor) -> list[float]:
    """Validation at temperature 1 over the whole vocabulary: [KL(target || draft), greedy agreement
    argmax(draft) == argmax(target) as a fraction of positions, the draft's next-token cross-entropy]."""
    tokens = batch[:, :-1]
    student_logits = model(tokens).logits.float()  # (B, S, V)
    teacher_logits = teacher(tokens).logits.float()
    kl = distill_kl(student_logits, TeacherTargets(F.log_softmax(teacher_logits, dim=-1)))
    agreement = (student_logits.argmax(-1) == teacher_logits.argmax(-1)).float().mean()
    return [kl.item(), agreement.item(), cross_entropy(student_logits, batch[:, 1:]).item()]


# --- EAGLE: the training-time test -----------------------------------------------------------

@dataclass(frozen=True)
class EagleTargets:
    """What the frozen target gives one batch (B, S+1), computed once without gradients."""
    features: torch.Tensor     # (B, S, nC) outputs of the head's layers at positions 0..S-1
    log_probs: torch.Tensor    # (B, S, N) the target's next-token log-probabilities over the draft
                               # vocabulary, renormalised there (temperature 1)
    argmax: torch.Tensor | None  # (B, S) the target's greedy token (full vocabulary); None: not computed
    ahead: torch.Tensor        # (B, S + steps - 1) x_1..x_S, then padding: what the unrolled steps read


@torch.no_grad()
def eagle_targets(target, head: EagleHead | BlockHead, batch: torch.Tensor, steps: int, with_logits: bool = False,
                  greedy: bool = True):
    """The EagleTargets of a batch; with_logits: and the target's logits of the same forward. greedy
    False (what training reads): the target unembeds over the draft vocabulary's rows alone (its full
    vocabulary's unembedding is a fifth of SmolLM2's forward), the same logits there; no argmax."""
    if greedy:
        out = target(batch[:, :-1], output_layers=head.layer_ids)
        logits = out.logits.float()[..., head.draft_ids]
    else:
        rows = DraftVocabulary(head.draft_ids, target.lm_head).unembedding
        out = target(batch[:, :-1], output_layers=head.layer_ids, unembedding=rows)
        logits = out.logits.float()
    features = torch.cat([out.layers[i] for i in head.layer_ids], -1).float()
    targets = EagleTargets(features, F.log_softmax(logits, -1), out.logits.argmax(-1) if greedy else None,
                           F.pad(batch[:, 1:], (0, steps - 1)))
    return (targets, out.logits) if with_logits else targets


def eagle_step_losses(target, head: EagleHead, targets: EagleTargets, steps: int):
    """Yields (j, KL_j, logits_j) for draft steps j = 0..steps-1 of the unrolled head (eagle.py):
    KL(target || head) over the draft vocabulary, per position, averaged over the S-1-j base
    positions whose target distribution (at position t+1+j) lies inside the window."""
    S = targets.features.shape[1]
    for j, h in head.unroll(targets.features, targets.ahead, target.model.embed_tokens, steps):
        n = S - 1 - j
        logits = head.logits(h[:, :n])                                   # (B, n, N)
        wanted = targets.log_probs[:, 1 + j:1 + j + n]                   # (B, n, N)
        kl = (wanted.exp() * (wanted - F.log_softmax(logits.float(), -1))).sum(-1).mean()
        yield j, kl, logits


def eagle_backward(target, head: EagleHead, batch: torch.Tensor, steps: int, decay: float,
                   scale: float, teacher=None) -> list[float | None]:
    """Accumulate the gradient of scale * sum_j decay^j KL_j into the head; return [KL_0, ..,
    KL_{steps-1}]. teacher: the copy of the target whose forward gives the features and the
    distribution (default the target; a bf16 copy runs several times faster where the CPU multiplies
    bf16 in hardware)."""
    if batch.shape[1] - 2 < steps:
        raise SpecdecError(f"a window of {batch.shape[1]} tokens is too short to unroll {steps} EAGLE steps: "
                           "raise seq_len or lower --eagle-steps")
    targets = eagle_targets(target if teacher is None else teacher, head, batch, steps, greedy=False)
    losses = [kl for _, kl, _ in eagle_step_losses(target, head, targets, steps)]
    (sum(decay ** j * kl for j, kl in enumerate(losses)) * scale).backward()
    return [kl.item() for kl in losses]


@torch.no_grad()
def eagle_metrics(target, head: EagleHead, batch: torch.Tensor, steps: int) -> list[float]:
    """[KL_0..KL_{steps-1}, then greedy acceptance alpha_1..alpha_steps, then the counts they come
    from: reached_1..reached_steps]. alpha_i is exact for greedy drafting from these contexts:
    draft i counts where drafts 1..i-1 were accepted AND the window's tokens that the unrolled
    steps read equal the target's greedy tokens (so the head saw what drafting would feed it);
    it is accepted where its argmax is the target's."""
    targets = eagle_targets(target, head, batch, steps)
    S = targets.features.shape[1]
    reached = torch.ones(batch.shape[0], S - 1, dtype=torch.bool, device=batch.device)  # (B, S-1) bases still drafting
    kls, alphas, counts = [], [], []
    for j, kl, logits in eagle_step_losses(target, head, targets, steps):
        n = S - 1 - j
        greedy = targets.argmax[:, 1 + j:1 + j + n]                      # (B, n) the target's token
        accepted = reached[:, :n] & (head.draft_ids[logits.argmax(-1)] == greedy)
        kls.append(kl.item())
        counts.append(int(reached[:, :n].sum()))
        alphas.append(int(accepted.sum()) / max(counts[-1], 1))
        # step j+1 at base t reads x_{t+2+j}: drafting feeds the accepted draft, i.e. the greedy token
        reached = accepted[:, :n - 1] & (batch[:, 2 + j:1 + j + n] == greedy[:, :n - 1])
    return [*kls, *alphas, *counts]


# --- block head: one forward drafts a block ---------------------------------------------------
#
# The block head (block.py) reads the frozen target's features at a window's S context positions
# (the entry at t reads f_t and x_{t+1}, and its output predicts x_{t+2}) and, after them, a block of
# k-1 mask slots per random anchor (anchors.py) with the attention drafting uses. Block slot i of
# anchor a predicts x_{a+2+i}: its label is the target's distribution at position a+1+i, i.e.
# anchors.py's label shifted by one (the head's context entry at a already reads x_{a+1}). The loss
# is KL(target || head) over the draft vocabulary at every slot: slot 0 at every window position
# (the window's outputs give it for free), slots 1..k-1 at the anchors; their sum is minimised.

def block_layout_for(head: BlockHead, window: int, anchors: int, generator: torch.Generator | None,
                     device: torch.device) -> BlockLayout:
    """A layout of `window` context positions and `anchors` random blocks of the head's size whose
    labels (shifted by one) stay inside the window."""
    picked = random_anchors(window - 1, head.block, anchors, generator, device)
    return block_layout(window, picked, head.block, causal=head.causal)


def block_slot_losses(target, head: BlockHead, targets: EagleTargets, layout: BlockLayout):
    """[KL_0, .., KL_{k-1}] (tensors) and the slots' logits (B, A, k, N) of one training forward."""
    S = targets.features.shape[1]
    h = head.training_outputs(targets.features, targets.ahead, target.model.embed_tokens, layout.positions,
                              layout.visible)                                   # (B, L, C)
    window = head.logits(h[:, :S - 1])                                          # (B, S-1, N) slot 0 everywhere
    slots = head.logits(h[:, layout.slots])                                     # (B, A, k, N)
    wanted = targets.log_probs[:, layout.labels + 1]                            # (B, A, k, N)
    kl = (wanted.exp() * (wanted - F.log_softmax(slots.float(), -1))).sum(-1).mean((0, 1))  # (k,)
    first = targets.log_probs[:, 1:]                                            # (B, S-1, N)
    kl0 = (first.exp() * (first - F.log_softmax(window.float(), -1))).sum(-1).mean()
    return [kl0, *kl[1:]], slots


def block_backward(target, head: BlockHead, batch: torch.Tensor, anchors: int, scale: float,
                   generator: torch.Generator | None) -> list[float | None]:
    """Accumulate the gradient of scale * sum_i KL_i into the head; return [KL_0, .., KL_{k-1}]."""
    if batch.shape[1] - 2 < head.block:
        raise SpecdecError(f"a window of {batch.shape[1]} tokens is too short for blocks of {head.block}: "
                           "raise seq_len or lower --block-size")
    targets = eagle_targets(target, head, batch, 1, greedy=False)
    losses, _ = block_slot_losses(target, head, targets, block_layout_for(head, batch.shape[1] - 1, anchors,
                                                                          generator, batch.device))
    (sum(losses) * scale).backward()
    return [kl.item() for kl in losses]


@torch.no_grad()
def block_metrics(target, head: BlockHead, batch: torch.Tensor, anchors: int,
                  generator: torch.Generator | None) -> list[float]:
    """[KL_0..KL_{k-1}, then greedy acceptance alpha_1..alpha_k per block slot, then the counts they
    come from: reached_1..reached_k] (anchors.block_acceptance: slot i counts where slots < i were
    accepted along the target's greedy path)."""
    targets = eagle_targets(target, head, batch, 1)
    layout = block_layout_for(head, batch.shape[1] - 1, anchors, generator, batch.device)
    losses, logits = block_slot_losses(target, head, targets, layout)
    drafts = head.draft_ids[logits.argmax(-1)]                                  # (B, A, k) target ids
    accepted, reached = block_acceptance(drafts, targets.argmax[:, 1:], batch[:, 1:], layout)
    alphas = accepted.double() / reached.clamp(min=1)
    return [*(kl.item() for kl in losses), *alphas.tolist(), *reached.tolist()]


# --- Parallel drafting: a block of k drafts from one forward (train/anchors.py) --------------

def parallel_logits(model, tokens: torch.Tensor, layout: BlockLayout, mask_id: int, vocab: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens (B, S) -> the draft's logits over the first `vocab` ids (its mask id excluded) at every
    window position (B, S, V) — block slot 0 of every anchor there — and at the mask slots (B, A, k-1, V),
    from one forward over the window followed by every anchor's mask slots."""
    B, S = tokens.shape
    A, k = layout.slots.shape
    inputs = torch.cat([tokens, tokens.new_full((B, A * (k - 1)), mask_id)], 1)      # (B, L)
    out = model(inputs, positions=layout.positions.expand(B, -1),
                attention_mask=layout.visible.expand(B, -1, -1))
    logits = out.logits[..., :vocab]                                                  # (B, L, V)
    return logits[:, :S], logits[:, S:].view(B, A, k - 1, vocab)


def parallel_losses(model, teacher, batch: torch.Tensor, layout: BlockLayout, mask_id: int) -> list[torch.Tensor]:
    """[KL_0, .., KL_{k-1}]: KL(target || draft) at block slot i, averaged over its positions (slot 0:
    every window position; slot j: mask j of every anchor), against the target's distribution at the
    position the slot drafts, given the true prefix."""
    tokens = batch[:, :-1]
    targets = teacher_targets(teacher, tokens)                                        # (B, S, V)
    window, masks = parallel_logits(model, tokens, layout, mask_id, targets.log_probs.shape[-1])
    losses = [distill_kl(window, targets)]
    for j in range(1, layout.slots.shape[1]):
        wanted = TeacherTargets(targets.log_probs[:, layout.labels[:, j]])           # (B, A, V)
        losses.append(distill_kl(masks[:, :, j - 1], wanted))
    return losses


def parallel_backward(model, teacher, batch: torch.Tensor, layout: BlockLayout, mask_id: int,
                      scale: float) -> list[float]:
    """Accumulate the gradient of scale * mean_i KL_i into the draft; return [KL_0, .., KL_{k-1}]."""
    losses = parallel_losses(model, teacher, batch, layout, mask_id)
    (sum(losses) / len(losses) * scale).backward()
    return [kl.item() for kl in losses]


@torch.no_grad()
def parallel_metrics(model, teacher, batch: torch.Tensor, layout: BlockLayout, mask_id: int) -> list[float]:
    """[KL_0..KL_{k-1}, then greedy acceptance alpha_1..alpha_k of the drafted blocks, then the counts
    they come from] (anchors.block_acceptance: exact for greedy drafting from these contexts)."""
    tokens = batch[:, :-1]
    targets = teacher_targets(teacher, tokens)
    window, masks = parallel_logits(model, tokens, layout, mask_id, targets.log_probs.shape[-1])
    kls = [distill_kl(window, targets).item()]
    for j in range(1, layout.slots.shape[1]):
        kls.append(distill_kl(masks[:, :, j - 1], TeacherTargets(targets.log_probs[:, layout.labels[:, j]])).item())
    drafts = torch.cat([window[:, layout.slots[:, 0]].argmax(-1)[..., None], masks.argmax(-1)], 2)  # (B, A, k)
    accepted, reached = block_acceptance(drafts, targets.log_probs.argmax(-1), batch, layout)
    return [*kls, *(accepted / reached.clamp(min=1)).tolist(), *reached.tolist()]
