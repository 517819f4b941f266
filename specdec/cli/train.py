"""`specdec train`: a training run from a preset and the flags that override it; `specdec longrun`:
a head that keeps learning over many sittings."""
from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import sys
import time
from pathlib import Path

from .common import device_name


def cmd_train(args) -> None:
    from ..train.loop import stopped_at, train
    from ..train.presets import OBJECTIVE_OPTIONS, chosen_objective, defaults, described, run_config
    from ..train.presets import preset as recipe

    if args.preset is None:
        name, preset = defaults(args.objective)
        print(f"specdec train: no --preset: the values of --preset {name}, without the models it names: "
              f"{described(preset)} (a flag overrides each)", file=sys.stderr)
    else:
        preset = recipe(args.preset)
    for name in ("steps", "batch_size", "micro_batch", "seq_len", "lr", "seed", "tokenizer", "eval_every",
                 "save_every", "stop_after", "init_from", "device"):
        value = getattr(args, name)
        if value is not None:
            preset[name] = value
    if args.corpus:
        preset["corpus"] = args.corpus
    if args.vocab_size:
        preset["model"] = dataclasses.replace(preset["model"], vocab_size=args.vocab_size)
    objective = chosen_objective(args.objective, {o: getattr(args, o) for o in OBJECTIVE_OPTIONS},
                                 preset.get("objective"))
    cfg = run_config(args.out, preset, objective)
    command = ["specdec", *sys.argv[1:]]
    path = train(cfg, command=command)
    if path is None:
        step = stopped_at(args.out)
        latest = Path(args.out) / "latest"
        print(f"stopped at step {step} of {cfg.steps}, its state saved in {args.out}"
              + (f"; its weights: specdec generate --model {latest}" if latest.exists() else "")
              + f"; resume with: {' '.join(shlex.quote(a) for a in command)}")
    elif int(os.environ.get("RANK", 0)) == 0:
        print(f"{'draft heads' if path.name == 'heads' else 'model'} written to {path}")


def add_train_parser(sub) -> None:
    t = sub.add_parser("train", help="train a model (single process, or under torchrun)")
    from ..train.presets import PRESETS
    t.add_argument("--preset", choices=list(PRESETS),
                   help="the recipe of a shipped model, its values the defaults of the other flags (default: "
                        "target-eagle's values for --objective eagle, target-block's for block, else target's, "
                        "without the shipped models they name; said on stderr). target: the shipped target; "
                        "target-mtp: MTP heads for the shipped target, trained on its frozen weights; "
                        "target-eagle: the shipped EAGLE head of the shipped target; target-eagle3: the same "
                        "in EAGLE-3's reference layout (models/eagle3, exportable to vLLM); target-block: the "
                        "shipped block head (models/block-head); "
                        "draft-distill: the shipped draft distilled from the shipped target; parallel-draft: the "
                        "shipped parallel draft (models/parallel-draft), adapted from the shipped draft")
    t.add_argument("--out", required=True, help="run folder (resumed if it already holds a run)")
    t.add_argument("--corpus", nargs="+", help="text/.jsonl files or folders (default: the standard library)")
    t.add_argument("--tokenizer", help="use this tokenizer.json instead of training one")
    t.add_argument("--vocab-size", type=int, help="tokens in the vocabulary (default: the preset's)")
    t.add_argument("--steps", type=int, help="optimizer steps in all (default: the preset's)")
    t.add_argument("--batch-size", type=int, help="sequences per optimizer step, over all processes "
                                                   "(default: the preset's)")
    t.add_argument("--device", type=device_name, default="cpu",
                   help="cpu or cuda (under torchrun on CUDA each process takes its LOCAL_RANK's GPU, NCCL)")
    t.add_argument("--micro-batch", type=int, help="sequences per forward/backward (gradient accumulation; "
                                                    "default: the preset's)")
    t.add_argument("--seq-len", type=int, help="tokens per training window (default: the preset's)")
    t.add_argument("--lr", type=float, help="peak learning rate (default: the preset's)")
    t.add_argument("--seed", type=int, help="seed of the initial weights and of the batches (default 0)")
    t.add_argument("--eval-every", type=int, help="validate every N steps (default: the preset's)")
    t.add_argument("--save-every", type=int, help="save the resume state every N steps (default: the preset's)")
    t.add_argument("--stop-after", type=int,
                   help="leave after N more steps of this invocation, counted from where it starts (0 on a new "
                        "run, the saved step on a resumed one), checkpointed; rerun to resume. Ctrl-C or SIGTERM "
                        "also stops after the step under way, saving it")
    add_objective_arguments(t)
    t.set_defaults(func=cmd_train)


