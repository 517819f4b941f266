"""MTP heads (heads/mtp.py) and their losses (train/losses.py): each head sees only what it may
see, the memory-saving order computes the naive order's gradient, and a heads folder is never
taken for anything else nor attached to another target."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from specdec.errors import SpecdecError
from specdec.lm.arch import Arch
from specdec.lm.checkpoint import load_model, save_model, sha256
from specdec.heads.mtp import MTP_KINDS, build_mtp, check_mtp_fits, load_mtp, save_mtp, teacher_forced
from specdec.train.losses import LossWeights, mtp_backward
from specdec.train.objectives import init_weights

from ..conftest import TINY, tiny_model

SMALL = Arch(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64)


def trunk_and_heads(kind: str, depth: int = 3, cfg: Arch = SMALL, seed: int = 0):
    trunk = tiny_model(seed, cfg)
    torch.manual_seed(seed + 1)
    heads = build_mtp(kind, cfg, depth)
    init_weights(heads, std=0.1)
    return trunk, heads


@torch.no_grad()
def head_outputs(trunk, heads, tokens: torch.Tensor) -> list[torch.Tensor]:
    hidden = trunk(tokens[:, :-1]).hidden
    return [out for _, out, _, _ in teacher_forced(heads, trunk, hidden, tokens)]


@pytest.mark.parametrize("kind", MTP_KINDS)
def test_a_head_never_sees_the_token_it_predicts(kind):
    """Head j (0-based) at position t predicts x_{t+2+j}: changing that token (or any later one)
    leaves its output at t unchanged; a sequential module does read x_{t+1+j}, a parallel head not."""
    trunk, heads = trunk_and_heads(kind)
    tokens = torch.randint(0, SMALL.vocab_size, (2, 20), generator=torch.Generator().manual_seed(0))
    base = head_outputs(trunk, heads, tokens)
    t = 6
    for j in range(heads.depth):
        assert base[j].shape[1] == 20 - 2 - j  # the last position whose target is in the window
        target_changed = tokens.clone()
        target_changed[:, t + 2 + j] = (target_changed[:, t + 2 + j] + 1) % SMALL.vocab_size
        assert torch.equal(head_outputs(trunk, heads, target_changed)[j][:, :t + 1], base[j][:, :t + 1])
        read_changed = tokens.clone()
        read_changed[:, t + 1 + j] = (read_changed[:, t + 1 + j] + 1) % SMALL.vocab_size
        changed = head_outputs(trunk, heads, read_changed)[j][:, t]
        assert (not torch.allclose(changed, base[j][:, t])) == heads.reads_ahead


@pytest.mark.parametrize("kind", MTP_KINDS)
@pytest.mark.parametrize("train_trunk", [True, False])
def test_memory_saving_order_gives_the_naive_gradient(kind, train_trunk):
    trunk, heads = trunk_and_heads(kind)
    trunk.train().requires_grad_(train_trunk)
    batch = torch.randint(0, SMALL.vocab_size, (3, 17), generator=torch.Generator().manual_seed(1))
    params = [p for p in [*trunk.parameters(), *heads.parameters()] if p.requires_grad]
    results = []
    for memory_saving in (False, True):
        for p in params:
            p.grad = None
        losses = mtp_backward(trunk, heads, batch, [0.5, 0.3, 0.2], 0.7, train_trunk, memory_saving)
        results.append((losses, [p.grad.clone() for p in params]))
    (naive_losses, naive), (saving_losses, saving) = results
    assert len(naive) == len(saving) == len(params)  # every trainable weight got a gradient
    assert all(torch.allclose(a, b, atol=1e-6, rtol=1e-4) for a, b in zip(naive, saving))
    assert saving_losses[1:] == pytest.approx(naive_losses[1:], abs=1e-6)
    assert (saving_losses[0] is None) == (not train_trunk)
    if not train_trunk:
        assert all(p.grad is None for p in trunk.parameters())


def test_loss_weights_schedule():
    w = LossWeights(depth=3, lam=0.3, lam_late=0.1, lam_switch=0.5, beta=0.5)
    assert w.at(0, 100) == pytest.approx([0.3, 0.15, 0.075])
    assert w.at(49, 100) == pytest.approx([0.3, 0.15, 0.075])
    assert w.at(50, 100) == pytest.approx([0.1, 0.05, 0.025])
    assert LossWeights(depth=2).at(99, 100) == [1.0, 1.0]
    with pytest.raises(SpecdecError, match="fraction"):
        LossWeights(depth=2, lam_switch=1.5)


# ---- the heads folder ----

@pytest.fixture
def target_dir(tmp_path, tokenizer_file):
    return save_model(tiny_model(), tmp_path / "target", tokenizer_file=tokenizer_file, dtype=torch.float32)


@pytest.mark.parametrize("kind", MTP_KINDS)
def test_heads_round_trip_for_their_target(tmp_path, target_dir, kind):
    _, heads = trunk_and_heads(kind, depth=2, cfg=TINY)
    heads.token_counts = torch.arange(TINY.vocab_size)
    path = save_mtp(heads, tmp_path / "heads", sha256(target_dir / "model.safetensors"), meta={"note": "x"},
                    dtype=torch.float32)
    meta = json.loads((path / "heads.json").read_text())
    assert (meta["kind"], meta["depth"], meta["note"]) == (kind, 2, "x")
    assert meta["target_sha256"] == sha256(target_dir / "model.safetensors")
    loaded = load_mtp(path, target_dir)
    assert type(loaded) is type(heads) and loaded.depth == 2
    assert torch.equal(loaded.token_counts, torch.arange(TINY.vocab_size))
    assert all(torch.equal(a, b) for a, b in zip(heads.state_dict().values(), loaded.state_dict().values()))
    assert next(load_mtp(path, target_dir, dtype=torch.bfloat16).parameters()).dtype == torch.bfloat16


def test_heads_refuse_another_target_and_are_never_a_model(tmp_path, target_dir, tokenizer_file):
    _, heads = trunk_and_heads("mtp-sequential", depth=2, cfg=TINY)
    path = save_mtp(heads, tmp_path / "heads", sha256(target_dir / "model.safetensors"))
    other = save_model(tiny_model(seed=5), tmp_path / "other", tokenizer_file=tokenizer_file, dtype=torch.float32)
    with pytest.raises(SpecdecError, match="belong to the target with model.safetensors sha256"):
        load_mtp(path, other)
    with pytest.raises(SpecdecError, match="holds draft heads .heads.json., not a model"):
        load_model(path)  # a heads folder loaded as a draft model or target
    with pytest.raises(SpecdecError, match="is a model checkpoint"):
        load_mtp(target_dir, target_dir)  # a model loaded as heads
    with pytest.raises(SpecdecError, match="no heads.json"):
        load_mtp(tmp_path, target_dir)
    eagle = tmp_path / "eagle"
    shutil.copytree(path, eagle)
    meta = json.loads((eagle / "heads.json").read_text())
    (eagle / "heads.json").write_text(json.dumps({**meta, "kind": "eagle"}))
    with pytest.raises(SpecdecError, match="kind 'eagle', not MTP heads"):
        load_mtp(eagle, target_dir)
    with pytest.raises(SpecdecError, match="unknown MTP head kind"):
        build_mtp("medusa", TINY, 2)


def test_heads_fit_only_the_model_they_were_built_for():
    _, heads = trunk_and_heads("mtp-parallel", depth=2, cfg=TINY)
    check_mtp_fits(heads, tiny_model(seed=3))  # same config: fits (weights are checked by load_mtp)
    with pytest.raises(SpecdecError, match="built for another model"):
        check_mtp_fits(heads, tiny_model(cfg=SMALL))
    with pytest.raises(SpecdecError, match="load both in one dtype"):
        check_mtp_fits(heads, tiny_model().to(torch.bfloat16))
