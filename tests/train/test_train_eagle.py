"""Training an EAGLE head through `specdec train --objective eagle --target` (train/loop.py): the
target stays frozen, a killed run resumes to exactly the head of an uninterrupted one, the export
carries its metadata (speculators vocabulary, alpha per position, curve), and the CLI drafts with
it token-identically to plain decoding; bad settings are refused with the fix."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from specdec.errors import SpecdecError
from specdec.lm.checkpoint import sha256
from specdec.heads.eagle import load_eagle
from specdec.train.loop import train
from specdec.train.objectives import Eagle

from .test_train import JSON_PKG, tiny_cfg

STEPS = 6
EAGLE = dict(steps=STEPS, save_every=3, eval_every=3, lr=1e-2)
HEAD = dict(steps=3, draft_vocab=200)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """A tiny model pretrained briefly with next-token prediction."""
    return train(tiny_cfg(tmp_path_factory.mktemp("eagle") / "target", steps=8, save_every=8, eval_every=8))


def test_a_head_trains_on_the_frozen_target_resumes_exactly_and_exports(tmp_path, target):
    before = sha256(target / "model.safetensors")
    settings = dict(EAGLE, objective=Eagle(target=str(target), **HEAD))
    assert train(tiny_cfg(tmp_path / "cut", **settings, stop_after=4)) is None
    heads = train(tiny_cfg(tmp_path / "cut", **settings))
    assert heads == tmp_path / "cut" / "heads" and not (tmp_path / "cut" / "model").exists()
    assert sha256(target / "model.safetensors") == before
    state = load_file(tmp_path / "cut" / "work" / "state" / "state.safetensors")
    assert not any(k.startswith("model.") for k in state)  # only the head (and its moments) is trained
    full = train(tiny_cfg(tmp_path / "full", **settings))
    a, b = load_file(heads / "heads.safetensors"), load_file(full / "heads.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    meta = json.loads((heads / "heads.json").read_text())
    assert meta["kind"] == "eagle3" and meta["target_sha256"] == before and meta["draft_vocab_size"] == 200
    assert meta["layer_ids"] == [0, 1]  # low and high of a 2-layer target
    spec = meta["speculators"]
    assert spec["eagle_aux_hidden_state_layer_ids"] == [1, 2] and spec["draft_vocab_size"] == 200
    assert spec["target_hidden_size"] == 64 and spec["speculators_config"]["verifier"]["name_or_path"] == str(target)
    history = meta["history"]
    assert [s for s, _ in history["valid_alpha"]] == [0, 3, 6] and all(len(a) == 3 for _, a in history["valid_alpha"])
    assert history["valid"][-1][1] < history["valid"][0][1]  # the KL fell
    assert "test_alpha_per_position" in meta and (tmp_path / "cut" / "loss.png").exists()  # (no test split here)
    head = load_eagle(heads, target)
    ids = head.draft_ids
    assert len(ids) == 200 and torch.equal(ids, ids.sort().values)


def eagle(target, **settings) -> dict:
    """The run settings of an EAGLE head for `target`, with these head settings."""
    return dict(EAGLE, objective=Eagle(target=str(target), **{**HEAD, **settings}))


def test_bad_eagle_settings_raise_specdec_error(tmp_path, target, capsys):
    with pytest.raises(SpecdecError, match="needs its target .* --objective eagle and --target MODEL"):
        train(tiny_cfg(tmp_path / "a", objective=Eagle()))
    from ..cli.test_cli import run_cli
    code, _, err = run_cli(capsys, "train", "--preset", "tiny", "--out", str(tmp_path / "b"), "--target", str(target))
    assert code == 2 and "--target is a setting of --objective eagle or block" in err
    with pytest.raises(SpecdecError, match="larger than the target's 512: choose --draft-vocab <= 512"):
        train(tiny_cfg(tmp_path / "c", **eagle(target, draft_vocab=1000)))
    with pytest.raises(SpecdecError, match=r"layer ids \[0, 2\] must be distinct decoder layers"):
        train(tiny_cfg(tmp_path / "d", **eagle(target, layers=(0, 2))))
    with pytest.raises(SpecdecError, match="--eagle-steps must be in"):
        train(tiny_cfg(tmp_path / "e", **eagle(target, steps=0)))
    with pytest.raises(SpecdecError, match="unknown EAGLE head layout 'eagle2'"):
        train(tiny_cfg(tmp_path / "f", **eagle(target, layout="eagle2")))
    assert train(tiny_cfg(tmp_path / "g", **eagle(target, layout="eagle3"), stop_after=1)) is None
    with pytest.raises(SpecdecError, match="saved with another EAGLE layers, draft vocabulary and layout"):
        train(tiny_cfg(tmp_path / "g", **eagle(target)))


@pytest.mark.parametrize("layout", ["specdec", "eagle3"])
def test_cli_trains_a_head_and_drafts_with_it(capsys, tmp_path, target, layout):
    """`specdec train --objective eagle --target --eagle-layout` then `specdec generate --draft eagle
    --heads`: the same tokens as plain decoding; k = 0 and the head folder as a model are refused; the
    eagle3 layout exports for vLLM, specdec's is refused with the reason."""
    from ..cli.test_cli import run_cli
    code, _, err = run_cli(capsys, "train", "--preset", "tiny", "--corpus", JSON_PKG, "--out", str(tmp_path / "h"),
                           "--objective", "eagle", "--target", str(target), "--draft-vocab", "128",
                           "--eagle-steps", "2", "--steps", "4", "--eval-every", "4", "--save-every", "4",
                           "--eagle-layout", layout)
    assert code == 0, err
    heads = tmp_path / "h" / "heads"
    base = ["generate", "--model", str(target), "--prompt", "def f(x):", "--max-new-tokens", "16", "--json"]
    plain = json.loads(run_cli(capsys, *base)[1])
    for k in ("1", "6"):
        code, out, err = run_cli(capsys, *base, "--draft", "eagle", "--heads", str(heads), "-k", k)
        assert code == 0, err
        spec = json.loads(out)
        assert spec["tokens"] == plain["tokens"] and spec["stats"]["method"] == "eagle"
    code, _, err = run_cli(capsys, *base, "--draft", "eagle", "--heads", str(heads), "-k", "0")
    assert code == 2 and "k >= 1 tokens per step, got k=0" in err
    code, _, err = run_cli(capsys, *base, "--draft", "draft-model", "--draft-model", str(heads))
    assert code == 2 and "`--draft eagle --heads PATH`" in err
    code, _, err = run_cli(capsys, *base, "--draft", "eagle", "--heads", str(target))
    assert code == 2 and "is a model checkpoint" in err
    code, out, err = run_cli(capsys, "export", str(heads), str(tmp_path / "vllm"), "--verifier", str(target))
    if layout == "eagle3":
        assert code == 0, err
        config = json.loads((tmp_path / "vllm" / "config.json").read_text())
        assert config["speculators_model_type"] == "eagle3" and config["draft_vocab_size"] == 128
        assert '"method": "eagle3"' in out
    else:
        assert code == 2 and "--eagle-layout eagle3" in err and not (tmp_path / "vllm").exists()


def test_train_without_a_preset_says_which_values_it_takes_and_shows_the_evaluation(capsys, tmp_path,
                                                                                     tiny_checkpoint):
    """An EAGLE head for a model of your own, no --preset: the command says whose recipe gives the
    other values (the shipped head's, without the shipped target it names), and the evaluations
    show a progress bar on stderr."""
    from ..cli.test_cli import run_cli
    code, out, err = run_cli(capsys, "train", "--corpus", JSON_PKG, "--objective", "eagle", "--target",
                             str(tiny_checkpoint), "--out", str(tmp_path / "run"), "--steps", "2", "--eval-every", "2",
                             "--seq-len", "32", "--batch-size", "2", "--micro-batch", "2", "--draft-vocab", "64")
    assert code == 0, err
    assert "no --preset: the values of --preset target-eagle, without the models it names: " in err
    assert "steps=500" in err and "evaluate:" in err
    assert "draft heads written to" in out
    assert json.loads((tmp_path / "run" / "heads" / "heads.json").read_text())["target"] == str(tiny_checkpoint)
