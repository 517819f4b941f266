"""`specdec train`: AdamW with warmup + cosine decay, gradient clipping, periodic validation,
atomic checkpoints with exact resume, single process or torchrun (gloo on CPU, NCCL on CUDA: --device cuda).

Objectives (objectives.py): "next-token", or next-token + multi-token prediction with MTP heads
("mtp-parallel", "mtp-sequential", heads.py), either pretrained jointly from scratch or, with
`frozen_trunk`, added to an existing checkpoint whose weights (embedding and lm_head included)
stay frozen while only the heads train. "eagle": an EAGLE-3 draft head (eagle.py) learns from the
frozen `target` checkpoint's features and distributions with the training-time test. "block": a
block head (block.py) learns the same way to draft a whole block per forward, on random anchors. "distill": a draft model learns the frozen `teacher`
(target) checkpoint's next-token distribution (KL(target || draft), objectives.py), on the
teacher's tokenizer, from scratch or from `init_from` (an existing checkpoint's weights).

A run lives in one output folder:
  work/tokenizer.json, work/tokens-*.npy   prepared once (tokenizer trained on the train split,
                                           or the frozen trunk's)
  work/state/                              resume state: fp32 trainable weights, optimizer moments, history
  model/                                   the exported checkpoint (bf16, transformers layout), unless
                                           the trunk is frozen
  heads/                                   the exported MTP heads (heads.py), for the model in model/
                                           or for the frozen trunk; or the EAGLE head (eagle.py),
                                           or the block head (block.py)
  loss.png                                 training and validation loss curves
Batches are a pure function of (seed, step), so an interrupted run resumes to the same result.
Under torchrun each process takes its share of the global batch and the gradients are averaged
over processes before each optimizer step; every process builds the same initial weights from
the seed.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from ..bench.conditions import shown_path
from ..errors import SpecdecError
from ..lm.atomic import atomic_dir, recover
from ..lm.checkpoint import (
    PARALLEL_KIND,
    TOKENIZER,
    WEIGHTS,
    load_model,
    read_config,
    save_model,
    save_token_counts,
    sha256,
)
from ..lm.device import resolve as resolve_device
from ..lm.model import LlamaConfig, LlamaForCausalLM, device_of, place
from ..lm.tokenizer import Tokenizer
from ..proposers.block_head import BlockHead, save_block
from ..proposers.block_head import initial_head as initial_block_head
from ..proposers.eagle_head import EagleHead, default_layer_ids, initial_head, save_eagle, speculators_metadata
from ..proposers.heads import MTPHeads, build_heads, save_heads
from .anchors import BlockLayout, block_layout, random_anchors
from .corpus import Corpus
from .data import eval_batches, preparation_key, tokenize, window_batch
from .objectives import (
    OBJECTIVES,
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


@dataclass
class TrainConfig:
    out: str
    model: LlamaConfig = field(default_factory=LlamaConfig)
    corpus: list[str] | None = None     # None: the standard library
    tokenizer: str | None = None        # an existing tokenizer.json; None: train one
    seq_len: int = 512
    batch_size: int = 8                 # global sequences per optimizer step
    micro_batch: int = 8                # sequences per forward/backward on one process
    device: str = "cpu"                 # cpu or cuda (under torchrun: each process its LOCAL_RANK's GPU)
    steps: int = 600
    lr: float = 1.5e-3
    min_lr_ratio: float = 0.1
    warmup: int = 50
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_every: int = 50
    eval_windows: int = 48
    test_windows: int = 256             # held-out test windows evaluated at export
    save_every: int = 25
    seed: int = 0
    stop_after: int | None = None       # leave after this many steps in this invocation (resume later)
    objective: str = "next-token"       # see objectives.OBJECTIVES
    mtp_depth: int = 1                  # MTP heads: tokens predicted beyond the next one
    mtp_lambda: float = 1.0             # MTP head j's loss weight: lambda * beta^(j-1) ...
    mtp_lambda_late: float | None = None  # ... lambda becomes this from mtp_lambda_switch x steps on
    mtp_lambda_switch: float = 0.7
    mtp_beta: float = 1.0
    mtp_memory_saving: bool = True      # head-by-head backward (objectives.py) instead of one backward
    frozen_trunk: str | None = None     # a checkpoint folder: train only MTP heads on top of it
    init_from: str | None = None        # a checkpoint folder: start from its weights (and its model config)
    teacher: str | None = None          # distill: the frozen target checkpoint whose distribution is learnt
    distill_temperature: float = 1.0    # distill: KL at this temperature (times T^2)
    distill_top_k: int | None = None    # distill: the teacher's top-k tokens only, renormalised
    target: str | None = None           # eagle: the frozen target checkpoint the head drafts for
    eagle_layers: tuple[int, ...] | None = None  # eagle: the target layers read (None: low, middle, high)
    eagle_steps: int = 4                # eagle: draft steps unrolled in training (the training-time test)
    eagle_decay: float = 0.8            # eagle: step j's loss weight is decay^j
    draft_vocab: int = 4096             # eagle: the N most frequent training token ids the head drafts over
    eagle_layout: str = "specdec"       # eagle: the head's weight layout (eagle.LAYOUTS; eagle3: exportable to vLLM)
    parallel_block: int = 8             # parallel: k, the drafts of one draft forward (block slots)
    parallel_anchors: int = 32          # parallel: random anchors (blocks of k-1 mask slots) per training window
    block_size: int = 8                 # block: drafts per forward the head is trained for (k)
    block_anchors: int = 32             # block: random anchors (blocks of mask slots) per training window
    block_attention: str = "causal"     # block: attention among a block's masks (or bidirectional)
    block_layers: int = 1               # block: decoder layers of the head

    def validate(self):
        if self.steps <= 0 or self.batch_size <= 0 or self.micro_batch <= 0 or self.seq_len <= 1:
            raise SpecdecError("steps, batch_size, micro_batch must be positive and seq_len > 1")
        if self.seq_len > self.model.max_position_embeddings:
            raise SpecdecError(f"seq_len {self.seq_len} exceeds the model context "
                               f"{self.model.max_position_embeddings}")
        if self.objective not in OBJECTIVES:
            raise SpecdecError(f"unknown objective {self.objective!r}; known: {', '.join(OBJECTIVES)}")
        if self.frozen_trunk and not self.mtp:
            raise SpecdecError("a frozen trunk only makes sense with MTP heads to train: set the objective "
                               "to mtp-parallel or mtp-sequential")
        if (self.objective in ("distill", "parallel")) != (self.teacher is not None):
            raise SpecdecError("distillation needs a teacher and a teacher needs distillation: give both "
                               "--objective distill (or parallel) and --teacher MODEL")
        if self.parallel and not (2 <= self.parallel_block <= self.seq_len - 1 and self.parallel_anchors >= 1):
            raise SpecdecError(f"parallel: --parallel-block must be in 2..{self.seq_len - 1} (seq_len "
                               f"{self.seq_len}) and --parallel-anchors >= 1; got {self.parallel_block}, "
                               f"{self.parallel_anchors}")
        if self.distill_temperature <= 0 or (self.distill_top_k is not None and self.distill_top_k < 1):
            raise SpecdecError(f"distill temperature must be > 0 and top-k >= 1, got {self.distill_temperature} "
                               f"and {self.distill_top_k}")
        if self.init_from and self.frozen:
            raise SpecdecError("--init-from starts a trained model from a checkpoint; a frozen trunk trains no "
                               "model weights: give one of them")
        if self.mtp and not 1 <= self.mtp_depth < self.seq_len - 1:
            raise SpecdecError(f"mtp_depth must be in 1..{self.seq_len - 2} (seq_len {self.seq_len}), "
                               f"got {self.mtp_depth}")
        if (self.objective in ("eagle", "block")) != (self.target is not None):
            raise SpecdecError("an EAGLE or block head needs its target and a target needs the eagle or block "
                               "objective: give both --objective block or --objective eagle and --target MODEL")
        if self.block and not (1 <= self.block_size <= self.seq_len - 2 and self.block_anchors >= 1
                               and self.block_layers >= 1 and self.block_attention in BLOCK_ATTENTION):
            raise SpecdecError(f"block: --block-size must be in 1..{self.seq_len - 2} (seq_len {self.seq_len}), "
                               f"--block-anchors and --block-layers >= 1, --block-attention one of "
                               f"{', '.join(BLOCK_ATTENTION)}; got {self.block_size}, {self.block_anchors}, "
                               f"{self.block_layers}, {self.block_attention}")
        if self.eagle and not (1 <= self.eagle_steps <= self.seq_len - 2 and 0 < self.eagle_decay <= 1
                               and self.draft_vocab >= 1):
            raise SpecdecError(f"eagle: --eagle-steps must be in 1..{self.seq_len - 2} (seq_len {self.seq_len}), "
                               f"--eagle-decay in (0, 1] and --draft-vocab >= 1; got {self.eagle_steps}, "
                               f"{self.eagle_decay}, {self.draft_vocab}")
        self.loss_weights()

    @property
    def eagle(self) -> bool:
        return self.objective == "eagle"

    @property
    def parallel(self) -> bool:
        return self.objective == "parallel"

    @property
    def text_vocab(self) -> int:
        """The tokenizer's vocabulary: the model's, less a parallel draft's mask token."""
        return self.model.vocab_size - self.parallel

    @property
    def block(self) -> bool:
        return self.objective == "block"

    @property
    def head_steps(self) -> int:
        """Drafts per position an EAGLE or block head is validated on (its unrolled steps, its block)."""
        return self.block_size if self.block else self.eagle_steps

    @property
    def frozen(self) -> str | None:
        """The checkpoint whose weights stay frozen (MTP heads' trunk, EAGLE's target), if any."""
        return self.frozen_trunk or self.target

    @property
    def mtp(self) -> bool:
        return self.objective.startswith("mtp")

    def loss_weights(self) -> LossWeights:
        return LossWeights(self.mtp_depth, self.mtp_lambda, self.mtp_lambda_late, self.mtp_lambda_switch,
                           self.mtp_beta)


