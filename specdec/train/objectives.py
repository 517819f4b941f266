"""What a training run learns: one object per objective, holding its own settings (a small
dataclass) and answering what the generic loop (loop.py) asks of it: which checkpoints it reads,
the networks it builds, its loss on a micro-batch, its validation figures and how they enter the
history, and its export.

    NextToken   "next-token": a model learns the corpus, from scratch or from --init-from
    MTP         "mtp-parallel", "mtp-sequential": next-token + MTP heads (heads/mtp.py), pretrained jointly
                or, with frozen_trunk, the heads alone on an existing checkpoint whose weights
                (embedding and lm_head included) stay frozen
    Distill     "distill": a draft model learns the frozen teacher's next-token distribution
    Parallel    "parallel": a draft model with a mask token of its own learns to draft a block of k
                tokens in one forward from the teacher, at every block slot (PARD)
    Eagle       "eagle": an EAGLE-3 head learns from the frozen target's features and distributions
                with the training-time test
    Block       "block": a block head learns the same way to draft a whole block per forward

The losses are pure functions in losses.py. This module knows nothing about optimisers, batches,
checkpoints of a run's state or distribution over processes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch
from safetensors.torch import load_file
from torch import nn

from ..errors import SpecdecError
from ..lm.checkpoint import PARALLEL_KIND, WEIGHTS, load_model, save_model, save_token_counts, sha256, shown_path
from ..lm.model import LlamaForCausalLM
from ..heads.block import initial_head as initial_block_head
from ..heads.block import save_block
from ..heads.eagle import default_layer_ids, save_eagle, speculators_metadata
from ..heads.eagle import initial_head as initial_eagle_head
from ..heads.mtp import build_mtp, save_mtp
from .anchors import BlockLayout, block_layout, random_anchors
from .losses import (
    LossWeights,
    block_backward,
    block_metrics,
    distill_loss,
    distill_metrics,
    eagle_backward,
    eagle_metrics,
    mtp_backward,
    mtp_losses,
    next_token_loss,
    parallel_backward,
    parallel_metrics,
)
from .plots import plot_distill_history, plot_history, plot_per_position

BLOCK_EVAL_ANCHORS = 32  # blocks per validation window of a block head (the same anchors at every validation)
BLOCK_ATTENTION = ("bidirectional", "causal")


@dataclass
class Nets:
    """The networks of a run."""
    model: LlamaForCausalLM                 # the trained model, or the frozen trunk / target heads read
    heads: nn.Module | None = None          # MTP heads, an EAGLE head or a block head
    teacher: LlamaForCausalLM | None = None  # the frozen target a draft learns from


@dataclass(frozen=True)
class Where:
    """Where a micro-batch stands in a run: its random anchors follow from these alone, so a
    resumed run, and any number of processes, draw the same ones."""
    seed: int
    step: int
    steps: int
    rank: int
    micro: int

    def anchors(self) -> torch.Generator:
        """The generator of this micro-batch's random anchors, its seed one number per (seed, step,
        rank, micro-batch): distinct for steps below 1,000,003 and ranks and micro-batches below 1009."""
        return torch.Generator().manual_seed(((self.seed * 1_000_003 + self.step) * 1009 + self.rank) * 1009
                                             + self.micro)


class Objective:
    name: ClassVar[str]
    added_tokens: ClassVar[int] = 0   # token ids the model has beyond its tokenizer's (a mask token)
    evaluates_start: ClassVar[bool] = False  # validate the untrained starting point: the "before" of its curves
    frozen: str | None = None   # the checkpoint whose weights stay frozen while heads train on it, if any
    teacher: str | None = None  # the frozen checkpoint whose distribution the model learns, if any

    def validate(self, cfg) -> None:
        """Refuse settings that cannot train, with what to do."""

    def identity(self) -> dict:
        """The settings a resumed run must share with the saved one, by name."""
        return {}

    def new_heads(self, cfg, model: LlamaForCausalLM, train_tokens: np.ndarray) -> nn.Module | None:
        """Fresh heads (inside the caller's seeded generator), or None."""
        return None

    def backward(self, nets: Nets, batch: torch.Tensor, scale: float, cfg, at: Where) -> list[float | None]:
        """Accumulate the gradient of scale * the loss over batch (B, S+1); return its parts as floats
        (None: not computed)."""
        raise NotImplementedError

    def metrics(self, nets: Nets, batch: torch.Tensor, seq_len: int, anchors: torch.Generator) -> list[float]:
        """Validation figures of one window batch (B, S+1)."""
        raise NotImplementedError

    def pooled(self, rows: list[list[float]]) -> list[float]:
        """The figures of all windows: their mean."""
        return [float(x) for x in np.mean(rows, axis=0)]

    def record(self, history: dict, split: str, step: int, losses: list[float]) -> None:
        """history[split]: [step, headline loss]; what else the objective records beside it."""
        history[split].append([step, losses[0]])

    def export(self, run, nets: Nets, history: dict, figures: list[float] | None, meta: dict) -> None:
        """Write what was trained into run.out with `meta` (recipe, budget, corpus, history) and the
        objective's own figures (`figures`: the held-out test split's, None without one), and loss.png."""
        raise NotImplementedError


@dataclass
class NextToken(Objective):
    name: ClassVar[str] = "next-token"

    def backward(self, nets, batch, scale, cfg, at):
        loss = next_token_loss(nets.model, batch)
        (loss * scale).backward()
        return [loss.item()]

    def metrics(self, nets, batch, seq_len, anchors):
        return [next_token_loss(nets.model, batch).item()]

    def export(self, run, nets, history, figures, meta):
        meta = {"kind": "target-or-draft-model", **meta, **model_figures(nets.model, history, figures)}
        save_model(nets.model, run.out / "model", tokenizer_file=run.work / "tokenizer.json", meta=meta)
        plot_history(history, run.out / "loss.png", title=f"{run.out.name}: {nets.model.num_parameters() / 1e6:.1f}M "
                     "parameters", train_label="train, next token")


def model_figures(model, history: dict, figures: list[float] | None, valid: str = "valid") -> dict:
    """A trained model's size and next-token figures: the last validation loss (history[valid]) and the
    held-out test loss (figures[0]) with its perplexity."""
    test_loss = figures[0] if figures else None
    return {"parameters": model.num_parameters(),
            "final_valid_loss": history[valid][-1][1] if history.get(valid) else None, "test_loss": test_loss,
            "test_perplexity": math.exp(test_loss) if test_loss is not None else None}


@dataclass
class MTP(Objective):
    kind: str = "sequential"            # "sequential" (DeepSeek-V3's chained modules) or "parallel" (Gloeckle et al.)
    depth: int = 1                      # tokens predicted beyond the next one
    lam: float = 1.0                    # head j's loss weight: lam * beta^(j-1) ...
    lam_late: float | None = None       # ... lam becomes this from lam_switch x steps on
    lam_switch: float = 0.7
    beta: float = 1.0
    memory_saving: bool = True          # head-by-head backward (losses.py) instead of one backward
    frozen_trunk: str | None = None     # a checkpoint folder: train only heads on top of it
    frozen_tokenizer: ClassVar[tuple[str, str]] = ("the heads must use the trunk's tokenizer",
                                                   "the frozen trunk's tokenizer")

    @property
    def name(self) -> str:
        return f"mtp-{self.kind}"

    @property
    def frozen(self) -> str | None:
        return self.frozen_trunk

    def validate(self, cfg) -> None:
        if self.kind not in ("parallel", "sequential"):
            raise SpecdecError(f"MTP heads are parallel or sequential, not {self.kind!r}")
        if not 1 <= self.depth < cfg.seq_len - 1:
            raise SpecdecError(f"mtp_depth must be in 1..{cfg.seq_len - 2} (seq_len {cfg.seq_len}), got {self.depth}")
        self.weights()

    def identity(self) -> dict:
        return {"mtp_depth": self.depth}

    def weights(self) -> LossWeights:
        return LossWeights(self.depth, self.lam, self.lam_late, self.lam_switch, self.beta)

    def new_heads(self, cfg, model, train_tokens):
        heads = build_mtp(self.name, cfg.model, self.depth)
        init_weights(heads)
        return heads

    def backward(self, nets, batch, scale, cfg, at):
        return mtp_backward(nets.model, nets.heads, batch, self.weights().at(at.step, at.steps), scale,
                            self.frozen is None, self.memory_saving)

    def metrics(self, nets, batch, seq_len, anchors):
        return [part.item() for part in mtp_losses(nets.model, nets.heads, batch, train_trunk=False)]

    def record(self, history, split, step, losses):
        """The headline is the next-token loss, or the mean of the heads' where it was not computed
        (a frozen trunk in training); split + "_heads": [loss of head 1..depth]."""
        headline = losses[0] if not math.isnan(losses[0]) else float(np.mean(losses[1:]))
        history[split].append([step, headline])
        history.setdefault(f"{split}_heads", []).append([step, losses[1:]])

    def export(self, run, nets, history, figures, meta):
        """The heads folder (for the trained model, also exported, or for the frozen trunk)."""
        meta = {"kind": "target-or-draft-model", **meta, **model_figures(nets.model, history, figures)}
        if self.frozen:
            target_sha256 = run.trunk_sha256
        else:
            save_model(nets.model, run.out / "model", tokenizer_file=run.work / "tokenizer.json",
                       meta={**meta, "mtp_heads": "../heads (trained jointly; plain decoding does not use them)"})
            target_sha256 = sha256(run.out / "model" / WEIGHTS)
        heads = nets.heads
        heads.token_counts = torch.from_numpy(np.bincount(run.tokens("train"), minlength=run.cfg.model.vocab_size))
        save_mtp(heads, run.out / "heads", target_sha256, meta={
            **meta, "kind": heads.kind, "trunk": "frozen" if self.frozen else "trained jointly",
            "target": self.frozen or str(run.out / "model"),
            "final_valid_head_losses": history["valid_heads"][-1][1] if history.get("valid_heads") else None,
            "test_head_losses": figures[1:] if figures else None})
        params = sum(p.numel() for p in heads.parameters())
        what = "MTP heads on a frozen trunk" if self.frozen else "parameters"
        plot_history(history, run.out / "loss.png", title=f"{run.out.name}: {params / 1e6:.1f}M {what}",
                     train_label="train, mean of the heads" if self.frozen else "train, next token")


@dataclass
class Distill(Objective):
    teacher: str | None = None          # the frozen target checkpoint whose distribution is learnt
    temperature: float = 1.0            # KL at this temperature (times T^2)
    top_k: int | None = None            # the teacher's top-k tokens only, the rest one bucket
    name: ClassVar[str] = "distill"
    evaluates_start: ClassVar[bool] = True

    def validate(self, cfg) -> None:
        if self.teacher is None:
            raise SpecdecError("distillation needs a teacher: give --objective distill and --teacher MODEL")
        if self.temperature <= 0 or (self.top_k is not None and self.top_k < 1):
            raise SpecdecError(f"distill temperature must be > 0 and top-k >= 1, got {self.temperature} "
                               f"and {self.top_k}")

    def identity(self) -> dict:
        return {"distillation temperature and top-k": (self.temperature, self.top_k)}

    def backward(self, nets, batch, scale, cfg, at):
        loss = distill_loss(nets.model, nets.teacher, batch, self.temperature, self.top_k)
        (loss * scale).backward()
        return [loss.item()]

    def metrics(self, nets, batch, seq_len, anchors):
        return distill_metrics(nets.model, nets.teacher, batch)

    def record(self, history, split, step, losses):
        """Validation: the headline is KL(target || draft); split + "_agreement" the greedy
        agreement, split + "_next_token" the next-token loss."""
        if split != "valid":
            return super().record(history, split, step, losses)
        kl, agreement, next_token = losses
        history[split].append([step, kl])
        history.setdefault(f"{split}_agreement", []).append([step, agreement])
        history.setdefault(f"{split}_next_token", []).append([step, next_token])

    def export(self, run, nets, history, figures, meta):
        """The draft model, with where it was distilled from and its KL, agreement and next-token figures."""
        distilled = {
            "teacher": self.teacher, "teacher_sha256": run.teacher_sha256,
            "objective": "KL(target || draft) per position" + (f", target truncated to its top {self.top_k}"
                                                                if self.top_k else ""),
            "temperature": self.temperature, "top_k": self.top_k,
            "init_from": run.cfg.init_from, "init_from_sha256": run.init_sha256,
            "valid_before": distill_figures(history, 0),
            "valid_after": distill_figures(history, history["valid"][-1][0]) if history["valid"] else None,
            "test": dict(zip(("kl", "greedy_agreement", "next_token_loss"), figures)) if figures else None,
        }
        meta = {"kind": "target-or-draft-model", **meta, "distilled_from": distilled,
                **model_figures(nets.model, history, figures[2:] if figures else None, valid="valid_next_token")}
        save_model(nets.model, run.out / "model", tokenizer_file=run.work / "tokenizer.json", meta=meta)
        plot_distill_history(history, run.out / "loss.png", f"{run.out.name}: {nets.model.num_parameters() / 1e6:.1f}M "
                             f"parameters, distilled from {Path(self.teacher).name}")


def distill_figures(history: dict, step: int) -> dict | None:
    """Validation KL, greedy agreement and next-token loss recorded at `step`, if any."""
    for (s, kl), (_, agreement), (_, next_token) in zip(history["valid"], history.get("valid_agreement", []),
                                                         history.get("valid_next_token", [])):
        if s == step:
            return {"step": s, "kl": kl, "greedy_agreement": agreement, "next_token_loss": next_token}
    return None


class PerPosition(Objective):
    """A drafter validated per draft position: [KL per position.., alpha per position..], the
    alphas pooled over all windows (accepted over reached counts, not a mean of ratios)."""
    positions: int

    def pooled(self, rows):
        steps = self.positions
        kls, alphas, reached = (np.array([row[i * steps:(i + 1) * steps] for row in rows]) for i in range(3))
        pooled = (alphas * reached).sum(0) / np.maximum(reached.sum(0), 1)
        return [float(x) for x in (*kls.mean(0), *pooled)]

    def record(self, history, split, step, losses):
        """Training: the headline is the mean of the positions' KL (split + "_heads": each); validation
        also records split + "_alpha", the acceptance per position."""
        if split == "valid":
            steps = len(losses) // 2
            history[split].append([step, float(np.mean(losses[:steps]))])
            history.setdefault(f"{split}_heads", []).append([step, losses[:steps]])
            history.setdefault(f"{split}_alpha", []).append([step, losses[steps:]])
            return
        history[split].append([step, float(np.mean(losses))])
        history.setdefault(f"{split}_heads", []).append([step, losses])

    def figures(self, history: dict, figures: list[float] | None, kl: str, alpha: str) -> dict:
        """The last validation's and the test split's KL and acceptance per position, named
        final_valid_{kl}_kl, final_valid_alpha_per_{alpha}, test_{kl}_kl, test_alpha_per_{alpha}."""
        n = self.positions
        return {f"final_valid_{kl}_kl": history["valid_heads"][-1][1] if history.get("valid_heads") else None,
                f"final_valid_alpha_per_{alpha}": history["valid_alpha"][-1][1] if history.get("valid_alpha") else None,
                f"test_{kl}_kl": figures[:n] if figures else None,
                f"test_alpha_per_{alpha}": figures[n:] if figures else None}


@dataclass
class Parallel(PerPosition):
    teacher: str | None = None          # the frozen target the draft learns from
    block: int = 8                      # k, the drafts of one draft forward (block slots)
    anchors: int = 32                   # random anchors (blocks of k-1 mask slots) per training window
    name: ClassVar[str] = "parallel"
    added_tokens: ClassVar[int] = 1     # its mask token
    evaluates_start: ClassVar[bool] = True

    @property
    def positions(self) -> int:
        return self.block

    def validate(self, cfg) -> None:
        if self.teacher is None:
            raise SpecdecError("a parallel draft needs a teacher: give --objective parallel and --teacher MODEL")
        if not (2 <= self.block <= cfg.seq_len - 1 and self.anchors >= 1):
            raise SpecdecError(f"parallel: --parallel-block must be in 2..{cfg.seq_len - 1} (seq_len "
                               f"{cfg.seq_len}) and --parallel-anchors >= 1; got {self.block}, {self.anchors}")

    def identity(self) -> dict:
        return {"parallel block and anchors": (self.block, self.anchors)}

    def layout(self, seq_len: int, at: Where, device) -> BlockLayout:
        """The training layout of a micro-batch: random anchors, a pure function of where it stands."""
        return block_layout(seq_len, random_anchors(seq_len, self.block, self.anchors, at.anchors(), device), self.block)

    def backward(self, nets, batch, scale, cfg, at):
        return parallel_backward(nets.model, nets.teacher, batch, self.layout(cfg.seq_len, at, batch.device),
                                 nets.model.config.vocab_size - 1, scale)

    def metrics(self, nets, batch, seq_len, anchors):
        return parallel_metrics(nets.model, nets.teacher, batch, evaluation_layout(seq_len, self.block, batch.device),
                                nets.model.config.vocab_size - 1)

    def export(self, run, nets, history, figures, meta):
        """The model folder (a transformers checkpoint with one token more, its mask token) with the
        metadata proposers/parallel.py checks (mask id, block, the target's hash) and the training
        tokens' counts."""
        k, model = self.block, nets.model
        meta = {"kind": PARALLEL_KIND, **meta,
                "parallel": {"mask_token_id": run.cfg.model.vocab_size - 1, "block": k,
                             "target": shown_path(Path(self.teacher)), "target_sha256": run.teacher_sha256},
                "objective": (f"KL(target || draft) at each of the {k} block slots of one forward over [prefix, "
                              f"mask x {k - 1}], {self.anchors} random anchors per window, the slots weighted alike"),
                "init_from": shown_path(Path(run.cfg.init_from)) if run.cfg.init_from else None,
                "init_from_sha256": run.init_sha256, "parameters": model.num_parameters(),
                "valid_alpha_per_slot_before": history["valid_alpha"][0][1] if history.get("valid_alpha") else None,
                **self.figures(history, figures, "slot", "slot"),
                "alpha_note": ("greedy acceptance of block slot i given slots 1..i-1 accepted, over held-out windows "
                               "whose tokens are the target's greedy choices along the drafted path")}
        save_model(model, run.out / "model", tokenizer_file=run.work / "tokenizer.json", meta=meta)
        save_token_counts(run.out / "model", torch.from_numpy(np.bincount(run.tokens("train"),
                                                                           minlength=run.cfg.text_vocab)))
        plot_per_position(history, run.out / "loss.png", f"{run.out.name}: {model.num_parameters() / 1e6:.1f}M "
                          f"parallel draft, block of {k}, distilled from {Path(self.teacher).name}", what="slot")


def evaluation_layout(seq_len: int, k: int, device) -> BlockLayout:
    """Anchors every k positions of a validation window: the same blocks in every evaluation."""
    return block_layout(seq_len, torch.arange(0, seq_len - k + 1, k, device=device), k)


class TargetHead(PerPosition):
    """A head trained on a frozen target's features (its settings `target` and `layers`) over a draft
    vocabulary of the `draft_vocab` ids most frequent in the training tokens."""
    evaluates_start: ClassVar[bool] = True
    frozen_tokenizer: ClassVar[tuple[str, str]] = ("a head drafting for a target must use the target's tokenizer",
                                                   "the target's tokenizer")

    @property
    def frozen(self) -> str | None:
        return self.target

    def validate(self, cfg) -> None:
        if self.target is None:
            raise SpecdecError(f"an EAGLE or block head needs its target checkpoint: give both --objective "
                               f"{self.name} and --target MODEL")

    def new_heads(self, cfg, model, train_tokens):
        """A fresh head over the draft_vocab ids most frequent in the training tokens, from the seed."""
        counts = torch.from_numpy(np.bincount(train_tokens, minlength=cfg.model.vocab_size))
        if self.draft_vocab > cfg.model.vocab_size:
            raise SpecdecError(f"a draft vocabulary of {self.draft_vocab} tokens is larger than the target's "
                               f"{cfg.model.vocab_size}: choose --draft-vocab <= {cfg.model.vocab_size}")
        ids = counts.topk(self.draft_vocab).indices.sort().values
        layers = self.layers if self.layers is not None else default_layer_ids(cfg.model.num_hidden_layers)
        torch.manual_seed(cfg.seed)
        head = self.initial_head(model, layers, ids)
        head.token_counts = counts  # saved with it: a smaller draft vocabulary can be chosen at drafting time
        return head

    def export(self, run, nets, history, figures, meta):
        """The head folder with its target, training objective and figures."""
        head = nets.heads
        meta = {**meta, "target": shown_path(Path(self.target)), **self.described(head, figures, history)}
        self.save(head, run.out / "heads", run.trunk_sha256, meta=meta)
        params = sum(p.numel() for p in head.parameters())
        plot_per_position(history, run.out / "loss.png", f"{run.out.name}: {params / 1e6:.1f}M {self.drawn(head)} "
                          f"on a frozen {Path(self.target).name}")


@dataclass
class Eagle(TargetHead):
    target: str | None = None           # the frozen target checkpoint the head drafts for
    layers: tuple[int, ...] | None = None  # the target layers read (None: low, middle, high)
    steps: int = 4                      # draft steps unrolled in training (the training-time test)
    decay: float = 0.8                  # step j's loss weight is decay^j
    draft_vocab: int = 4096             # the N most frequent training token ids the head drafts over
    layout: str = "specdec"             # the head's weight layout (heads.eagle.LAYOUTS; eagle3: exportable to vLLM)
    name: ClassVar[str] = "eagle"

    @property
    def positions(self) -> int:
        return self.steps

    def validate(self, cfg) -> None:
        super().validate(cfg)
        if not (1 <= self.steps <= cfg.seq_len - 2 and 0 < self.decay <= 1 and self.draft_vocab >= 1):
            raise SpecdecError(f"eagle: --eagle-steps must be in 1..{cfg.seq_len - 2} (seq_len {cfg.seq_len}), "
                               f"--eagle-decay in (0, 1] and --draft-vocab >= 1; got {self.steps}, "
                               f"{self.decay}, {self.draft_vocab}")

    def identity(self) -> dict:
        return {"EAGLE layers, draft vocabulary and layout": (None if self.layers is None else list(self.layers),
                                                              self.draft_vocab, self.layout)}

    def initial_head(self, model, layers, ids):
        return initial_eagle_head(model, layers, ids, self.layout)

    save = staticmethod(save_eagle)

    def described(self, head, figures, history) -> dict:
        """The speculators-style description, the objective and the figures per draft step."""
        return {"speculators": speculators_metadata(head, shown_path(Path(self.target)), self.steps),
                "objective": (f"KL(target || head) over the {head.draft_vocab_size}-token draft vocabulary, unrolled "
                              f"{self.steps} draft steps on its own outputs (training-time test), step j weighted "
                              f"{self.decay}^j"),
                **self.figures(history, figures, "step", "position"),
                "alpha_note": ("greedy acceptance of draft i given drafts 1..i-1 accepted, over held-out windows whose "
                               "tokens are the target's greedy choices along the drafted path")}

    def drawn(self, head) -> str:
        return "EAGLE head"

    def backward(self, nets, batch, scale, cfg, at):
        return eagle_backward(nets.model, nets.heads, batch, self.steps, self.decay, scale)

    def metrics(self, nets, batch, seq_len, anchors):
        return eagle_metrics(nets.model, nets.heads, batch, self.steps)


@dataclass
class Block(TargetHead):
    target: str | None = None           # the frozen target checkpoint the head drafts for
    layers: tuple[int, ...] | None = None  # the target layers read (None: low, middle, high)
    size: int = 8                       # drafts per forward the head is trained for (k)
    anchors: int = 32                   # random anchors (blocks of mask slots) per training window
    attention: str = "causal"           # attention among a block's masks (or bidirectional)
    num_layers: int = 1                 # decoder layers of the head
    draft_vocab: int = 4096             # the N most frequent training token ids the head drafts over
    name: ClassVar[str] = "block"

    @property
    def positions(self) -> int:
        return self.size

    def validate(self, cfg) -> None:
        super().validate(cfg)
        if not (1 <= self.size <= cfg.seq_len - 2 and self.anchors >= 1 and self.num_layers >= 1
                and self.attention in BLOCK_ATTENTION):
            raise SpecdecError(f"block: --block-size must be in 1..{cfg.seq_len - 2} (seq_len {cfg.seq_len}), "
                               f"--block-anchors and --block-layers >= 1, --block-attention one of "
                               f"{', '.join(BLOCK_ATTENTION)}; got {self.size}, {self.anchors}, "
                               f"{self.num_layers}, {self.attention}")

    def identity(self) -> dict:
        return {"block head layers, draft vocabulary, block size, attention and depth": (
            None if self.layers is None else list(self.layers), self.draft_vocab, self.size, self.attention,
            self.num_layers)}

    def initial_head(self, model, layers, ids):
        return initial_block_head(model, layers, ids, self.size, self.num_layers, self.attention == "causal")

    save = staticmethod(save_block)

    def described(self, head, figures, history) -> dict:
        """The objective and the figures per block slot."""
        return {"objective": (f"KL(target || head) over the {head.draft_vocab_size}-token draft vocabulary at each of "
                              f"the {head.block} block slots ({head.attention} attention among the masks), "
                              f"{self.anchors} random anchors per window, slot 0 at every window position"),
                **self.figures(history, figures, "slot", "slot"),
                "alpha_note": (f"greedy acceptance of block slot i given slots 1..i-1 accepted, over "
                               f"{BLOCK_EVAL_ANCHORS} random anchors per held-out window whose tokens are the target's "
                               "greedy choices along the drafted path (train/anchors.block_acceptance)")}

    def drawn(self, head) -> str:
        return f"block head ({head.attention}, k={head.block})"

    def backward(self, nets, batch, scale, cfg, at):
        # the anchors, like the batches, a pure function of (seed, step, rank, micro-batch)
        return block_backward(nets.model, nets.heads, batch, self.anchors, scale, at.anchors())

    def metrics(self, nets, batch, seq_len, anchors):
        return block_metrics(nets.model, nets.heads, batch, BLOCK_EVAL_ANCHORS, anchors)


OBJECTIVES = {"next-token": NextToken, "mtp-parallel": lambda **kw: MTP(kind="parallel", **kw),
              "mtp-sequential": lambda **kw: MTP(kind="sequential", **kw), "distill": Distill, "eagle": Eagle,
              "block": Block, "parallel": Parallel}


def objective(name: str, **settings) -> Objective:
    """The objective called `name` with these settings (the others at their defaults)."""
    if name not in OBJECTIVES:
        raise SpecdecError(f"unknown objective {name!r}; known: {', '.join(OBJECTIVES)}")
    return OBJECTIVES[name](**settings)


def trunk(cfg) -> LlamaForCausalLM:
    """The model a run starts from (inside the caller's seeded generator): the frozen checkpoint in
    fp32, or fresh weights (those of `init_from` where given)."""
    if cfg.frozen:
        return load_model(cfg.frozen, dtype=torch.float32).requires_grad_(False).train(False)
    model = LlamaForCausalLM(cfg.model)
    init_weights(model)
    if cfg.init_from:
        state = load_file(Path(cfg.init_from) / WEIGHTS)
        model.load_hf_state_dict(with_vocabulary({k: v.float() for k, v in state.items()}, cfg.model.vocab_size))
    return model.train()


def with_vocabulary(state: dict[str, torch.Tensor], vocab: int) -> dict[str, torch.Tensor]:
    """Weights of a model with one token fewer than `vocab` given the new one (a parallel draft's
    mask token, started from a plain draft model): its embedding and unembedding rows are the
    mean of the others'. Weights of the right size come back as they are."""
    grown = dict(state)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        if name in grown and grown[name].shape[0] == vocab - 1:
            grown[name] = torch.cat([grown[name], grown[name].mean(0, keepdim=True)])
    return grown


def init_weights(model: nn.Module, std: float = 0.02) -> None:
    """Fresh matrices from torch's global generator: normal(0, std), the residual projections scaled
    down by sqrt(2 x layers)."""
    for name, p in model.named_parameters():
        if p.dim() == 2:
            torch.nn.init.normal_(p, std=std)
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                p.data /= math.sqrt(2 * model.config.num_hidden_layers)
