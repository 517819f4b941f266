"""A training run's settings: `TrainConfig` holds what every run has (model, data, optimiser,
schedule, validation, checkpoints) and one objective (objectives.py) with its own few settings.
Before a run starts, the config takes the model config and tokenizer of the checkpoints it reads
(`prepared`): a frozen trunk or target, a starting checkpoint, a teacher.

This module knows nothing about the training loop, losses or exports.
"""
from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..errors import SpecdecError
from ..lm import gguf
from ..lm.arch import Arch
from ..lm.checkpoint import TOKENIZER, read_config
from .objectives import NextToken, Objective


@dataclass
class TrainConfig:
    out: str
    model: Arch = field(default_factory=Arch)
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
    init_from: str | None = None        # a checkpoint folder: start from its weights (and its model config)
    objective: Objective = field(default_factory=NextToken)  # what is trained, with its own settings

    def validate(self) -> None:
        if self.steps <= 0 or self.batch_size <= 0 or self.micro_batch <= 0 or self.seq_len <= 1:
            raise SpecdecError("steps, batch_size, micro_batch must be positive and seq_len > 1")
        if self.seq_len > self.model.max_position_embeddings:
            raise SpecdecError(f"seq_len {self.seq_len} exceeds the model context "
                               f"{self.model.max_position_embeddings}")
        if self.init_from and self.frozen:
            raise SpecdecError("--init-from starts a trained model from a checkpoint; a frozen trunk trains no "
                               "model weights: give one of them")
        self.objective.validate(self)

    @property
    def frozen(self) -> str | None:
        """The checkpoint whose weights stay frozen (MTP heads' trunk, an EAGLE or block head's target), if any."""
        return self.objective.frozen

    @property
    def text_vocab(self) -> int:
        """The tokenizer's vocabulary: the model's, less the tokens the objective adds (a mask token)."""
        return self.model.vocab_size - self.objective.added_tokens

    def recipe(self) -> dict:
        """The settings as plain data (the objective as its name and settings), as saved with a run."""
        return {**asdict(self), "objective": {"name": self.objective.name, **asdict(self.objective)}}


def gguf_converted(init_from: str | None, objective: Objective) -> tuple[str | None, Objective]:
    """--init-from and the objective's models (frozen trunk, teacher, target) with each .gguf file
    replaced by its converted checkpoint folder (lm/gguf.py: converted once, then reused)."""
    def folder(path):
        return str(gguf.folder(path)) if path and gguf.is_gguf(path) else path
    models = {f.name: folder(getattr(objective, f.name)) for f in dataclasses.fields(objective)
              if f.name in ("frozen_trunk", "teacher", "target")}
    return folder(init_from), dataclasses.replace(objective, **models)


def prepared(cfg: TrainConfig) -> TrainConfig:
    """The config with the model config and tokenizer of the checkpoints it reads, checked."""
    if cfg.frozen:
        cfg = with_frozen(cfg)
    if cfg.init_from:
        cfg = with_init_from(cfg)
    if cfg.objective.teacher is not None:
        cfg = with_teacher(cfg)
    cfg.validate()
    return cfg


def with_frozen(cfg: TrainConfig) -> TrainConfig:
    """The config with the frozen checkpoint's model config and tokenizer (the heads trained on it
    share its token ids)."""
    why, whose = cfg.objective.frozen_tokenizer
    return adopt_checkpoint(cfg, Path(cfg.frozen), why, whose)


def with_init_from(cfg: TrainConfig) -> TrainConfig:
    """The config with the starting checkpoint's model config and tokenizer (its weights need them)."""
    start = Path(cfg.init_from)
    return adopt_checkpoint(cfg, start, "a model fine-tuned from it must keep its tokenizer",
                            f"the tokenizer of --init-from {start}")


def adopt_checkpoint(cfg: TrainConfig, path: Path, why: str, whose: str) -> TrainConfig:
    """cfg with the model config and tokenizer of the checkpoint at `path`; a --tokenizer that is
    not that checkpoint's is refused."""
    model = Arch.from_dict(read_config(path))
    tokenizer = path / TOKENIZER
    if not tokenizer.exists():
        raise SpecdecError(f"{path} has no {TOKENIZER}; {why}")
    if cfg.tokenizer and Path(cfg.tokenizer).read_bytes() != tokenizer.read_bytes():
        raise SpecdecError(f"--tokenizer {cfg.tokenizer} is not {whose}; leave it out (the checkpoint's own "
                           "is used)")
    return dataclasses.replace(cfg, model=model, tokenizer=str(tokenizer))