BLOCK_ATTENTION = ("bidirectional", "causal")


def with_frozen_trunk(cfg: TrainConfig) -> TrainConfig:
    """The config with the frozen trunk's model config and tokenizer (which the heads must share)."""
    return adopt_checkpoint(cfg, Path(cfg.frozen_trunk), "the heads must use the trunk's tokenizer",
                            "the frozen trunk's tokenizer")


def with_eagle_target(cfg: TrainConfig) -> TrainConfig:
    """The config with the EAGLE target's model config and tokenizer (the head drafts its token ids)."""
    return adopt_checkpoint(cfg, Path(cfg.target), "the EAGLE head must use the target's tokenizer",
                            "the target's tokenizer")


def with_init_from(cfg: TrainConfig) -> TrainConfig:
    """The config with the starting checkpoint's model config and tokenizer (its weights need them)."""
    start = Path(cfg.init_from)
    return adopt_checkpoint(cfg, start, "a model fine-tuned from it must keep its tokenizer",
                            f"the tokenizer of --init-from {start}")


def adopt_checkpoint(cfg: TrainConfig, path: Path, why: str, whose: str) -> TrainConfig:
    """cfg with the model config and tokenizer of the checkpoint at `path`; a --tokenizer that is
    not that checkpoint's is refused."""
    model = LlamaConfig.from_dict(read_config(path))
    tokenizer = path / TOKENIZER
    if not tokenizer.exists():
        raise SpecdecError(f"{path} has no {TOKENIZER}; {why}")
    if cfg.tokenizer and Path(cfg.tokenizer).read_bytes() != tokenizer.read_bytes():
        raise SpecdecError(f"--tokenizer {cfg.tokenizer} is not {whose}; leave it out (the checkpoint's own "
                           "is used)")
    return dataclasses.replace(cfg, model=model, tokenizer=str(tokenizer))


def with_teacher(cfg: TrainConfig) -> TrainConfig:
    """The config with the teacher's tokenizer, after checking that the student can learn from it:
    the same tokenizer (token ids mean the same text) and the same vocabulary size."""
    teacher = Path(cfg.teacher)
    if not teacher.is_dir():
        raise SpecdecError(f"the teacher {teacher} does not exist; give the target checkpoint folder to "
                           "distil from, e.g. --teacher models/target")
    vocab = LlamaConfig.from_dict(read_config(teacher)).vocab_size
    if cfg.parallel and cfg.model.vocab_size == vocab:  # the mask token: one id past the teacher's vocabulary
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=vocab + 1))
    tokenizer = teacher / TOKENIZER
    if not tokenizer.exists():
        raise SpecdecError(f"the teacher {teacher} has no {TOKENIZER}; the draft must use the teacher's tokenizer")
    if cfg.tokenizer and Path(cfg.tokenizer).read_bytes() != tokenizer.read_bytes():
        what = f"--init-from {cfg.init_from}" if cfg.init_from else f"--tokenizer {cfg.tokenizer}"
        raise SpecdecError(f"{what} uses another tokenizer than the teacher {teacher}; a draft distilled from "
                           "a target must share its tokenizer (start from scratch or from a draft of that target)")
    if cfg.model.vocab_size != vocab + cfg.parallel:
        raise SpecdecError(f"the student has a vocabulary of {cfg.model.vocab_size} tokens but the teacher "
                           f"{teacher} has {vocab}; they must agree (set --vocab-size {vocab})"
                           + (", a parallel draft adding its mask token" if cfg.parallel else ""))
    return dataclasses.replace(cfg, tokenizer=str(tokenizer))


