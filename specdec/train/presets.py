"""The recipes of the shipped default models: `specdec train --preset NAME --out DIR` reproduces each.

Paths in a recipe ("models/target") are relative to the repository root; `preset` resolves them,
so a recipe works from any working directory.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import NamedTuple

from ..errors import SpecdecError
from ..lm.arch import Arch
from .config import LongRun, TrainConfig, gguf_converted
from .objectives import MTP, Block, Distill, Eagle, Objective, Parallel, objective
from .selfdistill import Recipe, corpus_for

ROOT = Path(__file__).resolve().parents[2]
PATHS = ("tokenizer", "init_from")  # recipe entries naming files or folders
OBJECTIVE_PATHS = ("frozen_trunk", "teacher", "target")  # objective settings naming folders
DEFAULT_TARGET = "default target"  # a recipe's target: specdec's default target (api.default_target)

TARGET_MODEL = Arch(vocab_size=16384, hidden_size=384, intermediate_size=1024, num_hidden_layers=6,
                           num_attention_heads=6, num_key_value_heads=2, head_dim=64,
                           max_position_embeddings=1024)
DRAFT_MODEL = Arch(vocab_size=16384, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                          max_position_embeddings=1024, tie_word_embeddings=True)

PRESETS = {
    # the target trains its own tokenizer on the standard library's training split
    "target": dict(model=TARGET_MODEL, seq_len=512, batch_size=8, micro_batch=8, steps=450, lr=1e-3, warmup=40),
    # the draft shares the target's tokenizer, so their token ids agree
    "draft": dict(model=DRAFT_MODEL, seq_len=512, batch_size=8, micro_batch=8, steps=300, lr=3e-3, warmup=30,
                  tokenizer="models/target/tokenizer.json"),
    # the shipped draft: the "draft" recipe's model, distilled from the shipped target (KL(target || draft) over
    # the whole vocabulary); give it --init-from runs/draft/model after `--preset draft --out runs/draft`
    # (without --init-from the draft is distilled from fresh weights); training times: docs/models.md
    "draft-distill": dict(model=DRAFT_MODEL, objective=Distill(teacher="models/target"),
                          seq_len=512, batch_size=8, micro_batch=4, steps=250, lr=1e-3,
                          warmup=20, eval_every=50, eval_windows=32, test_windows=64, save_every=10),
    # the shipped parallel draft (proposers/parallel.py): the shipped draft with a mask token of its own, adapted to
    # draft a block of 8 tokens in one forward, distilled from the shipped target at every block slot (PARD)
    "parallel-draft": dict(init_from="models/draft", objective=Parallel(teacher="models/target", block=8, anchors=32),
                           seq_len=256, batch_size=8, micro_batch=8,
                           steps=300, lr=1e-3, warmup=20, eval_every=50, eval_windows=24, test_windows=48,
                           save_every=10),
    # MTP heads for the shipped target: 3 sequential modules (DeepSeek-V3) trained on its frozen weights
    # (embedding and lm_head included) and its tokenizer
    "target-mtp": dict(objective=MTP(kind="sequential", depth=3, frozen_trunk="models/target"), seq_len=512,
                       batch_size=8, micro_batch=8, steps=130, lr=2e-3, warmup=10, eval_every=26, eval_windows=32,
                       test_windows=48, save_every=10),
    # the shipped EAGLE head (eagle.py) of the shipped target: layers 1, 3, 5, a 4096-token draft vocabulary,
    # 5 draft steps unrolled in training
    "target-eagle": dict(objective=Eagle(target="models/target", draft_vocab=4096, steps=5),
                         seq_len=256, batch_size=8, micro_batch=8, steps=500, lr=2e-3, warmup=20, eval_every=50,
                         eval_windows=24, test_windows=48, save_every=10),
    # the same head in EAGLE-3's reference layout (eagle.py), which vLLM serves after `specdec export`
    "target-eagle3": dict(objective=Eagle(target="models/target", draft_vocab=4096, steps=5, layout="eagle3"),
                          seq_len=256, batch_size=8, micro_batch=8, steps=500, lr=2e-3,
                          warmup=20, eval_every=50, eval_windows=24, test_windows=48, save_every=10),
    # the shipped block head (block.py) of the shipped target: layers 1, 3, 5, a 4096-token draft vocabulary,
    # one decoder layer, blocks of 8 drafts (7 mask queries, causal among themselves: as accepted as bidirectional
    # ones at equal budget and cheaper, docs/block-head.md) at 32 random anchors per window
    "target-block": dict(objective=Block(target="models/target", draft_vocab=4096, size=8, anchors=32,
                                             attention="causal", num_layers=1), seq_len=256,
                         batch_size=8, micro_batch=8, steps=260, lr=2e-3, warmup=20, eval_every=65,
                         eval_windows=24, test_windows=48, save_every=10),
    # the shipped EAGLE-3 head of SmolLM2-135M-Instruct (models/smollm2-eagle3), in EAGLE-3's reference layout:
    # layers 1, 15, 29, a 4096-token draft vocabulary, 4 draft steps unrolled, trained on SmolLM2's own answers
    # (selfdistill.py: documented standard-library functions and chat requests, each answered greedily and at
    # T=0.8), generated into the run folder first
    "smollm2-eagle3": dict(objective=Eagle(target=DEFAULT_TARGET, draft_vocab=4096, steps=4, layout="eagle3"),
                           seq_len=256, batch_size=8, micro_batch=8, steps=140, lr=3e-3, warmup=6, eval_every=32,
                           eval_windows=8, test_windows=0, save_every=4,
                           selfdistill=Recipe(code_prompts=256, chat_prompts=256, max_new_tokens=160,
                                              temperature=0.8, batch=32, seed=0)),
    # a few seconds: for tests and for trying the machinery
    "tiny": dict(model=Arch(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   max_position_embeddings=256),
                 seq_len=64, batch_size=4, micro_batch=4, steps=20, lr=3e-3, warmup=5, eval_every=10,
                 eval_windows=8, save_every=5),
}


# without --preset, a head of an objective here takes the hyperparameters of the shipped head's recipe
OBJECTIVE_PRESETS = {"eagle": "target-eagle", "block": "target-block"}


def defaults(objective: str | None) -> tuple[str, dict]:
    """The preset whose values `specdec train` takes when none is named, and those values: the
    shipped head's recipe for an eagle or block head, else the shipped target's; without the
    shipped models a recipe names (a run without --preset is for models given by flags)."""
    name = OBJECTIVE_PRESETS.get(objective, "target")
    recipe = {key: value for key, value in preset(name).items() if key not in PATHS}
    if "objective" in recipe:  # its settings, without the models they name
        settings = {f.name for f in dataclasses.fields(recipe["objective"])}
        recipe["objective"] = dataclasses.replace(recipe["objective"], **{
            key: None for key in OBJECTIVE_PATHS if key in settings})
    return name, recipe


def described(recipe: dict) -> str:
    """A recipe's values in one line: "steps=500, batch_size=8, ..., model: 6 layers x 384, vocabulary 16384"."""
    values = ", ".join(f"{key}={value}" for key, value in recipe.items() if key not in ("model", "objective"))
    m, objective = recipe.get("model"), recipe.get("objective")
    if objective is not None:  # its settings, those naming no model
        values += f", {objective.name}: " + ", ".join(f"{key}={value}" for key, value in
                                                       dataclasses.asdict(objective).items() if value is not None)
    return values + (f", model: {m.num_hidden_layers} layers x {m.hidden_size}, vocabulary {m.vocab_size}" if m else "")


