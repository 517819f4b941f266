"""Distilling a draft from a frozen target (objective "distill", train/loop.py): the loss is the
KL(target || draft) computed by hand, training lowers it, resume is exact, the export names its
teacher and recipe, and a teacher the student cannot learn from is refused with a clear error."""
from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from specdec.cli import build_parser
from specdec.errors import SpecdecError
from specdec.lm.arch import Arch
from specdec.lm.checkpoint import load_model, read_meta, sha256
from specdec.train.config import with_init_from, with_teacher
from specdec.train.loop import build, train
from specdec.train.losses import TeacherTargets, distill_kl, teacher_targets
from specdec.train.objectives import Distill
from specdec.train.presets import PRESETS

from ..conftest import free_port
from .test_train import JSON_PKG, tiny_cfg

STUDENT = Arch(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
               num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=256,
               tie_word_embeddings=True)
STEPS = 12


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    """A tiny target pretrained for a few steps on the json package (its own 512-token tokenizer)."""
    return train(tiny_cfg(tmp_path_factory.mktemp("teacher") / "run", steps=10))


@pytest.fixture(scope="module")
def other_model(tiny_checkpoint):
    """A model with another tokenizer: conftest's (384 tokens, trained on other text)."""
    return tiny_checkpoint


def distill_cfg(out, teacher, top_k: int | None = None, **overrides):
    settings = dict(model=STUDENT, objective=Distill(teacher=str(teacher), top_k=top_k), steps=STEPS, save_every=4,
                    eval_every=6, lr=1e-2)
    settings.update(overrides)
    return tiny_cfg(out, **settings)


def kl_by_hand(target_probs: list[float], draft_probs: list[float]) -> float:
    return sum(t * math.log(t / d) for t, d in zip(target_probs, draft_probs) if t > 0)


def softmax(xs: list[float]) -> list[float]:
    e = [math.exp(x) for x in xs]
    return [x / sum(e) for x in e]


def test_distill_loss_is_the_kl_from_target_to_draft_computed_by_hand():
    target_logits = [[2.0, 0.5, -1.0, 0.0], [0.0, 3.0, 1.0, -2.0]]  # two positions, vocabulary of 4
    draft_logits = [[1.0, 1.0, 0.0, -1.0], [0.5, 0.5, 2.0, 0.0]]
    teacher_model = lambda tokens: type("Out", (), {"logits": torch.tensor([target_logits])})()  # noqa: E731
    student = torch.tensor([draft_logits])

    full = distill_kl(student, teacher_targets(teacher_model, torch.zeros(1, 2, dtype=torch.long)))
    expected = sum(kl_by_hand(softmax(t), softmax(d)) for t, d in zip(target_logits, draft_logits)) / 2
    assert full.item() == pytest.approx(expected, rel=1e-6)

    # temperature T: both distributions at T, the KL times T^2
    T = 2.0
    at_t = distill_kl(student, teacher_targets(teacher_model, torch.zeros(1, 2, dtype=torch.long), T), T)
    expected_t = T * T * sum(kl_by_hand(softmax([x / T for x in t]), softmax([x / T for x in d]))
                             for t, d in zip(target_logits, draft_logits)) / 2
    assert at_t.item() == pytest.approx(expected_t, rel=1e-6)

    # top-2: the target's 2 most probable tokens and one bucket for the other 2, for both models
    top = teacher_targets(teacher_model, torch.zeros(1, 2, dtype=torch.long), top_k=2)
    assert top.indices.tolist() == [[[0, 1], [1, 2]]]
    expected_top = 0.0
    for t, d, keep in zip(target_logits, draft_logits, ([0, 1], [1, 2])):
        grouped_t = [softmax(t)[i] for i in keep] + [sum(softmax(t)[i] for i in range(4) if i not in keep)]
        grouped_d = [softmax(d)[i] for i in keep] + [sum(softmax(d)[i] for i in range(4) if i not in keep)]
        expected_top += kl_by_hand(grouped_t, grouped_d) / 2
    assert distill_kl(student, top).item() == pytest.approx(expected_top, rel=1e-5)
    assert distill_kl(student, top).item() < full.item()  # a lower bound of the full KL

    # a draft equal to the target costs nothing
    same = TeacherTargets(torch.log_softmax(torch.tensor([target_logits]), -1))
    assert distill_kl(torch.tensor([target_logits]), same).item() == pytest.approx(0.0, abs=1e-7)


def test_distillation_lowers_the_kl_and_the_export_names_its_teacher_and_recipe(tmp_path, teacher):
    out = train(distill_cfg(tmp_path / "run", teacher), command=["specdec", "train", "--objective", "distill"])
    meta = read_meta(out)
    valid = meta["history"]["valid"]
    assert [s for s, _ in valid] == [0, 6, 12]  # step 0: the student before training
    assert valid[-1][1] < 0.8 * valid[0][1]
    assert [s for s, _ in meta["history"]["valid_agreement"]] == [0, 6, 12]
    assert all(0 <= a <= 1 for _, a in meta["history"]["valid_agreement"])
    distilled = meta["distilled_from"]
    assert distilled["teacher_sha256"] == sha256(teacher / "model.safetensors")
    assert distilled["valid_before"]["kl"] == valid[0][1] and distilled["valid_after"]["kl"] == valid[-1][1]
    assert distilled["init_from"] is None and distilled["test"] is None  # only the stdlib has a test split
    assert meta["recipe_command"] == "specdec train --objective distill"
    assert meta["recipe"]["objective"]["teacher"] == str(teacher)
    # the draft shares the teacher's tokenizer, and the export is a loadable checkpoint
    assert (out / "tokenizer.json").read_bytes() == (teacher / "tokenizer.json").read_bytes()
    assert (tmp_path / "run" / "loss.png").stat().st_size > 1000
    load_model(out)