def lr_at(cfg: TrainConfig, step: int) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


BLOCK_EVAL_ANCHORS = 32  # blocks per validation window (the same anchors at every validation)


@torch.no_grad()
def evaluate(model, heads: MTPHeads | EagleHead | BlockHead | None, tokens: np.ndarray, seq_len: int,
             max_windows: int, teacher=None, eagle_steps: int = 0, parallel_k: int = 0) -> list[float]:
    """Mean validation losses over evenly spread windows: [next-token, head 1, .., head depth], or
    with a teacher [KL(teacher || model), greedy agreement, next-token] (objectives.distill_metrics),
    or for an EAGLE head [KL per step.., alpha per position..] (objectives.eagle_metrics; the alphas
    pooled over all windows), or for a block head the same per block slot (objectives.block_metrics,
    eagle_steps = its block size), or for a parallel draft of `parallel_k` slots the same per slot
    (objectives.parallel_metrics). A progress bar on stderr: the final evaluation takes a while."""
    was_training = model.training
    model.eval()
    losses = []
    steps = parallel_k or eagle_steps
    anchors = torch.Generator().manual_seed(0)
    for b in tqdm(list(eval_batches(tokens, seq_len, max_windows)), desc="evaluate", unit="batch", leave=False,
                  file=sys.stderr):
        b = b.to(device_of(model))
        if parallel_k:
            losses.append(parallel_metrics(model, teacher, b, evaluation_layout(seq_len, parallel_k, b.device),
                                           model.config.vocab_size - 1))
            continue
        if teacher is not None:
            losses.append(distill_metrics(model, teacher, b))
            continue
        if isinstance(heads, EagleHead):
            losses.append(eagle_metrics(model, heads, b, eagle_steps))
            continue
        if isinstance(heads, BlockHead):
            losses.append(block_metrics(model, heads, b, BLOCK_EVAL_ANCHORS, anchors))
            continue
        parts = [next_token_loss(model, b)] if heads is None else mtp_losses(model, heads, b, train_trunk=False)
        losses.append([part.item() for part in parts])
    model.train(was_training)
    if isinstance(heads, (EagleHead, BlockHead)) or parallel_k:  # alphas pooled over counts, not a mean of ratios
        kls, alphas, reached = (np.array([row[i * steps:(i + 1) * steps] for row in losses]) for i in range(3))
        pooled = (alphas * reached).sum(0) / np.maximum(reached.sum(0), 1)
        return [float(x) for x in (*kls.mean(0), *pooled)]
    return [float(x) for x in np.mean(losses, axis=0)]


class Run:
    """Everything about one training run that is saved to and restored from work/state."""

    def __init__(self, cfg: TrainConfig, trunk_sha256: str | None = None, teacher_sha256: str | None = None,
                 init_sha256: str | None = None):
        self.cfg = cfg
        self.trunk_sha256 = trunk_sha256  # of the frozen trunk's weights file
        self.teacher_sha256 = teacher_sha256  # of the distillation teacher's weights file
        self.init_sha256 = init_sha256  # of the weights the model started from (--init-from)
        self.out = Path(cfg.out)
        self.work = self.out / "work"
        self.rank = int(os.environ.get("RANK", 0))
        self.world = int(os.environ.get("WORLD_SIZE", 1))

    # --- preparation (rank 0 only; the others wait) -------------------------------------
    def prepare(self) -> None:
        key = preparation_key(self.cfg.corpus, self.cfg.text_vocab, self.cfg.tokenizer, self.cfg.seq_len)
        if not self.prepared_for(key):
            self._prepare(key)

    def prepared_for(self, key: dict) -> bool:
        """Whether work/ holds tokens prepared for `key`; prepared for another corpus, vocabulary
        size or tokenizer while a run is under way there is an error (its weights expect them)."""
        prepared = self.work / "prepared.json"
        if not prepared.exists():
            return False
        saved = json.loads(prepared.read_text()).get("key", key)  # runs prepared before keys: trusted
        if saved == key:
            return True
        changed = ", ".join(k.replace("_", " ") for k in key if saved.get(k) != key[k])
        if (self.work / "state").exists():
            raise SpecdecError(f"{self.out} holds a run prepared with another {changed}; resume it with its "
                               "original options, or start over with a new --out (or delete that folder)")
        print(f"specdec: {self.work} was prepared with another {changed}: preparing it again", file=sys.stderr)
        return False

    def _prepare(self, key: dict) -> None:
        corpus = Corpus(self.cfg.corpus)
        self.work.mkdir(parents=True, exist_ok=True)
        if self.cfg.tokenizer:
            tok = Tokenizer.load(self.cfg.tokenizer)
        else:
            tok = Tokenizer.train((d.text for d in corpus.splits["train"]), self.cfg.model.vocab_size)
        if tok.vocab_size != self.cfg.text_vocab:
            raise SpecdecError(f"the tokenizer has {tok.vocab_size} tokens but the model expects "
                               f"{self.cfg.text_vocab}; set --vocab-size {tok.vocab_size}")
        tok.save(self.work / "tokenizer.json")
        arrays = {split: tokenize(docs, tok) if docs else np.zeros(0, np.int32)
                  for split, docs in corpus.splits.items()}
        needed = 4 * (self.cfg.seq_len + 1)
        if len(arrays["valid"]) < needed:
            # a small corpus may hash no document into validation: hold out its last tokens instead
            arrays["valid"] = np.concatenate([arrays["valid"], arrays["train"][-needed:]])
            arrays["train"] = arrays["train"][:-needed]
        for split, arr in arrays.items():
            np.save(self.work / f"tokens-{split}.npy", arr)
        counts = {split: int(len(arr)) for split, arr in arrays.items()}
        prov = corpus.provenance()
        prov["tokens"] = counts
        prov["key"] = key
        (self.work / "prepared.json").write_text(json.dumps(prov, indent=1))

    def tokens(self, split: str) -> np.ndarray:
        return np.load(self.work / f"tokens-{split}.npy", mmap_mode="r")

    # --- state --------------------------------------------------------------------------
    def identity(self) -> dict:
        return _identity(asdict(self.cfg), self.trunk_sha256, self.teacher_sha256, self.init_sha256)

    def save_state(self, model, heads, opt, step: int, history: dict, elapsed: float) -> None:
        tensors = {}
        if self.trunk_sha256 is None:
            tensors.update({f"model.{k}": v.detach().contiguous() for k, v in model.hf_state_dict().items()})
        if heads is not None:
            tensors.update({f"heads.{k}": v.detach().contiguous() for k, v in heads.state_dict().items()})
        for i, st in opt.state_dict()["state"].items():
            for name, value in st.items():
                tensors[f"opt.{i}.{name}"] = value.detach().reshape(-1).contiguous() if value.dim() == 0 \
                    else value.detach().contiguous()
        with atomic_dir(self.work / "state") as tmp:
            save_file(tensors, tmp / "state.safetensors")
            (tmp / "state.json").write_text(json.dumps(
                {"step": step, "elapsed": elapsed, "history": history, "config": asdict(self.cfg),
                 "frozen_trunk_sha256": self.trunk_sha256, "teacher_sha256": self.teacher_sha256,
                 "init_from_sha256": self.init_sha256}))

    def load_state(self, model, heads, opt):
        state_dir = self.work / "state"
        recover(state_dir)  # a save killed between its renames left the newest state beside the folder
        if not (state_dir / "state.json").exists():
            return 0, {"train": [], "valid": []}, 0.0
        meta = json.loads((state_dir / "state.json").read_text())
        saved = _identity(meta["config"], meta.get("frozen_trunk_sha256"), meta.get("teacher_sha256"),
                          meta.get("init_from_sha256"))
        if saved != self.identity():
            changed = [k for k, v in self.identity().items() if saved[k] != v]
            raise SpecdecError(f"{state_dir} was saved with another {', '.join(changed)}; use a new --out "
                               "or delete that folder to start over")
        tensors = load_file(state_dir / "state.safetensors")
        if self.trunk_sha256 is None:
            model.load_hf_state_dict({k[6:]: v for k, v in tensors.items() if k.startswith("model.")})
        if heads is not None:
            heads.load_state_dict({k[6:]: v for k, v in tensors.items() if k.startswith("heads.")})
        opt_state: dict = {}
        for k, v in tensors.items():
            if k.startswith("opt."):
                _, i, name = k.split(".", 2)
                opt_state.setdefault(int(i), {})[name] = v.reshape(()) if name == "step" else v
        sd = opt.state_dict()
        sd["state"] = opt_state
        opt.load_state_dict(sd)
        return meta["step"], meta["history"], meta["elapsed"]


