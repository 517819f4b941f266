"""`specdec train`: AdamW with warmup + cosine decay, gradient clipping, periodic validation,
atomic checkpoints with exact resume, single process or torchrun (DDP, gloo on CPU).

A run lives in one output folder:
  work/tokenizer.json, work/tokens-*.npy   prepared once (tokenizer trained on the train split)
  work/state/                              resume state: fp32 weights, optimizer moments, history
  model/                                   the exported checkpoint (bf16, transformers layout)
  loss.png                                 training and validation loss curves
Batches are a pure function of (seed, step), so an interrupted run resumes to the same result.
"""
from __future__ import annotations

import json
import math
import os
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from ..checkpoint import atomic_dir, save_model
from ..errors import SpecdecError
from ..model import LlamaConfig, LlamaForCausalLM
from ..tokenizer import Tokenizer
from .corpus import Corpus
from .data import eval_batches, tokenize, window_batch


@dataclass
class TrainConfig:
    out: str
    model: LlamaConfig = field(default_factory=LlamaConfig)
    corpus: list[str] | None = None     # None: the standard library
    tokenizer: str | None = None        # an existing tokenizer.json; None: train one
    seq_len: int = 512
    batch_size: int = 8                 # global sequences per optimizer step
    micro_batch: int = 8                # sequences per forward/backward on one process
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

    def validate(self):
        if self.steps <= 0 or self.batch_size <= 0 or self.micro_batch <= 0 or self.seq_len <= 1:
            raise SpecdecError("steps, batch_size, micro_batch must be positive and seq_len > 1")
        if self.seq_len > self.model.max_position_embeddings:
            raise SpecdecError(f"seq_len {self.seq_len} exceeds the model context "
                               f"{self.model.max_position_embeddings}")


def lr_at(cfg: TrainConfig, step: int) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def next_token_loss(model, batch: torch.Tensor) -> torch.Tensor:
    logits = model(batch[:, :-1]).logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), batch[:, 1:].reshape(-1))


@torch.no_grad()
def evaluate(model, tokens: np.ndarray, seq_len: int, max_windows: int) -> float:
    model.eval()
    losses = [next_token_loss(model, b).item() for b in eval_batches(tokens, seq_len, max_windows)]
    model.train()
    return float(np.mean(losses))


class Run:
    """Everything about one training run that is saved to and restored from work/state."""

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        self.out = Path(cfg.out)
        self.work = self.out / "work"
        self.rank = int(os.environ.get("RANK", 0))
        self.world = int(os.environ.get("WORLD_SIZE", 1))

    # --- preparation (rank 0 only; the others wait) -------------------------------------
    def prepare(self) -> None:
        if (self.work / "prepared.json").exists():
            return
        corpus = Corpus(self.cfg.corpus)
        self.work.mkdir(parents=True, exist_ok=True)
        if self.cfg.tokenizer:
            tok = Tokenizer.load(self.cfg.tokenizer)
        else:
            tok = Tokenizer.train((d.text for d in corpus.splits["train"]), self.cfg.model.vocab_size)
        if tok.vocab_size != self.cfg.model.vocab_size:
            raise SpecdecError(f"the tokenizer has {tok.vocab_size} tokens but the model expects "
                               f"{self.cfg.model.vocab_size}; set --vocab-size {tok.vocab_size}")
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
        (self.work / "prepared.json").write_text(json.dumps(prov, indent=1))

    def tokens(self, split: str) -> np.ndarray:
        return np.load(self.work / f"tokens-{split}.npy", mmap_mode="r")

    # --- state --------------------------------------------------------------------------
    def save_state(self, model, opt, step: int, history: dict, elapsed: float) -> None:
        tensors = {f"model.{k}": v.detach().contiguous() for k, v in model.hf_state_dict().items()}
        for i, st in opt.state_dict()["state"].items():
            for name, value in st.items():
                tensors[f"opt.{i}.{name}"] = value.detach().reshape(-1).contiguous() if value.dim() == 0 \
                    else value.detach().contiguous()
        with atomic_dir(self.work / "state") as tmp:
            save_file(tensors, tmp / "state.safetensors")
            (tmp / "state.json").write_text(json.dumps(
                {"step": step, "elapsed": elapsed, "history": history, "config": asdict(self.cfg)}))

    def load_state(self, model, opt):
        state_dir = self.work / "state"
        if not (state_dir / "state.json").exists():
            return 0, {"train": [], "valid": []}, 0.0
        meta = json.loads((state_dir / "state.json").read_text())
        if meta["config"]["model"] != asdict(self.cfg.model):
            raise SpecdecError(f"{state_dir} was saved with another model config; use a new --out "
                               "or delete that folder to start over")
        tensors = load_file(state_dir / "state.safetensors")
        model.load_hf_state_dict({k[6:]: v for k, v in tensors.items() if k.startswith("model.")})
        opt_state: dict = {}
        for k, v in tensors.items():
            if k.startswith("opt."):
                _, i, name = k.split(".", 2)
                opt_state.setdefault(int(i), {})[name] = v.reshape(()) if name == "step" else v
        sd = opt.state_dict()
        sd["state"] = opt_state
        opt.load_state_dict(sd)
        return meta["step"], meta["history"], meta["elapsed"]