def test_resume_after_interruption_gives_the_uninterrupted_result(tmp_path, teacher):
    full = train(distill_cfg(tmp_path / "full", teacher, steps=8, top_k=16))
    assert train(distill_cfg(tmp_path / "cut", teacher, steps=8, top_k=16, stop_after=5)) is None
    resumed = train(distill_cfg(tmp_path / "cut", teacher, steps=8, top_k=16))
    a, b = load_file(full / "model.safetensors"), load_file(resumed / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert read_meta(resumed)["history"] == read_meta(full)["history"]
    # a resumed run must keep its teacher settings
    with pytest.raises(SpecdecError, match="saved with another distillation temperature and top-k"):
        train(distill_cfg(tmp_path / "cut", teacher, steps=8, top_k=32))


def test_init_from_starts_at_the_checkpoint_and_step_0_measures_it(tmp_path, teacher):
    start = train(distill_cfg(tmp_path / "first", teacher, steps=4))
    cfg = with_teacher(with_init_from(distill_cfg(tmp_path / "second", teacher, steps=4, init_from=str(start))))
    assert cfg.model == STUDENT
    model, _ = build(cfg)
    saved = load_model(start)
    assert all(torch.equal(a, b.float()) for a, b in zip(model.state_dict().values(), saved.state_dict().values()))
    out = train(cfg)
    # the start is measured again at step 0: the same figures up to the bf16 rounding of the saved weights
    before = read_meta(out)["distilled_from"]["valid_before"]
    after_first = read_meta(start)["distilled_from"]["valid_after"]
    assert before["step"] == 0 and before["greedy_agreement"] == after_first["greedy_agreement"]
    assert before["kl"] == pytest.approx(after_first["kl"], rel=1e-2)
    assert read_meta(out)["distilled_from"]["init_from_sha256"] == sha256(start / "model.safetensors")


def test_a_teacher_the_student_cannot_learn_from_is_refused(tmp_path, teacher, other_model, capsys):
    with pytest.raises(SpecdecError, match="teacher .* does not exist"):
        train(distill_cfg(tmp_path / "a", tmp_path / "nowhere"))
    with pytest.raises(SpecdecError, match="needs a teacher"):
        train(tiny_cfg(tmp_path / "b", model=STUDENT, objective=Distill()))
    from ..cli.test_cli import run_cli
    code, _, err = run_cli(capsys, "train", "--preset", "tiny", "--out", str(tmp_path / "c"), "--teacher", str(teacher))
    assert code == 2 and "--teacher is a setting of --objective distill or parallel" in err
    # another tokenizer, as the starting checkpoint's or as the one asked for
    with pytest.raises(SpecdecError, match="another tokenizer than the teacher"):
        train(distill_cfg(tmp_path / "d", teacher, init_from=str(other_model)))
    with pytest.raises(SpecdecError, match="another tokenizer than the teacher"):
        train(distill_cfg(tmp_path / "e", teacher, tokenizer=str(other_model / "tokenizer.json")))
    # the teacher's tokenizer but a student of another vocabulary size
    with pytest.raises(SpecdecError, match="vocabulary of 384 tokens but the teacher .* has 512"):
        train(distill_cfg(tmp_path / "f", teacher, model=dataclasses.replace(STUDENT, vocab_size=384)))
    assert not any((tmp_path / name).exists() for name in "abcdef")


def test_the_cli_selects_distillation_and_the_preset_is_the_shipped_draft_from_the_target():
    args = build_parser().parse_args(["train", "--preset", "tiny", "--out", "x", "--objective", "distill",
                                      "--teacher", "t", "--init-from", "d", "--distill-top-k", "8"])
    assert (args.objective, args.teacher, args.init_from, args.distill_top_k) == ("distill", "t", "d", 8)
    preset = PRESETS["draft-distill"]
    assert (preset["objective"], preset.get("init_from")) == (Distill(teacher="models/target"), None)


def test_ddp_two_processes_match_one_process(tmp_path, teacher):
    """Distillation under torchrun: each process distils its share of the global batch.
    Tolerance: 2e-3 nats per step over 6 steps (the all-reduce sums in another order)."""
    steps = 6
    single = train(tiny_cfg(tmp_path / "one", objective=Distill(teacher=str(teacher), top_k=16),
                            steps=steps))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           "-m", "specdec.cli", "train", "--preset", "tiny", "--corpus", JSON_PKG, "--steps", str(steps),
           "--objective", "distill", "--teacher", str(teacher), "--distill-top-k", "16", "--out", str(tmp_path / "two")]
    proc = subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    one = json.loads((single / "specdec.json").read_text())
    two = json.loads((tmp_path / "two" / "model" / "specdec.json").read_text())
    assert [s for s, _ in one["history"]["train"]] == [s for s, _ in two["history"]["train"]] == list(range(1, steps + 1))
    assert max(abs(a - b) for (_, a), (_, b) in zip(one["history"]["train"], two["history"]["train"])) <= 2e-3
    assert two["distilled_from"]["teacher_sha256"] == sha256(teacher / "model.safetensors")
    assert two["recipe_command"].startswith("specdec train --preset tiny")
