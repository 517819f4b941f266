"""Checkpoints in the layout of transformers' causal LMs (`LlamaForCausalLM` and the families of arch.py).

A checkpoint is a folder: config.json (transformers' keys, read strictly: arch.py),
model.safetensors or shards named by model.safetensors.index.json (the weights, never pickle),
tokenizer.json, and for specdec's own models specdec.json (provenance: recipe, corpus files and
hash, training summary). Folders are saved through atomic.atomic_dir, so a killed save never leaves a
half-written checkpoint, and `read_config` finishes an interrupted one first (atomic.recover).

This module knows nothing about training or decoding.
"""
from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from .. import kernels
from ..errors import SpecdecError
from .arch import Arch
from .atomic import atomic_dir, recover
from .device import placement
from .model import LlamaForCausalLM, place, store_matrices

CONFIG, WEIGHTS, TOKENIZER, META = "config.json", "model.safetensors", "tokenizer.json", "specdec.json"
PARALLEL_KIND = "parallel-draft"  # specdec.json "kind" of a parallel draft model (proposers/parallel.py)
INDEX = "model.safetensors.index.json"  # sharded weights: which file holds each tensor
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def hf_config(cfg: Arch, dtype: torch.dtype) -> dict:
    """The config.json of a model of architecture `cfg` saved in `dtype` (Arch.hf_config)."""
    return cfg.hf_config(dtype)


def save_model(model: LlamaForCausalLM, path: str | Path, tokenizer_file: str | Path | None = None,
               meta: dict | None = None, dtype: torch.dtype = torch.bfloat16) -> Path:
    path = Path(path)
    state = {k: v.detach().to(dtype).contiguous() for k, v in model.hf_state_dict().items()}
    with atomic_dir(path) as tmp:
        save_file(state, tmp / WEIGHTS, metadata={"format": "pt"})
        (tmp / CONFIG).write_text(json.dumps(hf_config(model.config, dtype), indent=2) + "\n")
        if tokenizer_file is not None:
            shutil.copyfile(tokenizer_file, tmp / TOKENIZER)
        if meta is not None:
            (tmp / META).write_text(json.dumps(meta, indent=2) + "\n")
    return path


def shown_path(path: Path) -> str:
    """A path inside the repository relative to its root (models/target), one in the home folder
    from ~ (no machine's user paths in a report), others as given."""
    resolved = Path(path).resolve()
    for root, prefix in ((Path(__file__).resolve().parents[2], ""), (Path.home().resolve(), "~/")):
        if resolved.is_relative_to(root):
            return prefix + resolved.relative_to(root).as_posix()
    return str(path)


def shown_text(text: str) -> str:
    """`text` (an error message) with the paths in the repository and the home folder written as
    `shown_path` writes them."""
    root, home = Path(__file__).resolve().parents[2], Path.home().resolve()
    return text.replace(f"{root}/", "").replace(f"{home}/", "~/")


def sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def read_config(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_dir():
        recover(path)
    if not path.is_dir():
        raise SpecdecError(f"no checkpoint folder at {path}: pass --model with a folder holding "
                           f"{CONFIG} and {WEIGHTS} (train one with `specdec train`)")
    try:
        return json.loads((path / CONFIG).read_text())
    except FileNotFoundError:
        if (path / "heads.json").exists():
            raise SpecdecError(f"{path} holds draft heads (heads.json), not a model: they draft for the target "
                               "they were trained on (MTP heads: `--draft mtp --heads PATH`; an EAGLE head: "
                               "`--draft eagle --heads PATH`)") from None
        raise SpecdecError(f"{path} has no {CONFIG}: it is not a specdec/transformers checkpoint") from None
    except json.JSONDecodeError as e:
        raise SpecdecError(f"{path / CONFIG} is not valid JSON ({e}); the checkpoint is corrupt, re-save or retrain it") from None


def read_arch(path: str | Path) -> Arch:
    """The architecture of the checkpoint folder at `path`, read strictly (arch.resolve): a key
    specdec does not implement is refused by name, never dropped."""
    path = Path(path)
    raw = read_config(path)
    try:
        return Arch.from_dict({"model_type": None, **raw})
    except (KeyError, TypeError, ValueError) as e:
        raise SpecdecError(f"{path / CONFIG} is missing or has invalid fields ({e})") from None


def read_weights(path: Path, device: str | torch.device) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint at `path`: model.safetensors, or the shards its
    model.safetensors.index.json names."""
    index = path / INDEX
    if not (path / WEIGHTS).exists() and index.exists():
        try:
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, AttributeError) as e:
            raise SpecdecError(f"{index} is not a valid safetensors index ({e}); re-download or re-save it") from None
    else:
        files = [WEIGHTS]
    state = {}
    for name in files:
        try:
            state.update(load_file(path / name, device=str(device)))
        except FileNotFoundError:
            what = f"the shard {name} named by {INDEX}" if name != WEIGHTS else WEIGHTS
            raise SpecdecError(f"{path} has no {what} (only safetensors weights are loaded, never pickle)") from None
        except (SafetensorError, OSError) as e:
            raise SpecdecError(f"{path / name} is corrupt or truncated ({e}); re-download, re-save or retrain it") from None
    return state


def load_model(path: str | Path, dtype: torch.dtype | None = None, device: str | torch.device = "cpu",
               quantize: str | None = None) -> LlamaForCausalLM:
    """Load a checkpoint folder onto `device` to compute in `dtype` (default float32). A bf16
    checkpoint computed in fp32 on the CPU keeps its matrices in bf16 where the CPU kernels run
    (exact: bf16 -> fp32 loses nothing); elsewhere they are converted to fp32. quantize: store every
    matrix in that format instead (quantize_model)."""
    path = Path(path)
    return build_model(read_arch(path), read_weights(path, device), dtype, device, quantize, path)


def build_model(cfg: Arch, state: dict[str, torch.Tensor], dtype: torch.dtype | None = None,
                device: str | torch.device = "cpu", quantize: str | None = None,
                path: str | Path = "the checkpoint") -> LlamaForCausalLM:
    """The model of architecture `cfg` holding the tensors `state` (transformers' names), as
    `load_model` makes it; `path` names where they come from in errors."""
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    expected = {k: tuple(v.shape) for k, v in model.hf_state_dict().items()}
    got = {k: tuple(v.shape) for k, v in state.items()}
    if cfg.tie_word_embeddings:
        got.pop("lm_head.weight", None)  # a tied checkpoint may store the head it shares
    if expected != got:
        missing = sorted(set(expected) - set(got))[:3]
        extra = sorted(set(got) - set(expected))[:3]
        wrong = [f"{k}: config says {expected[k]}, weights have {got[k]}"
                 for k in expected if k in got and expected[k] != got[k]][:3]
        raise SpecdecError(f"{path}: {CONFIG} does not match its weights (missing {missing}, unexpected "
                           f"{extra}, wrong shapes {wrong}); the config and weights come from different models")
    dtype = dtype or torch.float32
    model.load_hf_state_dict({k: state[k].to(dtype) for k in expected}, assign=True)
    place(model, device)
    if quantize is not None:
        return quantize_model(model.eval(), quantize)
    keep_bf16_matrices(model, DTYPES.get(cfg.source.get("dtype") or cfg.source.get("torch_dtype"), torch.float32))
    return model.eval()


def quantize_model(model: torch.nn.Module, format: str, given: dict[str, kernels.Matrix] | None = None
                   ) -> torch.nn.Module:
    """A model (or head) loaded for fp32 on the CPU with every matrix quantized to `format` (one of
    kernels.FORMATS' quantized ones, llama.cpp's rounding; model.store_matrices), but those `given`
    by name: a 135M model takes about a second, so nothing is cached. Refused elsewhere, and for a
    matrix whose rows do not cut into blocks of 32 (named)."""
    if format not in kernels.FORMATS[1:]:
        raise SpecdecError(f"unknown quantized format {format!r}: use one of {', '.join(kernels.FORMATS[1:])}")
    if placement(model).dtype != torch.float32 or any(p.device.type != "cpu" for p in model.parameters()):
        raise SpecdecError(f"quantized weights ({format}) run on the CPU in float32: drop --dtype/--device, or "
                           "--quantize")
    return store_matrices(model, format, given)


def quantized_copy(model: LlamaForCausalLM, format: str, head_format: str | None = None,
                   fine_head: bool = False) -> LlamaForCausalLM:
    """Another model of `model`'s architecture holding its weights with every matrix quantized to
    `format` (quantize_model), its unembedding to `head_format` (default: `format`; with `fine_head`
    a quantized head_format multiplies fine activations, kernels.Matrix.fine): a draft that needs no
    training. `model` itself is left as it is."""
    if not isinstance(model, LlamaForCausalLM):
        raise SpecdecError("a quantized copy of the target needs specdec's own model (a checkpoint specdec loads), "
                           f"not {type(model).__name__}")
    with torch.device("meta"):
        twin = LlamaForCausalLM(model.config)
    embedding = model.model.embed_tokens.stored  # an embedding held as blocks is shared, not copied
    if embedding is not None:
        twin.model.embed_tokens.weight = None
    state = {name: value.detach() for name, value in model.state_dict().items()}
    state.update({f"{name}.weight": model.get_submodule(name).dense() for name in model.held_as_blocks()
                  if name != "model.embed_tokens"})  # matrices held as blocks: their values, quantized again
    twin.load_state_dict(state, assign=True)
    place(twin, next(model.parameters()).device)
    head = {} if head_format is None else {
        "lm_head": kernels.Matrix.store(twin.lm_head.weight, head_format, fine_head and head_format != "bf16")}
    twin = quantize_model(twin.eval(), format, head)
    if embedding is not None and not model.config.tie_word_embeddings:  # tied: the new unembedding's blocks
        twin.model.embed_tokens.store(embedding)
    return twin


def keep_bf16_matrices(module: torch.nn.Module, stored: torch.dtype | None) -> None:
    """A model or head computing in fp32 from weights stored in bf16 keeps its matrices in bf16
    where the CPU kernels run (exact: bf16 -> fp32 loses nothing); elsewhere they stay fp32."""
    if (stored == torch.bfloat16 and placement(module).dtype == torch.float32
            and all(p.device.type == "cpu" for p in module.parameters()) and kernels.can_store_bf16()):
        store_matrices(module)


TOKEN_COUNTS = "token_counts.safetensors"


def save_token_counts(path: str | Path, counts: torch.Tensor) -> None:
    """How often each token id occurred in a model's training tokens (V,), saved beside it: a draft
    vocabulary (the N most frequent ids) is chosen from them."""
    save_file({"token_counts": counts.to(torch.int64).contiguous()}, Path(path) / TOKEN_COUNTS)


def load_token_counts(path: str | Path) -> torch.Tensor | None:
    """The counts saved by save_token_counts, or None for a model saved without them."""
    f = Path(path) / TOKEN_COUNTS
    return load_file(f)["token_counts"] if f.exists() else None


def read_meta(path: str | Path) -> dict:
    f = Path(path) / META
    return json.loads(f.read_text()) if f.exists() else {}
