"""`specdec train`: AdamW with warmup + cosine decay, gradient clipping, periodic validation,
atomic checkpoints with exact resume, single process or torchrun (gloo on CPU, NCCL on CUDA: --device cuda).

The loop knows no objective by name: what is trained (a model, MTP heads, a distilled draft, an
EAGLE or block head, a parallel draft), its loss, its validation figures and its export are the
objective's (objectives.py); the settings are a TrainConfig (config.py).

A run lives in one output folder:
  work/tokenizer.json, work/tokens-*.npy   prepared once (tokenizer trained on the train split,
                                           or the frozen trunk's)
  work/state/                              resume state: fp32 trainable weights, optimizer moments, history
  model/                                   the exported checkpoint (bf16, transformers layout), unless
                                           the trunk is frozen
  heads/                                   the exported MTP heads (heads/mtp.py), for the model in model/
                                           or for the frozen trunk; or the EAGLE head (heads/eagle.py),
                                           or the block head (heads/block.py)
  loss.png                                 training and validation loss curves (plots.py)
Batches are a pure function of (seed, step), so an interrupted run resumes to the same result.
Under torchrun each process takes its share of the global batch and the gradients are averaged
over processes before each optimizer step; every process builds the same initial weights from
the seed.
"""
from __future__ import annotations

import json
import math
import os
import signal
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from ..errors import SpecdecError
from ..lm.atomic import atomic_dir, recover
from ..lm.checkpoint import WEIGHTS, load_model, save_model, sha256, shown_path
from ..lm.device import placement
from ..lm.device import resolve as resolve_device
from ..lm.model import LlamaForCausalLM, place
from ..lm.tokenizer import Tokenizer
from .config import TrainConfig, prepared
from .corpus import Corpus
from .data import eval_batches, preparation_key, tokenize, window_batch
from .objectives import Nets, Objective, Where, trunk


def lr_at(cfg: TrainConfig, step: int) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


@torch.no_grad()
def evaluate(objective: Objective, nets: Nets, tokens: np.ndarray, seq_len: int, max_windows: int) -> list[float]:
    """The objective's validation figures over evenly spread windows of `tokens` (objectives.py:
    `metrics` per window batch, `pooled` over them), the model in eval mode meanwhile. A progress
    bar on stderr: the final evaluation takes a while."""
    was_training = nets.model.training
    nets.model.eval()
    anchors = torch.Generator().manual_seed(0)  # a block head's validation blocks: the same at every validation
    device = placement(nets.model).device
    batches = tqdm(list(eval_batches(tokens, seq_len, max_windows)), desc="evaluate", unit="batch", leave=False,
                   file=sys.stderr)
    rows = [objective.metrics(nets, b.to(device), seq_len, anchors) for b in batches]
    nets.model.train(was_training)
    return objective.pooled(rows)