def _identity(config: dict, trunk_sha256: str | None, teacher_sha256: str | None = None,
              init_sha256: str | None = None) -> dict:
    """What a resumed run must share with the saved one (configs saved before MTP existed are
    next-token runs, before distillation existed had no teacher)."""
    objective = config.get("objective", "next-token")
    return {"model": config["model"], "objective": objective,
            "mtp_depth": config.get("mtp_depth") if objective.startswith("mtp") else None,
            "frozen trunk": trunk_sha256, "teacher": teacher_sha256, "initial weights": init_sha256,
            "distillation temperature and top-k": (config.get("distill_temperature"), config.get("distill_top_k"))
            if objective == "distill" else None,
            "EAGLE layers, draft vocabulary and layout": (None if config.get("eagle_layers") is None else
                                                          list(config["eagle_layers"]), config.get("draft_vocab"),
                                                          config.get("eagle_layout", "specdec"))
            if objective == "eagle" else None,
            "parallel block and anchors": (config.get("parallel_block"), config.get("parallel_anchors"))
            if objective == "parallel" else None,
            "block head layers, draft vocabulary, block size, attention and depth": (
                None if config.get("eagle_layers") is None else list(config["eagle_layers"]), config.get("draft_vocab"),
                config.get("block_size"), config.get("block_attention"), config.get("block_layers"))
            if objective == "block" else None}


def build(cfg: TrainConfig) -> tuple[LlamaForCausalLM, MTPHeads | None]:
    """The trunk (fresh from the seed, or the frozen checkpoint in fp32) and the MTP heads. The
    initial weights come from torch's global generator seeded with cfg.seed; the caller's
    generator state is given back afterwards."""
    with torch.random.fork_rng(devices=[]):
        return _build(cfg)


def _build(cfg: TrainConfig) -> tuple[LlamaForCausalLM, MTPHeads | None]:
    torch.manual_seed(cfg.seed)
    if cfg.frozen:
        model = load_model(cfg.frozen, dtype=torch.float32).requires_grad_(False)
    else:
        model = LlamaForCausalLM(cfg.model)
        init_weights(model)
        if cfg.init_from:
            state = load_file(Path(cfg.init_from) / WEIGHTS)
            model.load_hf_state_dict(with_vocabulary({k: v.float() for k, v in state.items()}, cfg.model.vocab_size))
    heads = None
    if cfg.mtp:
        heads = build_heads(cfg.objective, cfg.model, cfg.mtp_depth)
        init_weights(heads)
    return model.train(not cfg.frozen), heads


def with_vocabulary(state: dict[str, torch.Tensor], vocab: int) -> dict[str, torch.Tensor]:
    """Weights of a model with one token fewer than `vocab` given the new one (a parallel draft's
    mask token, started from a plain draft model): its embedding and unembedding rows are the
    mean of the others'. Weights of the right size come back as they are."""
    grown = dict(state)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        if name in grown and grown[name].shape[0] == vocab - 1:
            grown[name] = torch.cat([grown[name], grown[name].mean(0, keepdim=True)])
    return grown


def parallel_layout(cfg: TrainConfig, step: int, micro: int, device) -> BlockLayout:
    """The training layout of micro-batch `micro` of `step`: its random anchors follow from the seed
    and the step alone, so a resumed run draws the same ones."""
    generator = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step * 1_009 + micro)
    anchors = random_anchors(cfg.seq_len, cfg.parallel_block, cfg.parallel_anchors, generator, device)
    return block_layout(cfg.seq_len, anchors, cfg.parallel_block)


def evaluation_layout(seq_len: int, k: int, device) -> BlockLayout:
    """Anchors every k positions of a validation window: the same blocks in every evaluation."""
    return block_layout(seq_len, torch.arange(0, seq_len - k + 1, k, device=device), k)


def build_eagle(cfg: TrainConfig, target: LlamaForCausalLM, train_tokens: np.ndarray) -> EagleHead | BlockHead:
    """A fresh EAGLE head (or block head, for the block objective) for the frozen target over the
    draft_vocab ids most frequent in the training tokens, from the seed (the caller's generator
    state is given back)."""
    counts = torch.from_numpy(np.bincount(train_tokens, minlength=cfg.model.vocab_size))
    if cfg.draft_vocab > cfg.model.vocab_size:
        raise SpecdecError(f"a draft vocabulary of {cfg.draft_vocab} tokens is larger than the target's "
                           f"{cfg.model.vocab_size}: choose --draft-vocab <= {cfg.model.vocab_size}")
    ids = counts.topk(cfg.draft_vocab).indices.sort().values
    layers = cfg.eagle_layers if cfg.eagle_layers is not None else default_layer_ids(cfg.model.num_hidden_layers)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        head = (initial_block_head(target, layers, ids, cfg.block_size, cfg.block_layers,
                                   cfg.block_attention == "causal") if cfg.block else
                initial_head(target, layers, ids, cfg.eagle_layout))
    head.token_counts = counts  # saved with it: a smaller draft vocabulary can be chosen at drafting time
    return head


