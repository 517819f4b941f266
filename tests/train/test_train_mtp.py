"""Training with MTP heads through `specdec train` (train/loop.py): pretraining jointly from
scratch and heads on a frozen trunk, with the same exact resume, exports and torchrun as
next-token training; and MTP is not speculative decoding: the exported model decodes plainly,
without its heads, exactly as the trained trunk."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from specdec.decoding.engine import plain_generate, speculative_generate
from specdec.decoding.reference import reference_generate
from specdec.decoding.sampling import SamplingConfig
from specdec.decoding.stopping import StopRule
from specdec.errors import SpecdecError
from specdec.lm.checkpoint import load_model, read_meta, sha256
from specdec.lm.model import LlamaForCausalLM
from specdec.proposers import MTPProposer
from specdec.heads.mtp import load_mtp
from specdec.train.config import with_frozen
from specdec.train.loop import build, train
from specdec.train.objectives import MTP as MTPObjective
from specdec.train.objectives import objective

from ..conftest import free_port
from .test_train import JSON_PKG, tiny_cfg

STEPS = 8
MTP = dict(objective=MTPObjective(kind="sequential", depth=2, lam=0.5, lam_late=0.2), steps=STEPS,
           save_every=4, eval_every=4)


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """A tiny model pretrained with next-token + sequential MTP losses from scratch."""
    out = tmp_path_factory.mktemp("mtp") / "full"
    return train(tiny_cfg(out, **MTP))


def test_mtp_pretraining_resumes_exactly_and_exports_a_model_and_its_heads(tmp_path, pretrained):
    assert train(tiny_cfg(tmp_path / "cut", **MTP, stop_after=5)) is None
    resumed = train(tiny_cfg(tmp_path / "cut", **MTP))
    for folder, name in (("model", "model.safetensors"), ("heads", "heads.safetensors")):
        a = load_file(pretrained.parent / folder / name)
        b = load_file(resumed.parent / folder / name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    meta = read_meta(resumed)
    assert meta["history"] == read_meta(pretrained)["history"]
    assert [s for s, _ in meta["history"]["valid_heads"]] == [4, 8] and len(meta["history"]["train_heads"][0][1]) == 2
    heads_meta = json.loads((resumed.parent / "heads" / "heads.json").read_text())
    assert heads_meta["kind"] == "mtp-sequential" and heads_meta["depth"] == 2
    assert heads_meta["target_sha256"] == sha256(resumed / "model.safetensors")
    assert len(heads_meta["final_valid_head_losses"]) == 2
    load_mtp(resumed.parent / "heads", resumed)
    assert (tmp_path / "cut" / "loss.png").stat().st_size > 1000


def test_an_mtp_trained_model_decodes_plainly_as_its_trunk(pretrained):
    """The checkpoint holds the trunk only (the strict loader accepts it), plain decoding of it
    equals the reference decoding of the trunk's trained weights, and attaching the heads as a
    draft changes nothing under greedy decoding: MTP is a training objective."""
    model = load_model(pretrained)
    state = load_file(pretrained.parent / "work" / "state" / "state.safetensors")
    trunk = LlamaForCausalLM(model.config)
    trunk.load_hf_state_dict({k[6:]: v.to(torch.bfloat16) for k, v in state.items() if k.startswith("model.")})
    trunk.to(torch.bfloat16).eval()
    prompts, rule, greedy = [[5, 17, 42], [200, 3, 3, 9], [7]], StopRule(max_new_tokens=16), SamplingConfig()
    rows, _ = plain_generate(model, prompts, rule, greedy)
    for prompt, row in zip(prompts, rows):
        assert row.tokens == reference_generate(trunk, prompt, rule, greedy).tokens
    heads = load_mtp(pretrained.parent / "heads", pretrained)
    spec, metrics = speculative_generate(model, MTPProposer(heads=heads, target=model), prompts, rule,
                                         greedy, 2)
    assert [r.tokens for r in spec] == [r.tokens for r in rows] and metrics.proposed > 0


def test_heads_on_a_frozen_trunk_train_alone(tmp_path, pretrained):
    before = sha256(pretrained / "model.safetensors")
    frozen = dict(objective=MTPObjective(kind="parallel", depth=2, frozen_trunk=str(pretrained)), steps=STEPS,
                  save_every=4, eval_every=4, lr=1e-2)
    assert train(tiny_cfg(tmp_path / "cut", **frozen, stop_after=3)) is None
    heads_dir = train(tiny_cfg(tmp_path / "cut", **frozen))
    assert heads_dir == tmp_path / "cut" / "heads" and not (tmp_path / "cut" / "model").exists()
    assert sha256(pretrained / "model.safetensors") == before
    state = load_file(tmp_path / "cut" / "work" / "state" / "state.safetensors")
    assert not any(k.startswith("model.") for k in state)  # only heads (and their moments) are trained
    full = train(tiny_cfg(tmp_path / "full", **frozen))
    a, b = load_file(heads_dir / "heads.safetensors"), load_file(full / "heads.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    meta = json.loads((heads_dir / "heads.json").read_text())
    assert meta["target_sha256"] == before and meta["trunk"] == "frozen"
    train_tokens = load_mtp(heads_dir, pretrained).token_counts  # what drafting over a draft vocabulary reads
    assert int(train_tokens.sum()) == meta["corpus"]["tokens"]["train"]
    history = meta["history"]
    assert len({loss for _, loss in history["valid"]}) == 1  # the trunk's next-token loss never moves
    assert [s for s, _ in history["valid_heads"]] == [4, 8] and len(meta["final_valid_head_losses"]) == 2
    _, initial = build(with_frozen(tiny_cfg(tmp_path / "unused", **frozen)))
    trained = load_mtp(heads_dir, pretrained, dtype=torch.float32)
    assert all(not torch.equal(a, b) for a, b in zip(initial.parameters(), trained.parameters()))


def test_bad_mtp_settings_raise_specdec_error(tmp_path, pretrained, capsys):
    with pytest.raises(SpecdecError, match="unknown objective"):
        objective("medusa")
    from ..cli.test_cli import run_cli
    code, _, err = run_cli(capsys, "train", "--preset", "tiny", "--out", str(tmp_path / "b"), "--frozen-trunk",
                           str(pretrained))
    assert code == 2 and "--frozen-trunk is a setting of --objective mtp-parallel or mtp-sequential" in err
    with pytest.raises(SpecdecError, match="mtp_depth must be in"):
        train(tiny_cfg(tmp_path / "c", objective=MTPObjective(kind="parallel", depth=0)))
    with pytest.raises(SpecdecError, match="not the frozen trunk's tokenizer"):
        train(tiny_cfg(tmp_path / "d", **{**MTP, "objective": MTPObjective(kind="sequential", depth=2,
                                                                          frozen_trunk=str(pretrained))},
                       tokenizer=str(pretrained.parent / "work" / "state" / "state.json")))
    train(tiny_cfg(tmp_path / "e", steps=2, stop_after=1))
    with pytest.raises(SpecdecError, match="saved with another objective, mtp_depth"):
        train(tiny_cfg(tmp_path / "e", **{**MTP, "steps": 2}))


def test_mtp_under_torchrun_matches_one_process(tmp_path):
    """Tolerance as for next-token training: 2e-3 nats per step (all-reduce sums in another order)."""
    settings = {**MTP, "steps": 4}
    single = train(tiny_cfg(tmp_path / "one", **settings))
    script = tmp_path / "run.py"
    script.write_text("import sys\nfrom tests.train.test_train import tiny_cfg\nfrom specdec.train.loop import train\n"
                      "from specdec.train.objectives import MTP\n"
                      f"train(tiny_cfg(sys.argv[1], **{settings!r}))\n")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           str(script), str(tmp_path / "two")]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    one, two = read_meta(single)["history"], read_meta(tmp_path / "two" / "model")["history"]
    for key in ("train", "train_heads"):
        assert [s for s, _ in one[key]] == [s for s, _ in two[key]] == list(range(1, 5))
    assert max(abs(a - b) for (_, a), (_, b) in zip(one["train"], two["train"])) <= 2e-3
    assert max(abs(a - b) for (_, heads_one), (_, heads_two) in zip(one["train_heads"], two["train_heads"])
               for a, b in zip(heads_one, heads_two)) <= 2e-3


def test_cli_trains_heads_on_a_frozen_trunk_and_drafts_with_them(capsys, tmp_path, pretrained):
    """`specdec train --frozen-trunk` then `specdec generate --draft mtp --heads`: the same tokens as
    plain decoding, drafted by the heads; the heads are refused as a model and for another target."""
    from ..cli.test_cli import run_cli
    code, _, err = run_cli(capsys, "train", "--preset", "tiny", "--corpus", JSON_PKG, "--out", str(tmp_path / "h"),
                           "--objective", "mtp-sequential", "--mtp-depth", "2", "--frozen-trunk", str(pretrained),
                           "--steps", "4", "--eval-every", "4", "--save-every", "4")
    assert code == 0, err
    heads = tmp_path / "h" / "heads"
    base = ["generate", "--model", str(pretrained), "--prompt", "def f(x):", "--max-new-tokens", "12", "--json"]
    plain = json.loads(run_cli(capsys, *base)[1])
    code, out, err = run_cli(capsys, *base, "--draft", "mtp", "--heads", str(heads))
    assert code == 0, err
    spec = json.loads(out)
    assert spec["tokens"] == plain["tokens"] and spec["stats"]["method"] == "mtp"
    assert len(spec["stats"]["accepted_per_position"]) == 2  # k defaults to one draft per head
    code, _, err = run_cli(capsys, *base, "--draft", "draft-model", "--draft-model", str(heads))
    assert code == 2 and "holds draft heads (heads.json), not a model" in err
    code, _, err = run_cli(capsys, *base, "--draft", "mtp", "--heads", str(heads), "-k", "3")
    assert code == 2 and "at most 2 tokens per step" in err
