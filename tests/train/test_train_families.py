"""Drafts trained for a transformers checkpoint of another family (Qwen3, Qwen2, Llama-3; built here
with random weights and a tokenizer trained here): an EAGLE head, MTP heads and a distilled draft
model train a few steps on it, and speculative greedy with each equals plain decoding."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from specdec.decoding.engine import speculative_generate
from specdec.decoding.reference import reference_generate
from specdec.decoding.sampling import SamplingConfig
from specdec.decoding.stopping import StopRule
from specdec.lm.checkpoint import load_model
from specdec.proposers import DraftModelProposer, EagleProposer, MTPProposer
from specdec.heads.eagle import load_eagle
from specdec.heads.mtp import load_mtp
from specdec.train.loop import train
from specdec.train.objectives import MTP, Distill, Eagle
from specdec.train.presets import PRESETS

from ..lm.test_families import hf_model, save
from ..lm.test_tokenizer import foreign_checkpoint_tokenizer
from .test_train import tiny_cfg

FEW = dict(steps=2, save_every=2, eval_every=2, lr=1e-2)


@pytest.fixture(scope="module", params=["qwen3", "qwen2", "llama3"])
def target(request, tmp_path_factory):
    """A checkpoint folder of the family: model (vocab 300), tokenizer, config."""
    import json
    folder = tmp_path_factory.mktemp(request.param)
    save(hf_model(request.param, vocab_size=300, bos_token_id=0, eos_token_id=2), folder, torch.bfloat16)
    foreign_checkpoint_tokenizer(folder, request.param == "llama3", json.loads((folder / "config.json").read_text()))
    return folder


def greedy_equals_plain(target_folder, proposer):
    model = load_model(target_folder)
    prompts = [[0, 50, 60, 70, 50, 60], [0, 9, 8, 7]]
    rule = StopRule(12)
    plain = [reference_generate(model, p, rule, SamplingConfig()).tokens for p in prompts]
    rows, _ = speculative_generate(model, proposer(model), prompts, rule, SamplingConfig(), k=2)
    assert [r.tokens for r in rows] == plain


def test_an_eagle_head_mtp_heads_and_a_distilled_draft_train_for_the_target(tmp_path, target):
    eagle = train(tiny_cfg(tmp_path / "eagle", objective=Eagle(target=str(target), steps=2, draft_vocab=128), **FEW))
    greedy_equals_plain(target, lambda m: EagleProposer(head=load_eagle(eagle, target), target=m))
    mtp = train(tiny_cfg(tmp_path / "mtp", objective=MTP(kind="parallel", depth=2, frozen_trunk=str(target)), **FEW))
    greedy_equals_plain(target, lambda m: MTPProposer(heads=load_mtp(mtp, target), target=m))
    student = dataclasses.replace(PRESETS["tiny"]["model"], vocab_size=300, num_hidden_layers=1)
    draft = train(tiny_cfg(tmp_path / "draft", objective=Distill(teacher=str(target)), model=student, **FEW))
    greedy_equals_plain(target, lambda m: DraftModelProposer(model=load_model(draft)))