def load_teacher(path: str) -> LlamaForCausalLM:
    """The frozen teacher in fp32, computing exactly as the target does at inference."""
    return load_model(path, dtype=torch.float32).requires_grad_(False)


def train(cfg: TrainConfig, command: list[str] | None = None) -> Path | None:
    """Run (or resume) training; return the exported model folder (the heads folder when the
    trunk is frozen), or None if stopped early. `command`: the command line that reproduces the
    run, recorded in the exported metadata."""
    if cfg.frozen_trunk:
        cfg = with_frozen_trunk(cfg)
    if cfg.target:
        cfg = with_eagle_target(cfg)
    if cfg.init_from:
        cfg = with_init_from(cfg)
    if cfg.teacher is not None:
        cfg = with_teacher(cfg)
    cfg.validate()
    run = Run(cfg, sha256(Path(cfg.frozen) / WEIGHTS) if cfg.frozen else None,
              sha256(Path(cfg.teacher) / WEIGHTS) if cfg.teacher else None,
              sha256(Path(cfg.init_from) / WEIGHTS) if cfg.init_from else None)
    distributed = run.world > 1
    device = resolve_device(cfg.device)
    if device.type == "cuda" and distributed:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    if distributed:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    if run.rank == 0:
        run.prepare()
    if distributed:
        dist.barrier()
    if cfg.batch_size % run.world:
        raise SpecdecError(f"batch_size {cfg.batch_size} must divide evenly over {run.world} processes")
    train_tokens, valid_tokens = run.tokens("train"), run.tokens("valid")

    model, heads = build(cfg)
    if cfg.eagle or cfg.block:
        heads = build_eagle(cfg, model, train_tokens)
    place(model, device)
    if heads is not None:
        place(heads, device)
    teacher = place(load_teacher(cfg.teacher), device) if cfg.teacher else None
    train_trunk = not cfg.frozen
    params = [*(model.parameters() if train_trunk else ()), *(heads.parameters() if heads is not None else ())]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay, fused=False)
    step, history, elapsed = run.load_state(model, heads, opt)
    weights = cfg.loss_weights()

    per_rank = cfg.batch_size // run.world
    bar = tqdm(total=cfg.steps, initial=step, disable=run.rank != 0, desc="train", unit="step",
               dynamic_ncols=True)
    t_start = time.time() - elapsed
    parallel_k = cfg.parallel_block if cfg.parallel else 0
    if teacher is not None and step == 0 and run.rank == 0:
        # the starting point's validation figures: the "before" of the distillation
        _record(history, "valid", 0, evaluate(model, None, valid_tokens, cfg.seq_len, cfg.eval_windows, teacher,
                                              parallel_k=parallel_k), None, distill=not parallel_k,
                parallel_k=parallel_k)
    if (cfg.eagle or cfg.block) and step == 0 and run.rank == 0:  # the untrained head: the "before" of its curves
        _record(history, "valid", 0, evaluate(model, heads, valid_tokens, cfg.seq_len, cfg.eval_windows,
                                              eagle_steps=cfg.head_steps), heads)
    last = cfg.steps if cfg.stop_after is None else min(cfg.steps, step + cfg.stop_after)
    interrupt = Interrupt()  # a signal ends the loop after the step under way, its state saved
    while step < last:
        t0 = time.time()
        for group in opt.param_groups:
            group["lr"] = lr_at(cfg, step)
        batch = window_batch(train_tokens, cfg.seed, step, cfg.batch_size, cfg.seq_len)
        batch = batch[run.rank * per_rank:(run.rank + 1) * per_rank]
        loss_sums = None
        for i, mb in enumerate(batch.to(device).split(cfg.micro_batch)):
            # each process contributes its share of the global mean; gradients are averaged over processes
            scale = mb.shape[0] * run.world / cfg.batch_size
            if parallel_k:
                layout = parallel_layout(cfg, step, run.rank * 1_000 + i, device)
                losses = parallel_backward(model, teacher, mb, layout, cfg.model.vocab_size - 1, scale)
            elif teacher is not None:
                loss = distill_loss(model, teacher, mb, cfg.distill_temperature, cfg.distill_top_k)
                (loss * scale).backward()
                losses = [loss.item()]
            elif cfg.eagle:
                losses = eagle_backward(model, heads, mb, cfg.eagle_steps, cfg.eagle_decay, scale)
            elif cfg.block:  # the anchors, like the batches, a pure function of (seed, step, rank, micro-batch)
                anchors = torch.Generator().manual_seed(((cfg.seed * 1_000_003 + step) * 1009 + run.rank) * 1009 + i)
                losses = block_backward(model, heads, mb, cfg.block_anchors, scale, anchors)
            elif heads is None:
                loss = next_token_loss(model, mb)
                (loss * scale).backward()
                losses = [loss.item()]
            else:
                losses = mtp_backward(model, heads, mb, weights.at(step, cfg.steps), scale, train_trunk,
                                      cfg.mtp_memory_saving)
            parts = np.array([np.nan if x is None else x * mb.shape[0] for x in losses])
            loss_sums = parts if loss_sums is None else loss_sums + parts
        if distributed:
            _average_gradients(params, run.world)
        gnorm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        train_losses = [_mean_over_ranks(x / per_rank, distributed, device) for x in loss_sums]
        _record(history, "train", step, train_losses, heads, parallel_k=parallel_k)
        tok_s = cfg.batch_size * cfg.seq_len / (time.time() - t0)
        if run.rank == 0 and (step % cfg.eval_every == 0 or step == cfg.steps):
            _record(history, "valid", step,
                    evaluate(model, heads, valid_tokens, cfg.seq_len, cfg.eval_windows, teacher, cfg.head_steps,
                             parallel_k), heads, distill=teacher is not None and not parallel_k, parallel_k=parallel_k)
        bar.set_postfix(loss=f"{history['train'][-1][1]:.3f}",
                        val=f"{history['valid'][-1][1]:.3f}" if history["valid"] else "-",
                        **({"agree": f"{history['valid_agreement'][-1][1]:.3f}"} if history.get("valid_agreement")
                           else {}),
                        **({"alpha": "/".join(f"{x:.2f}" for x in history["valid_alpha"][-1][1])}
                           if history.get("valid_alpha") else {}),
                        **({"heads": "/".join(f"{x:.2f}" for x in history["train_heads"][-1][1])} if heads else {}),
                        tok_s=f"{tok_s:.0f}", gnorm=f"{float(gnorm):.2f}")
        bar.update(1)
        if run.rank == 0 and (step % cfg.save_every == 0 or step == last or interrupt.received):
            run.save_state(model, heads, opt, step, history, time.time() - t_start)
        if distributed:
            dist.barrier()
        if interrupt.received:
            break
    interrupt.restore()
    bar.close()
    if run.rank == 0 and step < cfg.steps and not cfg.frozen:
        # a run folder always holds a checkpoint `generate --model` loads: the weights of this step
        save_model(model, run.out / "latest", tokenizer_file=run.work / "tokenizer.json",
                   meta={"kind": "target-or-draft-model", "partial": {"step": step, "steps": cfg.steps},
                         "recipe": asdict(cfg)})
    if run.rank == 0 and step == cfg.steps:
        export(run, model, heads, history, time.time() - t_start, teacher, command)
    if distributed:
        dist.destroy_process_group()
    if step < cfg.steps:
        return None
    return run.out / ("heads" if cfg.frozen else "model")


