"""Training: the schedule, exact resume after an interruption, atomic saves, and DDP under torchrun
matching one process with the same global batch."""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from specdec.lm.atomic import atomic_dir
from specdec.lm.checkpoint import load_model, read_meta
from specdec.train.config import TrainConfig
from specdec.train.loop import lr_at, train
from specdec.train.objectives import Where
from specdec.train.presets import PRESETS

from ..conftest import free_port

JSON_PKG = str(Path(sysconfig.get_paths()["stdlib"]) / "json")


def tiny_cfg(out: Path, **overrides) -> TrainConfig:
    preset = dict(PRESETS["tiny"])
    preset.update(corpus=[JSON_PKG], eval_windows=2, **overrides)
    return TrainConfig(out=str(out), **preset)


def test_warmup_then_cosine_to_the_floor():
    cfg = TrainConfig(out="unused", steps=100, warmup=10, lr=1.0, min_lr_ratio=0.1)
    assert lr_at(cfg, 0) == pytest.approx(0.1) and lr_at(cfg, 9) == pytest.approx(1.0)
    assert lr_at(cfg, 10) == pytest.approx(1.0)
    assert lr_at(cfg, 100) == pytest.approx(0.1)
    lrs = [lr_at(cfg, s) for s in range(10, 101)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))


def test_resume_after_interruption_gives_the_uninterrupted_result(tmp_path):
    full = train(tiny_cfg(tmp_path / "full", steps=12, save_every=4))
    assert train(tiny_cfg(tmp_path / "cut", steps=12, save_every=4, stop_after=7)) is None
    assert not (tmp_path / "cut" / "model").exists()
    resumed = train(tiny_cfg(tmp_path / "cut", steps=12, save_every=4))
    a, b = load_file(full / "model.safetensors"), load_file(resumed / "model.safetensors")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    meta = read_meta(resumed)
    assert meta["history"]["train"] == read_meta(full)["history"]["train"]
    assert meta["corpus"]["sha256"] and meta["corpus"]["files"]["train"]
    assert meta["tokens_seen"] == 12 * 4 * 64
    assert (tmp_path / "cut" / "loss.png").stat().st_size > 1000
    load_model(resumed)  # the export is a loadable checkpoint


def test_an_interrupted_save_leaves_the_previous_checkpoint_intact(tmp_path):
    dest = tmp_path / "state"
    with atomic_dir(dest) as tmp:
        (tmp / "a").write_text("old")
    with pytest.raises(KeyboardInterrupt):
        with atomic_dir(dest) as tmp:
            (tmp / "a").write_text("half")
            raise KeyboardInterrupt
    assert (dest / "a").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state"]


def test_ddp_two_processes_match_one_process_with_the_same_global_batch(tmp_path):
    """Tolerance: 2e-3 nats per step over 8 steps (gradient all-reduce sums in another order)."""
    steps = 8
    single = train(tiny_cfg(tmp_path / "one", steps=steps))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           "-m", "specdec.cli", "train", "--preset", "tiny", "--corpus", JSON_PKG, "--steps", str(steps),
           "--out", str(tmp_path / "two")]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    one = json.loads((single / "specdec.json").read_text())["history"]["train"]
    two = json.loads((tmp_path / "two" / "model" / "specdec.json").read_text())["history"]["train"]
    assert [s for s, _ in one] == [s for s, _ in two] == list(range(1, steps + 1))
    assert max(abs(a - b) for (_, a), (_, b) in zip(one, two)) <= 2e-3
    assert one[-1][1] < one[0][1]  # and it learns


def test_a_changed_corpus_or_vocabulary_is_prepared_again_or_refused(tmp_path, capsys):
    """prepared.json is keyed by the corpus files (sizes, mtimes), vocabulary size, tokenizer and seq_len."""
    from specdec.errors import SpecdecError
    from specdec.train.loop import Run
    corpus = tmp_path / "corpus"
    shutil.copytree(JSON_PKG, corpus)
    def cfg(**overrides):
        return TrainConfig(out=str(tmp_path / "run"), **{**PRESETS["tiny"], "corpus": [str(corpus)], **overrides})
    Run(cfg()).prepare()
    tokens = json.loads((tmp_path / "run" / "work" / "prepared.json").read_text())["tokens"]["train"]
    Run(cfg()).prepare()  # same key: reused silently
    assert "preparing it again" not in capsys.readouterr().err
    (corpus / "late.py").write_text("print('a file added after a failed run')\n" * 50)
    Run(cfg()).prepare()
    assert "another corpus: preparing it again" in capsys.readouterr().err
    assert json.loads((tmp_path / "run" / "work" / "prepared.json").read_text())["tokens"]["train"] > tokens
    (tmp_path / "run" / "work" / "state").mkdir()  # a run is under way: its weights expect these tokens
    model = PRESETS["tiny"]["model"]
    with pytest.raises(SpecdecError, match="prepared with another vocab size"):
        Run(cfg(model=dataclasses.replace(model, vocab_size=600))).prepare()


def test_presets_name_the_shipped_models_from_any_working_directory(tmp_path, monkeypatch):
    from specdec.train.presets import DEFAULT_TARGET, OBJECTIVE_PATHS, PATHS, preset
    monkeypatch.chdir(tmp_path)
    for name in PRESETS:
        recipe = preset(name)
        paths = {**{key: recipe[key] for key in PATHS if key in recipe},
                 **{key: getattr(recipe["objective"], key, None) for key in OBJECTIVE_PATHS if "objective" in recipe}}
        for key, path in paths.items():
            if path not in (None, DEFAULT_TARGET):  # the command line resolves the default target
                assert Path(path).exists(), f"preset {name}: {key} {path} not found"
    assert Path(preset("target-mtp")["objective"].frozen_trunk).is_absolute()


def test_building_a_run_gives_the_global_random_state_back():
    from specdec.train.loop import build
    torch.manual_seed(7)
    expected = torch.rand(2)
    torch.manual_seed(7)
    a, _ = build(tiny_cfg(Path("unused")))
    b, _ = build(tiny_cfg(Path("unused")))
    assert torch.equal(torch.rand(2), expected)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))  # still a function of the seed


def test_every_micro_batch_draws_its_own_anchors():
    """The anchors' seed is one number per (seed, step, rank, micro-batch): neighbours never share it
    (once, step 1 and rank 1 + micro-batch 9 of step 0 drew the same anchors)."""
    places = [Where(seed, step, 100, rank, micro) for seed in range(2) for step in range(12)
              for rank in range(3) for micro in range(12)]
    seeds = [where.anchors().initial_seed() for where in places]
    assert len(set(seeds)) == len(places)
    assert Where(0, 1, 10, 0, 0).anchors().initial_seed() != Where(0, 0, 10, 1, 9).anchors().initial_seed()