MTP_OBJECTIVES = ("mtp-parallel", "mtp-sequential")
class Setting(NamedTuple):
    """An option of `specdec train` that sets `setting` of the objectives `objectives`, and how the
    command line takes it (argparse's type, metavar, choices, nargs; flag: present or not)."""
    objectives: tuple[str, ...]
    setting: str
    help: str
    type: type | None = None
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    nargs: str | None = None
    flag: bool = False


EAGLE_BLOCK = ("eagle", "block")
OBJECTIVE_OPTIONS = {  # option of `specdec train` (--mtp-depth: mtp_depth) -> what it sets
    "target": Setting(EAGLE_BLOCK, "target", "eagle, block: the frozen target (checkpoint folder or .gguf file) the "
                      "head drafts for (its tokenizer is used)", metavar="MODEL"),
    "block_size": Setting(("block",), "size", "block: the most drafts per forward the head is trained for "
                          "(default 8)", int, "K"),
    "block_anchors": Setting(("block",), "anchors", "block: random anchors (blocks of mask slots) per training "
                             "window (default 32)", int, "N"),
    "block_attention": Setting(("block",), "attention", "block: attention among a block's mask queries (default "
                               "causal)", choices=("bidirectional", "causal")),
    "block_layers": Setting(("block",), "num_layers", "block: decoder layers of the head (default 1)", int, "N"),
    "eagle_layout": Setting(("eagle",), "layout", "eagle: the head's layout: specdec (its layer is one CPU-kernel "
                            "call; default) or eagle3 (EAGLE-3's reference layout, exportable to vLLM with `specdec "
                            "export --format speculators`)", choices=("specdec", "eagle3")),
    "eagle_layers": Setting(EAGLE_BLOCK, "layers", "eagle, block: the target decoder layers (0-based) whose outputs "
                            "the head reads (default: low, middle, high)", int, "ID", nargs="+"),
    "eagle_steps": Setting(("eagle",), "steps", "eagle: draft steps unrolled in training (default 4)", int),
    "eagle_decay": Setting(("eagle",), "decay", "eagle: step j's loss weight is decay^j (default 0.8)", float),
    "draft_vocab": Setting(EAGLE_BLOCK, "draft_vocab", "eagle, block: the head drafts over the N most frequent "
                           "training token ids (default 4096)", int, "N"),
    "teacher": Setting(("distill", "parallel"), "teacher", "distill: the frozen target (folder or .gguf file) to "
                       "learn from (its tokenizer is used)", metavar="MODEL"),
    "parallel_block": Setting(("parallel",), "block", "parallel: drafts per draft forward, the block slots trained "
                              "(default 8)", int, "K"),
    "parallel_anchors": Setting(("parallel",), "anchors", "parallel: random anchors (blocks of K-1 mask slots) per "
                                "training window (default 32)", int, "N"),
    "distill_temperature": Setting(("distill",), "temperature", "distill: KL at this temperature (default 1)", float),
    "distill_top_k": Setting(("distill",), "top_k", "distill: the teacher's top-k tokens only, renormalised "
                             "(default: the whole vocabulary)", int),
    "mtp_depth": Setting(MTP_OBJECTIVES, "depth", "MTP heads: tokens predicted beyond the next one", int),
    "mtp_lambda": Setting(MTP_OBJECTIVES, "lam", "MTP head j's loss weight is lambda * beta^(j-1)", float),
    "mtp_lambda_late": Setting(MTP_OBJECTIVES, "lam_late", "lambda from 70%% of the steps on (schedule)", float),
    "mtp_beta": Setting(MTP_OBJECTIVES, "beta", "per-position decay of the MTP loss weights", float),
    "frozen_trunk": Setting(MTP_OBJECTIVES, "frozen_trunk", "train only MTP heads on this checkpoint, its weights "
                            "frozen (its tokenizer is used)", metavar="MODEL"),
    "naive_mtp_order": Setting(MTP_OBJECTIVES, "memory_saving", "one backward over all heads (more memory) instead "
                               "of head by head", flag=True),
}