class Interrupt:
    """SIGINT or SIGTERM while training: the step under way finishes, the state is saved and the
    loop leaves (`received`); a second signal leaves at once (KeyboardInterrupt). Installed on
    creation (only the main thread takes signals; elsewhere this does nothing), `restore` puts
    the previous handlers back."""

    def __init__(self):
        self.received: int | None = None
        self.previous = {}
        if threading.current_thread() is threading.main_thread():
            self.previous = {s: signal.signal(s, self.handle) for s in (signal.SIGINT, signal.SIGTERM)}

    def handle(self, signum, frame) -> None:
        if self.received is not None:
            raise KeyboardInterrupt
        self.received = signum

    def restore(self) -> None:
        for s, handler in self.previous.items():
            signal.signal(s, handler)


def stopped_at(out: str | Path) -> int | None:
    """The step a stopped run saved (None: no state yet)."""
    state = Path(out) / "work" / "state" / "state.json"
    return json.loads(state.read_text())["step"] if state.exists() else None


def _record(history: dict, split: str, step: int, losses: list[float], heads, distill: bool = False,
            parallel_k: int = 0) -> None:
    """history[split]: [step, headline loss]: the next-token loss, or the mean of the heads' losses
    where it was not computed (a frozen trunk in training); history[split + "_heads"]: [step,
    [loss of head 1..depth]]. Distillation: the headline is KL(target || draft); validation also
    records [step, greedy agreement] and [step, next-token loss] under split + "_agreement" and
    split + "_next_token". A parallel draft of `parallel_k` slots: the headline is the mean of the slots' KL,
    split + "_heads" the KL per slot and (validation) split + "_alpha" the acceptance per slot."""
    if distill and split == "valid":
        kl, agreement, next_token = losses
        history[split].append([step, kl])
        history.setdefault(f"{split}_agreement", []).append([step, agreement])
        history.setdefault(f"{split}_next_token", []).append([step, next_token])
        return
    if parallel_k and split == "train":
        history[split].append([step, float(np.mean(losses))])
        history.setdefault(f"{split}_heads", []).append([step, losses])
        return
    if heads is None and not parallel_k:
        history[split].append([step, losses[0]])
        return
    if (isinstance(heads, (EagleHead, BlockHead)) or parallel_k) and split == "valid":  # [KL per step.., alpha..]
        steps = len(losses) // 2
        history[split].append([step, float(np.mean(losses[:steps]))])
        history.setdefault(f"{split}_heads", []).append([step, losses[:steps]])
        history.setdefault(f"{split}_alpha", []).append([step, losses[steps:]])
        return
    headline = losses[0] if not math.isnan(losses[0]) else float(np.mean(losses[1:]))
    history[split].append([step, headline])
    history.setdefault(f"{split}_heads", []).append([step, losses[1:]])


