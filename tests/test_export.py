"""specdec export: the exported draft model, loaded by transformers as vLLM's draft_model method
reads it (config.json + safetensors by transformers' names), computes specdec's logits; heads
without an exact speculators form and bad folders are refused with the fix named."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

from specdec.checkpoint import load_model, sha256
from specdec.cli import main
from specdec.export import RECORD, export

MODELS = Path(__file__).resolve().parents[1] / "models"


def test_exported_draft_model_computes_specdecs_logits_in_transformers(tmp_path):
    out = tmp_path / "draft-speculators"
    record = export(MODELS / "draft", out, verifier=str(MODELS / "target"))
    assert sha256(out / "model.safetensors") == sha256(MODELS / "draft" / "model.safetensors")
    assert json.loads((out / RECORD).read_text()) == record
    assert record["verifier"] == {"name_or_path": str(MODELS / "target"), "architectures": ["LlamaForCausalLM"]}
    assert record["vllm_speculative_config"]["method"] == "draft_model"

    ours = load_model(MODELS / "draft", dtype=torch.float32)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.randint(0, ours.config.vocab_size, (2, 48), generator=torch.Generator().manual_seed(0))  # (B, T)
    with torch.no_grad():
        diff = (ours(ids).logits - theirs(ids).logits).abs().max().item()
    print(f"max abs logit difference, specdec vs transformers on the export: {diff:.2e}")
    assert diff <= 1e-4, diff


def test_cli_prints_the_vllm_command(capsys, tmp_path):
    out = tmp_path / "o"
    assert main(["export", "--format", "speculators", str(MODELS / "draft"), str(out),
                 "--verifier", "org/target"]) == 0
    printed = capsys.readouterr().out
    assert "vllm serve org/target --speculative-config" in printed and '"method": "draft_model"' in printed
    assert json.loads((out / RECORD).read_text())["verifier"]["name_or_path"] == "org/target"


@pytest.fixture
def full(tmp_path):
    folder = tmp_path / "full"
    folder.mkdir()
    (folder / "something").write_text("x")
    return folder


@pytest.mark.parametrize("source, out, message", [
    (MODELS / "eagle", None, "cannot be folded away"),
    (MODELS / "target-mtp", None, "no speculators format admits"),
    (MODELS, None, "neither a model checkpoint"),
    (MODELS / "missing", None, "no folder at"),
    (MODELS / "draft", "full", "exists and is not empty"),
    (MODELS / "draft", "same", "the draft's own folder"),
])
def test_bad_input_is_a_clear_error_and_writes_nothing(capsys, tmp_path, full, source, out, message):
    dest = {None: tmp_path / "new", "full": full, "same": source}[out]
    assert main(["export", str(source), str(dest)]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "new").exists() and sorted(p.name for p in full.iterdir()) == ["something"]


def test_a_verifier_with_another_vocabulary_is_refused(capsys, tmp_path, tiny_checkpoint):
    assert main(["export", str(MODELS / "draft"), str(tmp_path / "o"), "--verifier", str(tiny_checkpoint)]) == 2
    assert "shares the target's tokenizer" in capsys.readouterr().err and not (tmp_path / "o").exists()


def test_unknown_format_is_refused(capsys, tmp_path):
    with pytest.raises(SystemExit):
        main(["export", "--format", "gguf", str(MODELS / "draft"), str(tmp_path / "o")])
    assert "invalid choice: 'gguf'" in capsys.readouterr().err