def train(cfg: TrainConfig) -> Path | None:
    """Run (or resume) training; return the exported model folder, or None if stopped early."""
    cfg.validate()
    run = Run(cfg)
    distributed = run.world > 1
    if distributed:
        dist.init_process_group("gloo")
    if run.rank == 0:
        run.prepare()
    if distributed:
        dist.barrier()
    if cfg.batch_size % run.world:
        raise SpecdecError(f"batch_size {cfg.batch_size} must divide evenly over {run.world} processes")
    train_tokens, valid_tokens = run.tokens("train"), run.tokens("valid")

    torch.manual_seed(cfg.seed)
    model = LlamaForCausalLM(cfg.model)
    init_weights(model)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95),
                            weight_decay=cfg.weight_decay, fused=False)
    step, history, elapsed = run.load_state(model, opt)
    ddp = torch.nn.parallel.DistributedDataParallel(model) if distributed else model

    per_rank = cfg.batch_size // run.world
    bar = tqdm(total=cfg.steps, initial=step, disable=run.rank != 0, desc="train", unit="step",
               dynamic_ncols=True)
    t_start = time.time() - elapsed
    last = cfg.steps if cfg.stop_after is None else min(cfg.steps, step + cfg.stop_after)
    while step < last:
        t0 = time.time()
        for group in opt.param_groups:
            group["lr"] = lr_at(cfg, step)
        batch = window_batch(train_tokens, cfg.seed, step, cfg.batch_size, cfg.seq_len)
        batch = batch[run.rank * per_rank:(run.rank + 1) * per_rank]
        loss_sum = 0.0
        micro = list(batch.split(cfg.micro_batch))
        for j, mb in enumerate(micro):
            # each process contributes its share of the global mean; DDP averages over processes
            scale = mb.shape[0] * run.world / cfg.batch_size
            sync = ddp.no_sync() if distributed and j < len(micro) - 1 else nullcontext()
            with sync:
                loss = next_token_loss(ddp, mb)
                (loss * scale).backward()
            loss_sum += loss.item() * mb.shape[0]
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        train_loss = _mean_over_ranks(loss_sum / per_rank, distributed)
        history["train"].append([step, train_loss])
        tok_s = cfg.batch_size * cfg.seq_len / (time.time() - t0)
        if run.rank == 0 and (step % cfg.eval_every == 0 or step == cfg.steps):
            history["valid"].append([step, evaluate(model, valid_tokens, cfg.seq_len, cfg.eval_windows)])
        bar.set_postfix(loss=f"{train_loss:.3f}", val=f"{history['valid'][-1][1]:.3f}" if history["valid"] else "-",
                        tok_s=f"{tok_s:.0f}", gnorm=f"{float(gnorm):.2f}")
        bar.update(1)
        if run.rank == 0 and (step % cfg.save_every == 0 or step == last):
            run.save_state(model, opt, step, history, time.time() - t_start)
        if distributed:
            dist.barrier()
    bar.close()
    if run.rank == 0 and step == cfg.steps:
        export(run, model, history, time.time() - t_start)
    if distributed:
        dist.destroy_process_group()
    return run.out / "model" if step == cfg.steps else None


def export(run: Run, model: LlamaForCausalLM, history: dict, seconds: float) -> None:
    cfg = run.cfg
    prov = json.loads((run.work / "prepared.json").read_text())
    test = run.tokens("test")
    test_loss = evaluate(model, test, cfg.seq_len, cfg.test_windows) if len(test) > cfg.seq_len else None
    meta = {
        "kind": "target-or-draft-model",
        "recipe": asdict(cfg),
        "parameters": model.num_parameters(),
        "tokens_seen": cfg.steps * cfg.batch_size * cfg.seq_len,
        "training_seconds": round(seconds, 1),
        "final_valid_loss": history["valid"][-1][1] if history["valid"] else None,
        "test_loss": test_loss,
        "test_tokens_evaluated": min(cfg.test_windows, len(test) // cfg.seq_len) * cfg.seq_len if test_loss else 0,
        "test_perplexity": math.exp(test_loss) if test_loss is not None else None,
        "corpus": {"sources": prov["sources"], "sha256": prov["sha256"], "tokens": prov["tokens"],
                   "files": prov["files"]},
        "history": history,
    }
    save_model(model, run.out / "model", tokenizer_file=run.work / "tokenizer.json", meta=meta)
    plot_history(history, run.out / "loss.png", title=f"{run.out.name}: {meta['parameters'] / 1e6:.1f}M parameters")


def plot_history(history: dict, path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    if history["train"]:
        s, l = zip(*history["train"])
        ax.plot(s, l, alpha=0.5, label="train")
    if history["valid"]:
        s, l = zip(*history["valid"])
        ax.plot(s, l, marker="o", label="validation")
    ax.set(xlabel="step", ylabel="next-token loss (nats)", title=title)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def init_weights(model: torch.nn.Module, std: float = 0.02) -> None:
    for name, p in model.named_parameters():
        if p.dim() == 2:
            torch.nn.init.normal_(p, std=std)
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                p.data /= math.sqrt(2 * model.config.num_hidden_layers)


def _mean_over_ranks(x: float, distributed: bool) -> float:
    if not distributed:
        return x
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t) / dist.get_world_size()