def export(run: Run, model: LlamaForCausalLM, heads: MTPHeads | None, history: dict, seconds: float,
           teacher=None, command: list[str] | None = None) -> None:
    if isinstance(heads, EagleHead):
        export_eagle(run, model, heads, history, seconds, command)
        return
    if run.cfg.parallel:
        export_parallel(run, model, teacher, history, seconds, command)
        return
    if isinstance(heads, BlockHead):
        export_block(run, model, heads, history, seconds, command)
        return
    cfg = run.cfg
    prov = json.loads((run.work / "prepared.json").read_text())
    test = run.tokens("test")
    test_losses = (evaluate(model, heads, test, cfg.seq_len, cfg.test_windows, teacher)
                   if len(test) > cfg.seq_len else None)
    distilled = None
    if teacher is not None:
        test_distill, test_losses = test_losses, [test_losses[2]] if test_losses else None
        distilled = {
            "teacher": cfg.teacher, "teacher_sha256": run.teacher_sha256,
            "objective": "KL(target || draft) per position" + (f", target truncated to its top {cfg.distill_top_k}"
                                                                if cfg.distill_top_k else ""),
            "temperature": cfg.distill_temperature, "top_k": cfg.distill_top_k,
            "init_from": cfg.init_from, "init_from_sha256": run.init_sha256,
            "valid_before": _distill_figures(history, 0),
            "valid_after": _distill_figures(history, history["valid"][-1][0]) if history["valid"] else None,
            "test": dict(zip(("kl", "greedy_agreement", "next_token_loss"), test_distill)) if test_distill else None,
        }
    test_loss = test_losses[0] if test_losses else None
    meta = {
        "kind": "target-or-draft-model",
        "recipe": asdict(cfg),
        "recipe_command": " ".join(command) if command else None,
        **({"distilled_from": distilled} if distilled else {}),
        "parameters": model.num_parameters(),
        "tokens_seen": cfg.steps * cfg.batch_size * cfg.seq_len,
        "training_seconds": round(seconds, 1),
        "final_valid_loss": (history["valid_next_token" if teacher is not None else "valid"][-1][1]
                             if history["valid"] else None),
        "test_loss": test_loss,
        "test_tokens_evaluated": min(cfg.test_windows, len(test) // cfg.seq_len) * cfg.seq_len if test_loss else 0,
        "test_perplexity": math.exp(test_loss) if test_loss is not None else None,
        "corpus": {"sources": prov["sources"], "sha256": prov["sha256"], "tokens": prov["tokens"],
                   "files": prov["files"]},
        "history": history,
    }
    params = model.num_parameters()
    if cfg.frozen_trunk:
        target_sha256 = run.trunk_sha256
    else:
        if heads is not None:
            meta["mtp_heads"] = "../heads (trained jointly; plain decoding does not use them)"
        save_model(model, run.out / "model", tokenizer_file=run.work / "tokenizer.json", meta=meta)
        target_sha256 = sha256(run.out / "model" / WEIGHTS)
    if heads is not None:
        valid_heads = history["valid_heads"][-1][1] if history.get("valid_heads") else None
        heads.token_counts = torch.from_numpy(np.bincount(run.tokens("train"), minlength=cfg.model.vocab_size))
        save_heads(heads, run.out / "heads", target_sha256, meta={
            **meta, "kind": heads.kind, "trunk": "frozen" if cfg.frozen_trunk else "trained jointly",
            "target": cfg.frozen_trunk or str(run.out / "model"),
            "final_valid_head_losses": valid_heads, "test_head_losses": test_losses[1:] if test_losses else None})
        params = sum(p.numel() for p in heads.parameters())
    what = "MTP heads on a frozen trunk" if cfg.frozen_trunk else "parameters"
    title = f"{run.out.name}: {params / 1e6:.1f}M {what}"
    if teacher is not None:
        plot_distill_history(history, run.out / "loss.png", f"{title}, distilled from {Path(cfg.teacher).name}")
        return
    plot_history(history, run.out / "loss.png", title=title,
                 train_label="train, mean of the heads" if cfg.frozen_trunk else "train, next token")


def export_parallel(run: Run, model: LlamaForCausalLM, teacher, history: dict, seconds: float,
                    command: list[str] | None) -> None:
    """The parallel draft's model folder (a transformers checkpoint with one token more, its mask
    token) with the metadata proposers/parallel.py checks (mask id, block, the target's hash), its
    recipe and held-out figures, the training tokens' counts and loss.png."""
    cfg = run.cfg
    prov = json.loads((run.work / "prepared.json").read_text())
    test = run.tokens("test")
    k = cfg.parallel_block
    recipe = {**asdict(cfg), **{key: shown_path(Path(getattr(cfg, key)))
                                for key in ("teacher", "tokenizer", "out", "init_from") if getattr(cfg, key)}}
    figures = (evaluate(model, None, test, cfg.seq_len, cfg.test_windows, teacher, parallel_k=k)
               if len(test) > cfg.seq_len else None)
    before = history["valid_alpha"][0][1] if history.get("valid_alpha") else None
    meta = {
        "kind": PARALLEL_KIND,
        "parallel": {"mask_token_id": cfg.model.vocab_size - 1, "block": k, "target": recipe["teacher"],
                     "target_sha256": run.teacher_sha256},
        "recipe": recipe,
        "recipe_command": " ".join(command) if command else None,
        "objective": (f"KL(target || draft) at each of the {k} block slots of one forward over [prefix, mask x "
                      f"{k - 1}], {cfg.parallel_anchors} random anchors per window, the slots weighted alike"),
        "init_from": shown_path(Path(cfg.init_from)) if cfg.init_from else None, "init_from_sha256": run.init_sha256,
        "parameters": model.num_parameters(),
        "tokens_seen": cfg.steps * cfg.batch_size * cfg.seq_len,
        "training_seconds": round(seconds, 1),
        "valid_alpha_per_slot_before": before,
        "final_valid_slot_kl": history["valid_heads"][-1][1] if history.get("valid_heads") else None,
        "final_valid_alpha_per_slot": history["valid_alpha"][-1][1] if history.get("valid_alpha") else None,
        "test_slot_kl": figures[:k] if figures else None,
        "test_alpha_per_slot": figures[k:] if figures else None,
        "test_tokens_evaluated": min(cfg.test_windows, len(test) // cfg.seq_len) * cfg.seq_len if figures else 0,
        "alpha_note": ("greedy acceptance of block slot i given slots 1..i-1 accepted, over held-out windows whose "
                       "tokens are the target's greedy choices along the drafted path"),
        "corpus": {"sources": prov["sources"], "sha256": prov["sha256"], "tokens": prov["tokens"]},
        "history": history,
    }
    save_model(model, run.out / "model", tokenizer_file=run.work / "tokenizer.json", meta=meta)
    save_token_counts(run.out / "model", torch.from_numpy(np.bincount(run.tokens("train"),
                                                                       minlength=cfg.text_vocab)))
    plot_eagle_history(history, run.out / "loss.png",
                       f"{run.out.name}: {model.num_parameters() / 1e6:.1f}M parallel draft, block of {k}, "
                       f"distilled from {Path(cfg.teacher).name}", what="slot")


def export_eagle(run: Run, target: LlamaForCausalLM, head: EagleHead, history: dict, seconds: float,
                 command: list[str] | None) -> None:
    """The head folder (eagle.py) with its recipe, validation and test figures and the
    speculators-style description, and loss.png."""
    cfg = run.cfg
    prov = json.loads((run.work / "prepared.json").read_text())
    test = run.tokens("test")
    steps = cfg.eagle_steps
    # the repository's files named from its root (models/target), never as this machine's paths
    recipe = {**asdict(cfg), **{key: shown_path(Path(getattr(cfg, key))) for key in ("target", "tokenizer", "out")}}
    figures = (evaluate(target, head, test, cfg.seq_len, cfg.test_windows, eagle_steps=steps)
               if len(test) > cfg.seq_len else None)
    meta = {
        "recipe": recipe,
        "recipe_command": " ".join(command) if command else None,
        "target": recipe["target"],
        "speculators": speculators_metadata(head, recipe["target"], steps),
        "objective": (f"KL(target || head) over the {head.draft_vocab_size}-token draft vocabulary, unrolled "
                      f"{steps} draft steps on its own outputs (training-time test), step j weighted "
                      f"{cfg.eagle_decay}^j"),
        "tokens_seen": cfg.steps * cfg.batch_size * cfg.seq_len,
        "training_seconds": round(seconds, 1),
        "final_valid_step_kl": history["valid_heads"][-1][1] if history.get("valid_heads") else None,
        "final_valid_alpha_per_position": history["valid_alpha"][-1][1] if history.get("valid_alpha") else None,
        "test_step_kl": figures[:steps] if figures else None,
        "test_alpha_per_position": figures[steps:] if figures else None,
        "test_tokens_evaluated": min(cfg.test_windows, len(test) // cfg.seq_len) * cfg.seq_len if figures else 0,
        "alpha_note": ("greedy acceptance of draft i given drafts 1..i-1 accepted, over held-out windows whose "
                       "tokens are the target's greedy choices along the drafted path"),
        "corpus": {"sources": prov["sources"], "sha256": prov["sha256"], "tokens": prov["tokens"]},
        "history": history,
    }
    save_eagle(head, run.out / "heads", run.trunk_sha256, meta=meta)
    params = sum(p.numel() for p in head.parameters())
    plot_eagle_history(history, run.out / "loss.png",
                       f"{run.out.name}: {params / 1e6:.1f}M EAGLE head on a frozen {Path(cfg.target).name}")


def export_block(run: Run, target: LlamaForCausalLM, head: BlockHead, history: dict, seconds: float,
                 command: list[str] | None) -> None:
    """The block head folder (block.py) with its recipe, validation and test figures, and loss.png."""
    cfg = run.cfg
    prov = json.loads((run.work / "prepared.json").read_text())
    test = run.tokens("test")
    k = head.block
    recipe = {**asdict(cfg), **{key: shown_path(Path(getattr(cfg, key))) for key in ("target", "tokenizer", "out")}}
    figures = (evaluate(target, head, test, cfg.seq_len, cfg.test_windows, eagle_steps=k)
               if len(test) > cfg.seq_len else None)
    meta = {
        "recipe": recipe,
        "recipe_command": " ".join(command) if command else None,
        "target": recipe["target"],
        "objective": (f"KL(target || head) over the {head.draft_vocab_size}-token draft vocabulary at each of the {k} "
                      f"block slots ({head.attention} attention among the masks), {cfg.block_anchors} random anchors "
                      "per window, slot 0 at every window position"),
        "tokens_seen": cfg.steps * cfg.batch_size * cfg.seq_len,
        "training_seconds": round(seconds, 1),
        "final_valid_slot_kl": history["valid_heads"][-1][1] if history.get("valid_heads") else None,
        "final_valid_alpha_per_slot": history["valid_alpha"][-1][1] if history.get("valid_alpha") else None,
        "test_slot_kl": figures[:k] if figures else None,
        "test_alpha_per_slot": figures[k:] if figures else None,
        "test_tokens_evaluated": min(cfg.test_windows, len(test) // cfg.seq_len) * cfg.seq_len if figures else 0,
        "alpha_note": (f"greedy acceptance of block slot i given slots 1..i-1 accepted, over {BLOCK_EVAL_ANCHORS} "
                       "random anchors per held-out window whose tokens are the target's greedy choices along the "
                       "drafted path (train/anchors.block_acceptance)"),
        "corpus": {"sources": prov["sources"], "sha256": prov["sha256"], "tokens": prov["tokens"]},
        "history": history,
    }
    save_block(head, run.out / "heads", run.trunk_sha256, meta=meta)
    params = sum(p.numel() for p in head.parameters())
    plot_eagle_history(history, run.out / "loss.png", f"{run.out.name}: {params / 1e6:.1f}M block head "
                       f"({head.attention}, k={k}) on a frozen {Path(cfg.target).name}")


def plot_eagle_history(history: dict, path: Path, title: str, what: str = "step") -> None:
    """Training KL (mean of the unrolled steps, or of a parallel draft's block slots: `what`),
    validation KL per step and alpha per position."""
    fig, ax = _figure((7, 4.5))
    _curve(ax, history["train"], alpha=0.5, label=f"train KL, mean of the {what}s")
    if history.get("valid_heads"):
        s, per_step = zip(*history["valid_heads"])
        for j, l in enumerate(zip(*per_step)):
            ax.plot(s, l, marker=".", linestyle="--", label=f"validation KL, draft {j + 1}")
    ax.set(xlabel="step", ylabel="KL(target || draft) (nats per token)", title=title)
    right = None
    if history.get("valid_alpha"):
        right = ax.twinx()
        s, per_position = zip(*history["valid_alpha"])
        for j, a in enumerate(zip(*per_position)):
            right.plot(s, a, marker="s", markersize=3, label=f"validation greedy α_{j + 1}")
        right.set(ylabel="α_i (greedy acceptance)", ylim=(0, 1))
    _save(fig, ax, path, right, loc="center right", fontsize=7)


def _distill_figures(history: dict, step: int) -> dict | None:
    """Validation KL, greedy agreement and next-token loss recorded at `step`, if any."""
    for (s, kl), (_, agreement), (_, next_token) in zip(history["valid"], history.get("valid_agreement", []),
                                                         history.get("valid_next_token", [])):
        if s == step:
            return {"step": s, "kl": kl, "greedy_agreement": agreement, "next_token_loss": next_token}
    return None


def plot_distill_history(history: dict, path: Path, title: str) -> None:
    """KL(target || draft) in training and validation, and the validation greedy agreement."""
    fig, ax = _figure((6, 4))
    _curve(ax, history["train"], alpha=0.5, label="train KL")
    _curve(ax, history["valid"], marker="o", label="validation KL")
    ax.set(xlabel="step", ylabel="KL(target || draft) (nats per token)", title=title)
    right = None
    if history.get("valid_agreement"):
        right = ax.twinx()
        _curve(right, history["valid_agreement"], marker="s", color="tab:green", label="validation greedy agreement")
        right.set_ylabel("argmax(draft) == argmax(target)")
    _save(fig, ax, path, right, loc="center right")


def plot_history(history: dict, path: Path, title: str, train_label: str = "train") -> None:
    fig, ax = _figure((6, 4))
    _curve(ax, history["train"], alpha=0.5, label=train_label)
    _curve(ax, history["valid"], marker="o", label="validation, next token")
    if history.get("valid_heads"):
        s, per_head = zip(*history["valid_heads"])
        for j, l in enumerate(zip(*per_head)):
            ax.plot(s, l, marker=".", linestyle="--", label=f"validation, MTP head {j + 1} (t+{j + 2})")
    ax.set(xlabel="step", ylabel="cross-entropy (nats)", title=title)
    _save(fig, ax, path)


def _figure(size: tuple[float, float]):
    """A figure and its axes for a training curve, drawn without a display."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt.subplots(figsize=size)


def _curve(ax, points: list, **style) -> None:
    """(step, value) points as one line, if there are any."""
    if points:
        s, v = zip(*points)
        ax.plot(s, v, **style)


def _save(fig, ax, path: Path, right=None, **legend) -> None:
    """The grid, one legend for both axes (`right`: a twin axis, if any), then the figure at `path`."""
    import matplotlib.pyplot as plt
    ax.grid(alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    if right is not None:
        more_handles, more_labels = right.get_legend_handles_labels()
        handles, labels = handles + more_handles, labels + more_labels
    ax.legend(handles, labels, **legend)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def init_weights(model: torch.nn.Module, std: float = 0.02) -> None:
    for name, p in model.named_parameters():
        if p.dim() == 2:
            torch.nn.init.normal_(p, std=std)
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                p.data /= math.sqrt(2 * model.config.num_hidden_layers)


def _average_gradients(params: list[torch.nn.Parameter], world: int) -> None:
    """Sum the gradients over processes in one all-reduce, divided by the number of processes."""
    grads = [p.grad for p in params if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat /= world
    for g, part in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(part.view_as(g))


def _mean_over_ranks(x: float, distributed: bool, device: torch.device) -> float:
    if not distributed:
        return x
    t = torch.tensor([x], dtype=torch.float64, device=device)  # where the process group's backend reduces
    dist.all_reduce(t)
    return float(t) / dist.get_world_size()