class Run:
    """Everything about one training run that is saved to and restored from work/state."""

    def __init__(self, cfg, trunk_sha256: str | None = None, teacher_sha256: str | None = None,
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
        """What a resumed run must share with the saved one, by name (as JSON keeps it)."""
        cfg = self.cfg
        return json.loads(json.dumps({
            "model": asdict(cfg.model), "objective": cfg.objective.name, **cfg.objective.identity(),
            "frozen trunk": self.trunk_sha256, "teacher": self.teacher_sha256, "initial weights": self.init_sha256}))

    def save_state(self, model, heads, opt, step: int, history: dict, elapsed: float) -> None:
        tensors = {}
        if self.trunk_sha256 is None:
            tensors.update({f"model.{k}": v.detach().contiguous() for k, v in model.hf_state_dict().items()})
        if heads is not None:
            tensors.update({f"heads.{k}": v.detach().contiguous() for k, v in heads.state_dict().items()})
        tensors.update(optimizer_tensors(opt))
        with atomic_dir(self.work / "state") as tmp:
            save_file(tensors, tmp / "state.safetensors")
            (tmp / "state.json").write_text(json.dumps(
                {"step": step, "elapsed": elapsed, "history": history, "config": self.cfg.recipe(),
                 "identity": self.identity()}))

    def load_state(self, model, heads, opt):
        state_dir = self.work / "state"
        recover(state_dir)  # a save killed between its renames left the newest state beside the folder
        if not (state_dir / "state.json").exists():
            return 0, {"train": [], "valid": []}, 0.0
        meta = json.loads((state_dir / "state.json").read_text())
        saved, identity = meta.get("identity"), self.identity()
        if saved is None:
            raise SpecdecError(f"{state_dir} was saved by a specdec from before objectives had settings of their own; "
                               "finish it with that version, or use a new --out (or delete that folder) to start over")
        if saved != identity:
            changed = [k for k, v in identity.items() if saved.get(k) != v]
            raise SpecdecError(f"{state_dir} was saved with another {', '.join(changed)}; use a new --out "
                               "or delete that folder to start over")
        tensors = load_file(state_dir / "state.safetensors")
        if self.trunk_sha256 is None:
            model.load_hf_state_dict({k[6:]: v for k, v in tensors.items() if k.startswith("model.")})
        if heads is not None:
            heads.load_state_dict({k[6:]: v for k, v in tensors.items() if k.startswith("heads.")})
        load_optimizer_tensors(opt, tensors)
        return meta["step"], meta["history"], meta["elapsed"]


def build(cfg: TrainConfig, train_tokens: np.ndarray | None = None) -> tuple[LlamaForCausalLM, torch.nn.Module | None]:
    """The model (fresh from the seed, or the frozen checkpoint in fp32) and the objective's heads
    (an EAGLE or block head counts its draft vocabulary in `train_tokens`). The initial weights
    come from torch's global generator seeded with cfg.seed; the caller's generator state is given
    back afterwards."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        model = trunk(cfg)
        return model, cfg.objective.new_heads(cfg, model, train_tokens)


def load_teacher(path: str) -> LlamaForCausalLM:
    """The frozen teacher in fp32, computing exactly as the target does at inference."""
    return load_model(path, dtype=torch.float32).requires_grad_(False)


def train(cfg: TrainConfig, command: list[str] | None = None) -> Path | None:
    """Run (or resume) training; return the exported model folder (the heads folder when the
    trunk is frozen), or None if stopped early. `command`: the command line that reproduces the
    run, recorded in the exported metadata."""
    cfg = prepared(cfg)
    run = Run(cfg, *(sha256(Path(path) / WEIGHTS) if path else None
                     for path in (cfg.frozen, cfg.objective.teacher, cfg.init_from)))
    device = start(run)
    model, heads = build(cfg, run.tokens("train"))
    nets = Nets(place(model, device), None if heads is None else place(heads, device),
                place(load_teacher(cfg.objective.teacher), device) if cfg.objective.teacher else None)
    params = [*(() if cfg.frozen else model.parameters()), *(() if heads is None else heads.parameters())]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay, fused=False)
    step, history, elapsed = run.load_state(model, heads, opt)
    t_start = time.time() - elapsed
    if cfg.objective.evaluates_start and step == 0 and run.rank == 0:  # the "before" of its curves
        cfg.objective.record(history, "valid", 0, evaluate(cfg.objective, nets, run.tokens("valid"), cfg.seq_len,
                                                           cfg.eval_windows))
    step = steps(run, nets, params, opt, step, history, t_start)
    if run.rank == 0 and step < cfg.steps and not cfg.frozen:
        # a run folder always holds a checkpoint `generate --model` loads: the weights of this step
        save_model(model, run.out / "latest", tokenizer_file=run.work / "tokenizer.json",
                   meta={"kind": "target-or-draft-model", "partial": {"step": step, "steps": cfg.steps},
                         "recipe": cfg.recipe()})
    if run.rank == 0 and step == cfg.steps:
        export(run, nets, history, time.time() - t_start, command)
    if run.world > 1:
        dist.destroy_process_group()
    if step < cfg.steps:
        return None
    return run.out / ("heads" if cfg.frozen else "model")


def start(run: Run) -> torch.device:
    """The device of this process; under torchrun the process group joined; the data prepared
    (by rank 0, the others waiting)."""
    device = resolve_device(run.cfg.device)
    distributed = run.world > 1
    if device.type == "cuda" and distributed:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    if distributed:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    if run.rank == 0:
        run.prepare()
    if distributed:
        dist.barrier()
    if run.cfg.batch_size % run.world:
        raise SpecdecError(f"batch_size {run.cfg.batch_size} must divide evenly over {run.world} processes")
    return device


def steps(run: Run, nets: Nets, params: list, opt, step: int, history: dict, t_start: float) -> int:
    """Optimizer steps from `step` until the run's end, its stop_after or a signal; the state saved
    every save_every steps and at the last; returns the step reached."""
    cfg = run.cfg
    valid_tokens = run.tokens("valid")
    bar = tqdm(total=cfg.steps, initial=step, disable=run.rank != 0, desc="train", unit="step", dynamic_ncols=True)
    last = cfg.steps if cfg.stop_after is None else min(cfg.steps, step + cfg.stop_after)
    interrupt = Interrupt()  # a signal ends the loop after the step under way, its state saved
    try:
        while step < last:
            t0 = time.time()
            for group in opt.param_groups:
                group["lr"] = lr_at(cfg, step)
            train_losses = accumulate(run, nets, step)
            if run.world > 1:
                _average_gradients(params, run.world)
            gnorm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            cfg.objective.record(history, "train", step, train_losses)
            if run.rank == 0 and (step % cfg.eval_every == 0 or step == cfg.steps):
                cfg.objective.record(history, "valid", step, evaluate(cfg.objective, nets, valid_tokens,
                                                                      cfg.seq_len, cfg.eval_windows))
            tok_s = cfg.batch_size * cfg.seq_len / (time.time() - t0)
            bar.set_postfix(**progress(history, nets.heads is not None), tok_s=f"{tok_s:.0f}",
                            gnorm=f"{float(gnorm):.2f}")
            bar.update(1)
            if run.rank == 0 and (step % cfg.save_every == 0 or step == last or interrupt.received):
                run.save_state(nets.model, nets.heads, opt, step, history, time.time() - t_start)
            if run.world > 1:
                dist.barrier()
            if interrupt.received:
                break
    finally:  # also when a second signal leaves at once: the bar's last state before the command's line
        interrupt.restore()
        bar.close()
    return step


def accumulate(run: Run, nets: Nets, step: int) -> list[float]:
    """This process's share of step `step`'s global batch, micro-batch by micro-batch: the gradient
    accumulated, the loss parts returned as the mean over every process's rows."""
    cfg = run.cfg
    per_rank = cfg.batch_size // run.world
    batch = window_batch(run.tokens("train"), cfg.seed, step, cfg.batch_size, cfg.seq_len)
    batch = batch[run.rank * per_rank:(run.rank + 1) * per_rank]
    device = placement(nets.model).device
    loss_sums = None
    for i, mb in enumerate(batch.to(device).split(cfg.micro_batch)):
        # each process contributes its share of the global mean; gradients are averaged over processes
        scale = mb.shape[0] * run.world / cfg.batch_size
        losses = cfg.objective.backward(nets, mb, scale, cfg, Where(cfg.seed, step, cfg.steps, run.rank, i))
        parts = np.array([np.nan if x is None else x * mb.shape[0] for x in losses])
        loss_sums = parts if loss_sums is None else loss_sums + parts
    return [_mean_over_ranks(x / per_rank, run.world > 1, device) for x in loss_sums]


def progress(history: dict, heads: bool) -> dict:
    """The progress bar's latest figures: training loss, validation loss, greedy agreement, acceptance
    per position, the heads' losses, where recorded."""
    shown = {"loss": f"{history['train'][-1][1]:.3f}",
             "val": f"{history['valid'][-1][1]:.3f}" if history["valid"] else "-"}
    if history.get("valid_agreement"):
        shown["agree"] = f"{history['valid_agreement'][-1][1]:.3f}"
    if history.get("valid_alpha"):
        shown["alpha"] = "/".join(f"{x:.2f}" for x in history["valid_alpha"][-1][1])
    if heads:
        shown["heads"] = "/".join(f"{x:.2f}" for x in history["train_heads"][-1][1])
    return shown


def export(run: Run, nets: Nets, history: dict, seconds: float, command: list[str] | None) -> None:
    """What the run trained, written by its objective with the run's recipe, budget, held-out test
    figures (where the corpus has a test split), corpus and history."""
    cfg = run.cfg
    prov = json.loads((run.work / "prepared.json").read_text())
    test = run.tokens("test")
    figures = evaluate(cfg.objective, nets, test, cfg.seq_len, cfg.test_windows) if len(test) > cfg.seq_len else None
    meta = {"recipe": shown_recipe(cfg), "recipe_command": " ".join(command) if command else None,
            "tokens_seen": cfg.steps * cfg.batch_size * cfg.seq_len, "training_seconds": round(seconds, 1),
            "test_tokens_evaluated": min(cfg.test_windows, len(test) // cfg.seq_len) * cfg.seq_len if figures else 0,
            "corpus": {key: prov[key] for key in ("sources", "sha256", "tokens", "files")}, "history": history}
    cfg.objective.export(run, nets, history, figures, meta)


def shown_recipe(cfg: TrainConfig) -> dict:
    """The recipe with the files it names shown from the repository's root (models/target), never as
    this machine's paths."""
    recipe = cfg.recipe()
    for settings in (recipe, recipe["objective"]):
        for key in ("tokenizer", "out", "init_from", "teacher", "target", "frozen_trunk"):
            if settings.get(key):
                settings[key] = shown_path(Path(settings[key]))
    return recipe


class Interrupt:
    """SIGINT or SIGTERM while training: one line at once, then the step under way finishes, the
    state is saved and the loop leaves (`received`); a second signal leaves at once (through the
    handler it replaced, else KeyboardInterrupt). Installed on creation (only the main thread takes
    signals; elsewhere this does nothing), `restore` puts the previous handlers back."""

    def __init__(self):
        self.received: int | None = None
        self.previous = {}
        if threading.current_thread() is threading.main_thread():
            self.previous = {s: signal.signal(s, self.handle) for s in (signal.SIGINT, signal.SIGTERM)}

    def handle(self, signum, frame) -> None:
        if self.received is None:
            self.received = signum
            print(f"specdec: {'SIGTERM' if signum == signal.SIGTERM else 'Ctrl-C'}: stopping after the step under way, "
                  "its state saved (again to leave at once)", file=sys.stderr, flush=True)
            return
        before = self.previous.get(signum)
        if callable(before):  # the command's handler (cli.Stop): it names the signal in its line
            return before(signum, frame)
        raise KeyboardInterrupt

    def restore(self) -> None:
        for s, handler in self.previous.items():
            signal.signal(s, handler)


def stopped_at(out: str | Path) -> int | None:
    """The step a stopped run saved (None: no state yet)."""
    state = Path(out) / "work" / "state" / "state.json"
    return json.loads(state.read_text())["step"] if state.exists() else None


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


def optimizer_tensors(opt) -> dict[str, torch.Tensor]:
    """The optimizer's per-parameter state as flat tensors "opt.{i}.{name}" (safetensors keeps no 0-d
    tensors: those as 1-element), for a checkpoint; `load_optimizer_tensors` reads them back."""
    return {f"opt.{i}.{name}": value.detach().reshape(-1).contiguous() if value.dim() == 0
            else value.detach().contiguous()
            for i, st in opt.state_dict()["state"].items() for name, value in st.items()}


def load_optimizer_tensors(opt, tensors: dict[str, torch.Tensor]) -> None:
    """Restore the state `optimizer_tensors` wrote (the other keys of `tensors` are ignored)."""
    state: dict = {}
    for k, v in tensors.items():
        if k.startswith("opt."):
            _, i, name = k.split(".", 2)
            state.setdefault(int(i), {})[name] = v.reshape(()) if name == "step" else v
    sd = opt.state_dict()
    sd["state"] = state
    opt.load_state_dict(sd)