def chosen_objective(name: str | None, options: dict, preset: Objective | None) -> Objective:
    """Objective `name` (None: the preset's, else next-token) with the settings `options` give (by
    OBJECTIVE_OPTIONS' names; None: not given; naive_mtp_order True: memory_saving off), the others the
    preset's (for the preset's own objective) or the defaults; an option of another objective is refused."""
    name = name or (preset.name if preset is not None else "next-token")
    given = {**options, "eagle_layers": options["eagle_layers"] and tuple(options["eagle_layers"]),
             "naive_mtp_order": False if options["naive_mtp_order"] else None}
    settings = {}
    for option, (names, setting, *_) in OBJECTIVE_OPTIONS.items():
        if given[option] is None:
            continue
        settings[setting] = given[option]
        if name not in names:
            raise SpecdecError(f"--{option.replace('_', '-')} is a setting of --objective {' or '.join(names)}, "
                               f"but this run trains {name}: give that objective, or leave the option out")
    if preset is not None and preset.name == name:
        return dataclasses.replace(preset, **settings)
    return objective(name, **settings)


def run_config(out: str, recipe: dict, objective: Objective) -> TrainConfig:
    """The config of a run into `out` from a recipe (a preset's values, flags over them) and its
    objective: the default target found (api.default_target), each .gguf model given as its converted
    folder, and a self-distilled recipe's corpus (the target's own answers) generated first, resumably,
    unless the recipe names a corpus."""
    if getattr(objective, "target", None) == DEFAULT_TARGET:
        from ..api import default_target
        objective = dataclasses.replace(objective, target=str(default_target()))
    recipe = dict(recipe)
    recipe["init_from"], recipe["objective"] = gguf_converted(recipe.get("init_from"), objective)
    data = recipe.pop("selfdistill", None)
    if data is not None and "corpus" not in recipe:
        recipe["corpus"] = [str(corpus_for(recipe["objective"].target, out, data))]
    return TrainConfig(out=out, **recipe)