def add_objective_arguments(t: argparse.ArgumentParser) -> None:
    """`specdec train`'s objective and each objective's settings (train/presets.OBJECTIVE_OPTIONS)."""
    from ..train.objectives import OBJECTIVES
    from ..train.presets import OBJECTIVE_OPTIONS

    t.add_argument("--objective", choices=list(OBJECTIVES),
                   help="next-token only, or with MTP heads: parallel (Gloeckle et al.) or sequential "
                        "modules (DeepSeek-V3), or distill: KL(teacher || model) to a frozen --teacher, "
                        "or eagle: an EAGLE-3 draft head for the frozen --target, or block: a block head "
                        "drafting k tokens per forward for the frozen --target, or parallel: a draft model "
                        "with a mask token that drafts a block of k tokens in one forward (PARD), distilled "
                        "from --teacher at every block slot")
    t.add_argument("--init-from", metavar="MODEL", help="start from this checkpoint's weights and config "
                                                        "(default: fresh weights)")
    for option, o in OBJECTIVE_OPTIONS.items():
        shape = {"action": "store_true"} if o.flag else {
            key: value for key, value in (("type", o.type), ("metavar", o.metavar), ("choices", o.choices),
                                          ("nargs", o.nargs)) if value is not None}
        t.add_argument("--" + option.replace("_", "-"), help=o.help, **shape)


def cmd_longrun(args) -> None:
    import torch

    from ..train import longrun
    from ..train.presets import long_run

    cfg, default_out = long_run(args.preset)
    out = Path(args.out or default_out)
    torch.set_num_threads(int(os.environ.get("SPECDEC_THREADS", 2)))
    if args.action == "run":
        longrun.run(out, cfg, log=lambda line: print(time.strftime("%H:%M:%S"), line, flush=True), minutes=args.minutes)
    elif args.action == "snapshot":
        dest = longrun.snapshot(out, args.to or cfg.init, cfg, f"specdec longrun run --preset {args.preset}")
        print(f"the head of {out} written to {dest}")
    else:
        points = longrun.learning_curve(out, cfg)
        lines = longrun.break_even()
        print(longrun.table(points) + "\n\nbreak-even α (cost model): " + ", ".join(
            f"{k} {a:.2f}" for k, a in lines.items()))
        if args.plot:
            from ..train.plots import plot_learning_curve
            plot_learning_curve(points, Path(args.plot), f"{args.preset}: held-out α against tokens seen", lines)


def add_longrun_parser(sub) -> None:
    from ..train.presets import LONG_RUNS

    r = sub.add_parser("longrun", help="keep an EAGLE head learning from its target's own answers, in the "
                                       "background over many sittings (train/longrun.py)",
                       description="run: generate and train until SIGINT or SIGTERM (or --minutes), the state saved "
                                   "to resume; snapshot: the head so far into a head folder; curve: the held-out "
                                   "learning curve.")
    r.add_argument("action", choices=("run", "snapshot", "curve"),
                   help="run: start, or resume where it stopped; snapshot: write the head so far; curve: print it")
    r.add_argument("--preset", default="smollm2-eagle3", choices=list(LONG_RUNS),
                   help="the long run: its head, target, data and rates (train/presets.py)")
    r.add_argument("--out", help="the run folder (default: runs/longrun-PRESET under the repository)")
    r.add_argument("--to", help="snapshot: the head folder written (default: the preset's init folder)")
    r.add_argument("--plot", help="curve: draw the learning curve into this .png as well")
    r.add_argument("--minutes", type=float, help="run: stop after this many minutes (at the first step or "
                                                 "shard that ends past them), with a held-out point")
    r.set_defaults(func=cmd_longrun)
