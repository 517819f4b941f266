"""Hand a specdec draft to a GPU serving engine: `specdec export --format speculators PATH OUT`.

vLLM reads speculative drafts in the layouts of the `speculators` package (0.9: EAGLE-3 and its
parallel variant, MTP, DFlash and its variants), and an independent draft model as a plain
transformers checkpoint (`"method": "draft_model"`; speculators has no format of its own for it).
What specdec trains maps onto these as follows:

- A draft model (config.json + model.safetensors, transformers' Llama layout and names) is already
  what vLLM reads: the export copies the checkpoint byte for byte and adds `specdec_export.json`,
  naming the verifier (name or path, architecture) and the speculative config that serves it.
- A parallel draft (proposers/parallel.py) is refused: vLLM's parallel drafting reads the mask token
  (`pard_token`) as an id of the verifier's vocabulary, and specdec's is one id past it.
- A block head (block.py) is refused: DFlash's drafter reads the target's features in every draft
  layer's keys and values, a block head once as context positions; no DFlash weights compute it.
- An EAGLE head in the eagle3 layout (`specdec train --objective eagle --eagle-layout eagle3`) is
  speculators' EAGLE-3 layer weight for weight: the export writes its config.json (speculators
  0.9's Eagle3SpeculatorConfig, the verifier named) and model.safetensors under speculators' names
  (the fused q/k/v and gate/up split, the embedding norm as the layer's input_layernorm, the
  verifier's embedding table, d2t/t2d for the draft vocabulary). tests/test_export.py loads it with
  speculators itself and compares logits.
- An EAGLE head in specdec's own layout has no exact speculators form. Both start from the same
  fused features g = fc(f) and the same [RMSNorm(Emb(x)); RMSNorm(g)], then differ:
      speculators / vLLM EAGLE-3:  q,k,v = W_qkv [n_e; n_g]                (W_qkv reads 2C)
                                   h = g + Attn(q,k,v); h = h + MLP(RMSNorm(h))
      specdec layout (eagle.py):   u = P [n_e; n_g]                        (P: 2C -> C)
                                   q,k,v = W_qkv RMSNorm(u);  h = u + Attn(q,k,v); ...
  The RMSNorm between P and W_qkv divides by the rms of u at each position, so P does not fold
  into W_qkv, and the residual stream is u, not g: for a trained head no weights of theirs compute
  it. The export refuses rather than write a head that would load and draft badly
  (tests/test_export.py loads the nearest fold with speculators: logits up to ~10 away, argmax
  agreement near 0).
- MTP heads: speculators' MTP format is one module (`num_nextn_predict_layers` must be 1) built on
  Qwen3-family layers, whose q/k per-head RMSNorms a Llama layer lacks, over the verifier's full
  vocabulary; specdec's heads are several Llama-layer modules (sequential, DeepSeek-V3 style) or
  independent layers over the trunk's state (parallel). Neither maps exactly; the export refuses.

The output folder is written atomically (atomic.py) and never over a non-empty folder.

This module knows nothing about drafting, training or how vLLM runs the draft.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .errors import SpecdecError
from .lm.atomic import atomic_dir
from .lm.checkpoint import CONFIG, DTYPES, PARALLEL_KIND, TOKENIZER, WEIGHTS, load_model, read_config, read_meta, sha256
from .heads.eagle import SPECULATORS_VERSION, load_eagle, read_eagle_meta, speculators_metadata
from .heads.folder import HEADS_META, HEADS_WEIGHTS

FORMATS = ("speculators",)
RECORD = "specdec_export.json"  # beside the exported checkpoint: where it came from, which verifier, how to serve
NUM_SPECULATIVE_TOKENS = 3      # the k written into the serving config; the shipped draft's best k is 2-3


def export(path: str | Path, out: str | Path, fmt: str = "speculators", verifier: str | None = None) -> dict:
    """Export the draft in `path` to the folder `out` in format `fmt`; returns the record written
    beside it. `verifier`: the target the draft serves (a checkpoint folder or a hub name); by
    default the one the draft was distilled from, when its specdec.json names it."""
    path, out = Path(path), Path(out)
    if fmt not in FORMATS:
        raise SpecdecError(f"unknown export format {fmt!r}: the formats are {', '.join(FORMATS)}")
    if not path.is_dir():
        raise SpecdecError(f"no folder at {path}: pass a draft model's checkpoint folder (e.g. models/draft)")
    check_out(out, path)
    kind = folder_kind(path)
    if kind == "eagle3":
        return export_eagle3(path, out, verifier)
    if kind == "block":
        raise SpecdecError(
            f"{path} holds a block head, which no speculators format holds: DFlash's drafter (speculators' and "
            "vLLM's `dflash`) is another model, its draft layers reading the target's features in their keys and "
            "values, where a block head reads them once, as context positions in its own cache (block.py), so "
            "no DFlash weights compute it. The formats `specdec export` writes: a draft model (specdec export "
            "--format speculators models/draft OUT) and an eagle3-layout EAGLE head (models/eagle3)")
    if kind == "parallel":
        mask = read_meta(path)["parallel"]["mask_token_id"]
        raise SpecdecError(
            f"{path} holds a parallel draft, which vLLM's parallel drafting (method draft_model with "
            "parallel_drafting, the mask token named by `pard_token` in the draft's config.json) would read only "
            f"with its mask token inside the verifier's vocabulary, as PARD reuses a reserved id; this draft's mask "
            f"token is an extra id past it ({mask}), so its vocabulary no longer matches the verifier's. Missing: "
            "a mask token among the verifier's own ids. The formats `specdec export` writes: a draft model "
            "(specdec export --format speculators models/draft OUT) and an eagle3-layout EAGLE head (models/eagle3)")
    if kind.startswith("mtp"):
        raise SpecdecError(
            f"{path} holds MTP heads ({kind}), which no speculators format admits: its MTP format is one "
            "module of Qwen3-family layers (per-head q/k norms that these Llama layers lack) over the "
            "verifier's full vocabulary, and specdec's are several modules of Llama layers. The formats "
            "`specdec export` writes: a draft model (specdec export --format speculators models/draft OUT)")
    return export_draft_model(path, out, verifier)


def folder_kind(path: Path) -> str:
    """'draft-model', 'eagle3' or the kind of MTP heads in `path`; an error for anything else."""
    if (path / HEADS_META).exists():
        try:
            return str(json.loads((path / HEADS_META).read_text()).get("kind"))
        except json.JSONDecodeError as e:
            raise SpecdecError(f"{path / HEADS_META} is not valid JSON ({e}); the heads folder is corrupt") from None
    if (path / CONFIG).exists() and (path / WEIGHTS).exists():
        return "parallel" if read_meta(path).get("kind") == PARALLEL_KIND else "draft-model"
    raise SpecdecError(f"{path} is neither a model checkpoint ({CONFIG} + {WEIGHTS}) nor a heads folder "
                       f"({HEADS_META}): pass a draft model folder such as models/draft")


def check_out(out: Path, source: Path) -> None:
    if out.resolve() == source.resolve():
        raise SpecdecError(f"the output folder {out} is the draft's own folder: choose a new folder")
    if out.exists() and not out.is_dir():
        raise SpecdecError(f"{out} is a file: choose a new folder for the export")
    if out.is_dir() and any(out.iterdir()):
        raise SpecdecError(f"{out} exists and is not empty: choose a new folder, or delete it first")


def recipe_teacher(recipe: dict) -> str | None:
    """The teacher a distilled draft's recipe names (in its objective's settings; recipes written
    before objectives had settings of their own name it at the top), a path inside the repository
    taken from its root."""
    objective = recipe.get("objective")
    teacher = objective.get("teacher") if isinstance(objective, dict) else recipe.get("teacher")
    if teacher is None or Path(teacher).is_absolute():
        return teacher
    return str(Path(__file__).resolve().parent.parent / teacher)


def verifier_record(verifier: str | None, draft: Path, draft_config: dict) -> dict:
    """The verifier as speculators names it (`name_or_path`, `architectures`). A local checkpoint
    folder is read and must share the draft's vocabulary (vLLM's draft_model method requires it)."""
    if verifier is None:
        verifier = recipe_teacher(read_meta(draft).get("recipe", {}))
    if verifier is None:
        raise SpecdecError(f"{draft} does not record the target it drafts for: pass --verifier with the "
                           "target's checkpoint folder or its hub name")
    folder = Path(verifier)
    if not folder.is_dir():  # a hub name: nothing to read here; specdec's models are Llama
        return {"name_or_path": verifier, "architectures": ["LlamaForCausalLM"],
                "architectures_source": "assumed (not a local folder): specdec trains drafts for Llama targets"}
    target = read_config(folder)
    if target.get("vocab_size") != draft_config.get("vocab_size"):
        raise SpecdecError(f"the draft's vocabulary has {draft_config.get('vocab_size')} ids but the verifier "
                           f"{folder}'s has {target.get('vocab_size')}: vLLM drafts only with a draft that shares "
                           "the target's tokenizer; pass the target this draft was trained for")
    if (folder / TOKENIZER).exists() and (draft / TOKENIZER).exists() and \
            sha256(folder / TOKENIZER) != sha256(draft / TOKENIZER):
        raise SpecdecError(f"{draft / TOKENIZER} differs from {folder / TOKENIZER}: the draft must use the "
                           "target's tokenizer; pass the target this draft was trained for")
    return {"name_or_path": str(folder), "architectures": target.get("architectures", ["LlamaForCausalLM"])}


def export_draft_model(path: Path, out: Path, verifier: str | None) -> dict:
    config = read_config(path)
    load_model(path)  # refuses a config that does not match its weights, before anything is written
    record = {
        "format": "speculators",
        "kind": "draft-model",
        "note": "speculators has no format for an independent draft model; vLLM reads this transformers "
                "checkpoint directly with the speculative method draft_model",
        "source": str(path),
        "source_sha256": sha256(path / WEIGHTS),
        "draft_architectures": config.get("architectures"),
        "verifier": verifier_record(verifier, path, config),
    }
    record["vllm_speculative_config"] = {"method": "draft_model", "model": str(out),
                                         "num_speculative_tokens": NUM_SPECULATIVE_TOKENS}
    with atomic_dir(out) as tmp:
        for name in (CONFIG, WEIGHTS, TOKENIZER):
            if (path / name).exists():
                shutil.copyfile(path / name, tmp / name)
        (tmp / RECORD).write_text(json.dumps(record, indent=2) + "\n")
    return record


def export_eagle3(path: Path, out: Path, verifier: str | None) -> dict:
    """An eagle3-layout EAGLE head as speculators' EAGLE-3 checkpoint (module docstring)."""
    meta = read_eagle_meta(path)
    if meta.get("layout", "specdec") != "eagle3":
        raise SpecdecError(
            f"{path} is an EAGLE head in specdec's own layout, which has no exact form in speculators' EAGLE-3 "
            "layout (the one vLLM reads): there the layer feeds [RMSNorm(embedding); RMSNorm(g)] (2C wide) "
            "straight into q/k/v and adds the attention output to g; this head projects it to C first and its "
            "layer normalises that projection (input RMSNorm) before q/k/v and adds the attention output to the "
            "projection. A norm between the projection and q/k/v cannot be folded away, so no weights reproduce "
            "the head. Train one in EAGLE-3's layout (specdec train --preset target-eagle3, or --eagle-layout "
            "eagle3) and export that, or export the draft model (specdec export --format speculators models/draft OUT)")
    verifier = verifier or meta.get("target")
    if verifier is None or not Path(verifier).is_dir():
        raise SpecdecError(f"exporting an EAGLE head needs its target's checkpoint folder (its embedding table is "
                           f"part of speculators' checkpoint): pass --verifier with the folder the head was trained "
                           f"for{'' if verifier is None else f' ({verifier} is not a folder here)'}")
    folder = Path(verifier)
    head = load_eagle(path, folder, dtype=torch.float32)  # refuses a head trained for another target
    embedding = load_file(folder / WEIGHTS)["model.embed_tokens.weight"]
    dtype = DTYPES.get(meta.get("dtype"), torch.bfloat16)
    record = {
        "format": "speculators",
        "kind": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "source": str(path),
        "source_sha256": sha256(path / HEADS_WEIGHTS),
        "verifier": verifier_record(str(folder), folder, read_config(folder)),
        "vllm_speculative_config": {"method": "eagle3", "model": str(out),
                                    "num_speculative_tokens": NUM_SPECULATIVE_TOKENS},
    }
    config = speculators_metadata(head, record["verifier"]["name_or_path"], NUM_SPECULATIVE_TOKENS)
    with atomic_dir(out) as tmp:
        save_file({k: v.contiguous() for k, v in speculators_weights(head, embedding, dtype).items()}, tmp / WEIGHTS,
                  metadata={"format": "pt"})
        (tmp / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        if (folder / TOKENIZER).exists():
            shutil.copyfile(folder / TOKENIZER, tmp / TOKENIZER)
        (tmp / RECORD).write_text(json.dumps(record, indent=2) + "\n")
    return record


def speculators_weights(head, embedding: torch.Tensor, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """An eagle3-layout head's tensors under speculators' EAGLE-3 names, floating ones in `dtype`: the
    fused q/k/v and gate/up split, the embedding's norm as the layer's input_layernorm, the verifier's
    embedding, d2t (draft id -> target id - draft id) and t2d (target id -> in the draft vocabulary)."""
    sd, cfg = head.state_dict(), head.config
    q, k, v = sd["layer.self_attn.qkv_proj.weight"].split([cfg.num_attention_heads * cfg.head_dim,
                                                           cfg.num_key_value_heads * cfg.head_dim,
                                                           cfg.num_key_value_heads * cfg.head_dim])
    gate, up = sd["layer.mlp.gate_up_proj.weight"].chunk(2)
    layer = {"input_layernorm": sd["embed_norm.weight"], "hidden_norm": sd["hidden_norm.weight"],
             "self_attn.q_proj": q, "self_attn.k_proj": k, "self_attn.v_proj": v,
             "self_attn.o_proj": sd["layer.self_attn.o_proj.weight"],
             "post_attention_layernorm": sd["layer.post_attention_layernorm.weight"],
             "mlp.gate_proj": gate, "mlp.up_proj": up, "mlp.down_proj": sd["layer.mlp.down_proj.weight"]}
    floating = {"fc.weight": sd["fc.weight"], "norm.weight": sd["norm.weight"], "lm_head.weight": sd["lm_head.weight"],
                "embed_tokens.weight": embedding, **{f"layers.0.{k}.weight": w for k, w in layer.items()}}
    t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    t2d[head.draft_ids] = True
    return {**{k: w.to(dtype) for k, w in floating.items()},
            "d2t": head.draft_ids - torch.arange(head.draft_vocab_size), "t2d": t2d}


def serve_command(record: dict) -> str:
    """The vLLM command line that serves the verifier with the exported draft."""
    config = json.dumps(record["vllm_speculative_config"])
    return f"vllm serve {record['verifier']['name_or_path']} --speculative-config '{config}'"