def preset(name: str) -> dict:
    """The recipe `name` with its paths made absolute against the repository root."""
    recipe = dict(PRESETS[name])
    for key in PATHS:
        if key in recipe and not Path(recipe[key]).is_absolute():
            recipe[key] = str(ROOT / recipe[key])
    if "objective" in recipe:
        objective = recipe["objective"]
        paths = {key: str(ROOT / getattr(objective, key)) for key in OBJECTIVE_PATHS
                 if getattr(objective, key, None) not in (None, DEFAULT_TARGET)
                 and not Path(getattr(objective, key)).is_absolute()}
        recipe["objective"] = dataclasses.replace(objective, **paths)
    return recipe


# long runs (longrun.py): a head that keeps learning in the background over many sittings, from the committed
# head onwards; `specdec longrun run --preset NAME` starts or resumes it in runs/longrun-NAME
LONG_RUNS = {
    # SmolLM2-135M-Instruct's EAGLE-3 head (models/smollm2-eagle3): data from the Q8_0 target by the batched engine;
    # rate 2e-4 (1e-3 took the GPU-trained head from held-out α_1 0.60/0.56 chat/code to 0.53/0.51 in 0.2M
    # tokens at batch 8; 2e-4 kept 0.57/0.55 on the same data, the chat set's loss that of the prompts' new mix)
    "smollm2-eagle3": LongRun(init="models/smollm2-eagle3", lr=2e-4),
    # the same head's sittings on one GPU: data from the bf16 target, 512 rows at a time; 8x the CPU's batch
    "smollm2-eagle3-gpu": LongRun(init="models/smollm2-eagle3", device="cuda", quantize=None, capacity=512,
                                  shard_prompts=512, batch_size=64, lr=4e-4, warmup=50, passes=6.0, save_seconds=120),
}


def long_run(name: str) -> tuple[LongRun, Path]:
    """The long run `name` with its init folder made absolute, and its default run folder."""
    cfg = LONG_RUNS[name]
    init = cfg.init if Path(cfg.init).is_absolute() else str(ROOT / cfg.init)
    return dataclasses.replace(cfg, init=init), ROOT / "runs" / f"longrun-{name}"