def with_teacher(cfg: TrainConfig) -> TrainConfig:
    """The config with the teacher's tokenizer, after checking that the student can learn from it:
    the same tokenizer (token ids mean the same text) and the same vocabulary size (plus the
    tokens the objective adds: a parallel draft's mask token)."""
    teacher, added = Path(cfg.objective.teacher), cfg.objective.added_tokens
    if not teacher.is_dir():
        raise SpecdecError(f"the teacher {teacher} does not exist; give the target checkpoint folder to "
                           "distil from, e.g. --teacher models/target")
    vocab = Arch.from_dict(read_config(teacher)).vocab_size
    if added and cfg.model.vocab_size == vocab:  # the mask token: one id past the teacher's vocabulary
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=vocab + added))
    tokenizer = teacher / TOKENIZER
    if not tokenizer.exists():
        raise SpecdecError(f"the teacher {teacher} has no {TOKENIZER}; the draft must use the teacher's tokenizer")
    if cfg.tokenizer and Path(cfg.tokenizer).read_bytes() != tokenizer.read_bytes():
        what = f"--init-from {cfg.init_from}" if cfg.init_from else f"--tokenizer {cfg.tokenizer}"
        raise SpecdecError(f"{what} uses another tokenizer than the teacher {teacher}; a draft distilled from "
                           "a target must share its tokenizer (start from scratch or from a draft of that target)")
    if cfg.model.vocab_size != vocab + added:
        raise SpecdecError(f"the student has a vocabulary of {cfg.model.vocab_size} tokens but the teacher "
                           f"{teacher} has {vocab}; they must agree (set --vocab-size {vocab})"
                           + (", a parallel draft adding its mask token" if added else ""))
    return dataclasses.replace(cfg, tokenizer=str(tokenizer))


@dataclass(frozen=True)
class LongRun:
    """One long run's settings (train/longrun.py); recorded in its state and in every snapshot."""
    init: str                            # the committed head folder the run starts from
    target: str | None = None            # the target checkpoint folder (None: specdec's default target)
    device: str = "cpu"                  # where the target, the teacher, the generator and the head run:
                                         # cpu, or cuda (the generator is then the bf16 teacher: quantize None)
    seed: int = 0                        # the prompt order and the training windows
    shard_prompts: int = 48              # prompts per data shard (each answered greedily and sampled)
    capacity: int = 32                   # rows the engine decodes together
    max_new_tokens: int = 256            # per answer
    temperature: float = 0.8             # the sampled answer's
    quantize: str | None = "q8_0"        # the data generator's target (the head trains on the full target)
    kv_cache: str | None = "bfloat16"    # the training data generator's KV cache (None: fp32; held-out answers: fp32)
    teacher: str = "auto"                # the dtype the frozen target computes training windows in: float32,
                                         # bfloat16, or auto (bfloat16 where the CPU multiplies it in hardware);
                                         # the held-out evaluation reads the fp32 target, as drafting does
    lookup: bool = False                 # n-gram lookup speculation while generating (k chosen where it pays)
    passes: float = 3.0                  # tokens trained on per token generated
    seq_len: int = 256
    batch_size: int = 8                  # windows per optimizer step
    lr: float = 1e-3
    warmup: int = 20                     # steps of this run's warmup (it starts from a trained head)
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    decay: float = 0.8                   # draft step j's loss weight is decay^j
    steps: int = 4                       # draft steps unrolled in training and evaluated
    heldout_prompts: int = 32            # held-out prompts per group of EVAL_KINDS
    heldout_new_tokens: int = 192
    eval_at: tuple[int, ...] = (300_000, 500_000, 750_000, 1_000_000, 1_500_000, 2_000_000, 3_000_000,
                                5_000_000, 7_500_000, 10_000_000, 15_000_000, 20_000_000, 30_000_000,
                                50_000_000, 75_000_000, 100_000_000)  # tokens seen (the init head's included)
    save_seconds: float = 240.0

    def __post_init__(self):
        if self.kv_cache not in (None, "float32", "bfloat16"):
            raise SpecdecError(f"a long run's kv_cache is float32 or bfloat16 (or None: the model's), "
                               f"not {self.kv_cache!r}")
        if self.device != "cpu" and self.quantize is not None:
            raise SpecdecError(f"a long run on {self.device} generates its data with the bf16 target (specdec's "
                               f"quantized kernels run on the CPU): set quantize None, not {self.quantize!r}")
        if self.teacher not in ("auto", "float32", "bfloat16"):
            raise SpecdecError(f"a long run's teacher is auto, float32 or bfloat16, not {self.teacher!r}")
