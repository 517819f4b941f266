"""specdec export: the exported draft model, loaded by transformers as vLLM's draft_model method
reads it (config.json + safetensors by transformers' names), computes specdec's logits; heads
without an exact speculators form and bad folders are refused with the fix named."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from specdec.cli import main
from specdec.export import RECORD, export
from specdec.lm.checkpoint import load_model, sha256
from specdec.heads.eagle import load_eagle

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


# ---- why the EAGLE head is refused, checked by the speculators package itself ----

SPECULATORS = ["speculators==0.9.0"]
# its own pins (transformers <= 5.19) conflict with ours, and its other dependencies (vision, audio, the
# training data tools) are not needed to load and run a draft: a separate environment, installed --no-deps
# on top of the few it imports
SPECULATORS_IMPORTS = ["torch==2.13.0", "transformers>=5.0,<=5.19.0", "loguru>=0.7.2,<=0.7.3", "pydantic",
                       "pydantic-settings", "safetensors", "numpy", "huggingface-hub", "openai",
                       "datasets>=4,<=5.1.0", "hs-connectors"]


@pytest.fixture(scope="session")
def speculators_python(pytestconfig, tmp_path_factory) -> Path:
    """A Python with `speculators` installed, made once and kept in pytest's cache (about 70 s the
    first time, from PyPI; skipped with the reason where PyPI cannot be reached); in a temporary
    folder where the cache is turned off (-p no:cacheprovider)."""
    cache = getattr(pytestconfig, "cache", None)
    venv = cache.mkdir("speculators-0.9.0-venv") if cache else tmp_path_factory.mktemp("speculators-venv")
    python = venv / "bin" / "python"
    if not (venv / "ready").exists():
        steps = [[sys.executable, "-m", "venv", "--clear", str(venv)],
                 [str(python), "-m", "pip", "install", "-q", *SPECULATORS_IMPORTS],
                 [str(python), "-m", "pip", "install", "-q", "--no-deps", *SPECULATORS]]
        for step in steps:
            done = subprocess.run(step, capture_output=True, text=True)
            if done.returncode != 0:
                pytest.skip(f"could not install speculators into {venv} ({' '.join(step[2:5])}...: "
                            f"{done.stderr.strip()[-300:]}); it needs PyPI")
        (venv / "ready").write_text("")
    return python


def speculators_weights(head, embedding: torch.Tensor) -> dict[str, torch.Tensor]:
    """The head under speculators' EAGLE-3 names, with the nearest fold of proj into q/k/v:
    W_qkv diag(input_layernorm) P, which drops the 1/rms(u) the norm between them divides by."""
    sd = {k: v.float() for k, v in head.state_dict().items()}
    cfg = head.config
    q, k, v = (sd["layer.self_attn.qkv_proj.weight"] @ torch.diag(sd["layer.input_layernorm.weight"])
               @ sd["proj.weight"]).split([cfg.num_attention_heads * cfg.head_dim,
                                           cfg.num_key_value_heads * cfg.head_dim,
                                           cfg.num_key_value_heads * cfg.head_dim])   # (., 2C) each
    gate, up = sd["layer.mlp.gate_up_proj.weight"].chunk(2)
    t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)                                # (V,) in the draft vocabulary
    t2d[head.draft_ids] = True
    layer = {"input_layernorm": sd["embed_norm.weight"], "hidden_norm": sd["hidden_norm.weight"],
             "self_attn.q_proj": q, "self_attn.k_proj": k, "self_attn.v_proj": v,
             "self_attn.o_proj": sd["layer.self_attn.o_proj.weight"],
             "post_attention_layernorm": sd["layer.post_attention_layernorm.weight"],
             "mlp.gate_proj": gate, "mlp.up_proj": up, "mlp.down_proj": sd["layer.mlp.down_proj.weight"]}
    return {"fc.weight": sd["fc.weight"], "norm.weight": sd["norm.weight"], "lm_head.weight": sd["lm_head.weight"],
            "embed_tokens.weight": embedding.float(), **{f"layers.0.{k}.weight": v for k, v in layer.items()},
            "d2t": head.draft_ids - torch.arange(head.draft_vocab_size), "t2d": t2d}   # d2t: target id - draft id


@pytest.mark.speculators
def test_speculators_eagle3_cannot_reproduce_the_head_so_it_is_refused(tmp_path, speculators_python):
    """speculators loads our config and weights (names, aux layer ids, d2t/t2d) and computes its EAGLE-3
    layer as we read it (to float32 rounding). The shipped head, folded into that layer as closely as
    linear algebra allows, computes other logits: the refusal in export.py is needed."""
    target = load_model(MODELS / "target", dtype=torch.float32)
    head = load_eagle(MODELS / "eagle", MODELS / "target", dtype=torch.float32)
    S, steps = 32, 3
    x = torch.randint(3, target.config.vocab_size, (1, S + steps), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = target(x[:, :S], output_layers=head.layer_ids)
        features = torch.cat([out.layers[i] for i in head.layer_ids], -1)                # (1, S, 3C)
        ours = [head.logits(h) for _, h in head.unroll(features, x[:, 1:S + steps], target.model.embed_tokens, steps)]
    save_file({k: v.contiguous() for k, v in speculators_weights(head, target.model.embed_tokens.weight).items()},
              tmp_path / "model.safetensors")
    save_file({"features": features, "input_ids": x[:, 1:S + 1].contiguous()}, tmp_path / "inputs.safetensors")
    (tmp_path / "head.json").write_text(json.dumps({"config": head.config.to_dict(), "layer_ids": list(head.layer_ids),
                                                    "draft_vocab_size": head.draft_vocab_size}))
    done = subprocess.run([str(speculators_python), str(Path(__file__).with_name("speculators_eagle3.py")),
                           str(tmp_path), str(MODELS / "target")], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {"aux_layer_ids": [2, 4, 6], "steps": steps}
    theirs = load_file(tmp_path / "speculators_logits.safetensors")
    control = (theirs["rewritten0"] - theirs["step0"]).abs().max().item()
    assert control <= 1e-4, control
    for j in range(steps):   # step j's last j positions read speculators' padding, not tokens: left out
        diff = (ours[j][:, :S - j] - theirs[f"step{j}"][:, :S - j]).abs().max().item()
        agree = (ours[j][:, :S - j].argmax(-1) == theirs[f"step{j}"][:, :S - j].argmax(-1)).float().mean().item()
        print(f"step {j}: speculators' layer rewritten vs loaded {control:.1e}; specdec's head vs its nearest "
              f"fold in speculators: max abs logit diff {diff:.2f}, argmax agreement {agree:.2f}")
        assert diff > 1.0 and agree < 0.5


def tiny_eagle3_head(tmp_path):
    """A tiny target saved as a checkpoint and an eagle3-layout head distilled on it, saved for it."""
    from specdec.lm.checkpoint import save_model
    from specdec.heads.eagle import save_eagle

    from .proposers.test_eagle import TARGET, distilled
    target_dir = tmp_path / "target"
    save_model(TARGET, target_dir, dtype=torch.float32)
    head = distilled(layout="eagle3")
    return TARGET, target_dir, head, save_eagle(head, tmp_path / "head", sha256(target_dir / "model.safetensors"),
                                                dtype=torch.float32)


@pytest.mark.speculators
@pytest.mark.parametrize("which", ["tiny", "shipped"])
def test_an_eagle3_layout_head_exports_and_speculators_computes_its_logits(tmp_path, speculators_python, which):
    """A head trained in the eagle3 layout (a tiny one, and the shipped models/eagle3), exported by
    `specdec export`: speculators 0.9 loads the folder as written (config.json, model.safetensors)
    with its own Eagle3DraftModel and computes the head's logits over 3 training-time-test steps,
    within 1e-4 in float32."""
    if which == "tiny":
        target, target_dir, head, head_dir = tiny_eagle3_head(tmp_path)
    else:
        target_dir, head_dir = MODELS / "target", MODELS / "eagle3"
        target, head = load_model(target_dir, dtype=torch.float32), load_eagle(head_dir, target_dir, dtype=torch.float32)
    out = tmp_path / "export"
    assert main(["export", "--format", "speculators", str(head_dir), str(out), "--verifier", str(target_dir)]) == 0
    record = json.loads((out / "specdec_export.json").read_text())
    assert record["kind"] == "eagle3" and record["vllm_speculative_config"]["method"] == "eagle3"
    S, steps = 24, 3
    x = torch.randint(3, target.config.vocab_size, (1, S + steps), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        o = target(x[:, :S], output_layers=head.layer_ids)
        features = torch.cat([o.layers[i] for i in head.layer_ids], -1)
        ours = [head.logits(h) for _, h in head.unroll(features, x[:, 1:S + steps], target.model.embed_tokens, steps)]
    save_file({"features": features, "input_ids": x[:, 1:S + 1].contiguous()}, out / "inputs.safetensors")
    done = subprocess.run([str(speculators_python), str(Path(__file__).with_name("speculators_eagle3.py")), str(out),
                           str(target_dir)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {"aux_layer_ids": [i + 1 for i in head.layer_ids],
                                                                "steps": steps}
    theirs = load_file(out / "speculators_logits.safetensors")
    for j in range(steps):   # step j's last j positions read speculators' padding, not tokens: left out
        diff = (ours[j][:, :S - j] - theirs[f"step{j}"][:, :S - j]).abs().max().item()
        print(f"{which} step {j}: specdec's eagle3-layout head vs speculators' Eagle3DraftModel: max abs logit "
              f"diff {diff:.1e}")
        assert diff <= 1e-4, (j, diff)


def test_a_specdec_layout_head_is_refused_and_an_eagle3_one_needs_its_target(tmp_path, capsys):
    head_dir = tiny_eagle3_head(tmp_path)[3]
    assert main(["export", str(head_dir), str(tmp_path / "out")]) == 2
    assert "needs its target's checkpoint folder" in capsys.readouterr().err and not (tmp_path / "out").exists()
    assert main(["export", str(MODELS / "eagle"), str(tmp_path / "out")]) == 2
    assert "--eagle-layout eagle3" in capsys.readouterr().err and not (tmp_path / "out").exists()
