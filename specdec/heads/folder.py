"""A head folder: the checkpoint format shared by the trainable draft heads (MTP heads, mtp.py; an
EAGLE head, eagle.py; a block head, block.py), and how a fresh head begins from its target.

A head folder holds heads.safetensors (the head's tensors, its training token counts beside them)
and heads.json (its kind, the target's config and the sha256 of the target's model.safetensors, its
own settings, training settings). It has no config.json, so it can never be loaded as a model, and
reading it for another target, or as another kind, stops with the reason. Each kind describes itself
once (`HeadFolder`); `check_head_target` and `load_head` read any of them.

This module knows nothing about any one kind of head, losses, drafting or verification.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from ..errors import SpecdecError
from ..lm.atomic import atomic_dir
from ..lm.checkpoint import CONFIG, DTYPES, WEIGHTS, keep_bf16_matrices
from ..lm.gguf import is_gguf, target_config, weights_sha256
from ..lm.model import place

HEADS_WEIGHTS, HEADS_META = "heads.safetensors", "heads.json"
TOKEN_COUNTS = "token_counts"  # (V,) int64 in heads.safetensors, next to the weights


@dataclass(frozen=True)
class HeadFolder:
    """What tells one kind of head folder (MTP heads, an EAGLE head, a block head) from another;
    reading any of them is `check_head_target` and `load_head`."""
    read_meta: Callable[[str | Path], dict]        # its metadata, refused unless the folder is of this kind
    belongs: str                                   # the subject of the other-target error, formatted with path
    train: str                                     # what to do about a head of another target
    retrain: str                                   # what to do about a corrupt weights file
    build: Callable[[dict, dict], nn.Module]       # (metadata, tensors) -> the module its weights load into
    check: Callable[[dict, str | Path], None] | None = None  # (metadata, target folder): what else must fit


def check_head_target(kind: HeadFolder, path: str | Path, target: str | Path) -> dict:
    """The metadata of the head folder `path`, refused unless it is of this kind and was trained for
    the target `target`, a checkpoint folder or a .gguf file (the sha256 of its model.safetensors, a
    .gguf's conversion's: gguf.weights_sha256); no weight is read."""
    meta = kind.read_meta(path)
    if kind.check is not None:
        kind.check(meta, target)
    check_trained_for(Path(path), target, meta, kind.belongs, kind.train)
    return meta


def load_head(kind: HeadFolder, path: str | Path, target: str | Path, dtype: torch.dtype | None = None,
              device: str | torch.device = "cpu") -> nn.Module:
    """Load the head in `path` for the target checkpoint folder `target` (check_head_target first)."""
    path = Path(path)
    meta = check_head_target(kind, path, target)
    state = read_head_state(path, kind.retrain)
    return loaded_head(kind.build(meta, state), state, path, meta, dtype, device)


def started_from(head: nn.Module, target) -> nn.Module:
    """A fresh head (fp32) begun from its target: its matrices at random (normal, std 0.02; the caller
    seeds), its unembedding the target's lm_head rows of its draft vocabulary, its output norm the
    target's."""
    for p in head.parameters():
        if p.dim() == 2:
            nn.init.normal_(p, std=0.02)
    with torch.no_grad():
        head.lm_head.weight.copy_(target.lm_head.dense_rows(head.draft_ids).float())
        head.norm.weight.copy_(target.model.norm.weight.float())
    return head


def write_head_folder(head: nn.Module, path: str | Path, kind: str, target_sha256: str, meta: dict | None,
                      dtype: torch.dtype, **fields) -> Path:
    """Write a head folder atomically: its floating tensors in `dtype` (others as they are), its
    training token counts (if any) as int64, and as HEADS_META the caller's `meta`, the head's `kind`
    and target (its hash and config), its own `fields`, the dtype and its parameter count."""
    path = Path(path)
    info = {**(meta or {}), "kind": kind, "target_sha256": target_sha256, "target_config": head.config.to_dict(),
            **fields, "dtype": str(dtype).removeprefix("torch."),
            "parameters": sum(p.numel() for p in head.parameters())}
    state = {k: v.detach().to(dtype if v.is_floating_point() else v.dtype).contiguous()
             for k, v in head.state_dict().items()}
    if head.token_counts is not None:
        state[TOKEN_COUNTS] = head.token_counts.to(torch.int64).contiguous()
        info[TOKEN_COUNTS] = (f"in {HEADS_WEIGHTS}: occurrences of each token id in the "
                              f"{int(head.token_counts.sum())} training tokens")
    with atomic_dir(path) as tmp:
        save_file(state, tmp / HEADS_WEIGHTS, metadata={"format": "pt", "kind": info["kind"]})
        (tmp / HEADS_META).write_text(json.dumps(info, indent=2) + "\n")
    return path


def read_head_meta(path: str | Path, kinds, not_heads: str, not_folder: str, train: str, corrupt: str,
                   other_kind: str) -> dict:
    """HEADS_META of a head folder whose kind is one of `kinds`, or a SpecdecError built from the
    caller's words: a model checkpoint passed instead (`not_heads`), no head folder (`not_folder`,
    `train`), unreadable JSON (`corrupt`), a head of another kind (`other_kind`)."""
    path = Path(path)
    meta_file = path / HEADS_META
    if not meta_file.exists():
        if (path / CONFIG).exists():
            raise SpecdecError(f"{path} is a model checkpoint ({CONFIG}, {WEIGHTS}), {not_heads}")
        raise SpecdecError(f"{path} {not_folder} (no {HEADS_META}); {train}")
    try:
        meta = json.loads(meta_file.read_text())
    except json.JSONDecodeError as e:
        raise SpecdecError(f"{meta_file} is not valid JSON ({e}); {corrupt}") from None
    if meta.get("kind") not in kinds:
        raise SpecdecError(f"{path} holds heads of kind {meta.get('kind')!r}, {other_kind}")
    return meta


def read_single_head_meta(path: str | Path, kind: str, name: str, objective: str, others: str) -> dict:
    """HEADS_META of a one-head folder of `kind` (`name` with its article: "an EAGLE head"), refused as
    `read_head_meta` refuses, in words made of its name, its training objective and how the other
    kinds are loaded (`others`)."""
    return read_head_meta(
        path, (kind,), f"not {name}: pass it as a target or draft model, and {name} folder with --heads",
        f"is not {name} folder", f"train one with `specdec train --objective {objective} --target TARGET` (or "
        f"--preset target-{objective})", "the head folder is corrupt",
        f"not {name} ({kind}); load it with the proposer made for that kind ({others})")


def check_trained_for(path: Path, target: str | Path, meta: dict, belongs: str, train: str) -> None:
    """Refuse the head folder `path` (its metadata `meta`) unless it was trained for the checkpoint
    folder or .gguf file `target` (the sha256 of its model.safetensors, gguf.weights_sha256); `belongs`
    (formatted with path) and `train` word the error."""
    target = Path(target)
    if is_gguf(target):  # a .gguf's hash is its conversion's (seconds to make): refuse another shape first
        shape, config = meta.get("target_config") or {}, target_config(target)
        for key in ("hidden_size", "num_hidden_layers", "vocab_size"):
            if key in shape and shape[key] != config.get(key):
                raise SpecdecError(f"{belongs.format(path=path)} to a target of {key} {shape[key]}, but {target} "
                                   f"has {config.get(key)}: {train}")
    actual = weights_sha256(target)
    if actual != meta["target_sha256"]:
        raise SpecdecError(f"{belongs.format(path=path)} to the target with model.safetensors sha256 "
                           f"{meta['target_sha256'][:16]}..., but {target} has {actual[:16]}...: {train}")


def read_head_state(path: Path, retrain: str) -> dict[str, torch.Tensor]:
    """The tensors of the head folder `path` (its token counts included); `retrain` words the error
    of a corrupt file."""
    try:
        return load_file(path / HEADS_WEIGHTS)
    except FileNotFoundError:
        raise SpecdecError(f"{path} has no {HEADS_WEIGHTS}") from None
    except (SafetensorError, OSError) as e:
        raise SpecdecError(f"{path / HEADS_WEIGHTS} is corrupt or truncated ({e}); {retrain}") from None


def loaded_head(head: nn.Module, state: dict[str, torch.Tensor], path: Path, meta: dict,
                dtype: torch.dtype | None, device: str | torch.device = "cpu"):
    """`head` with `state` (read_head_state) loaded onto `device`, in `dtype` (default fp32) with its
    matrices kept in bf16 where the folder stored them so and the CPU kernels run, ready for inference."""
    head.token_counts = state.pop(TOKEN_COUNTS, None)
    try:
        head.load_state_dict(state, strict=True)
    except RuntimeError as e:
        raise SpecdecError(f"{path / HEADS_WEIGHTS} does not match {HEADS_META} ({str(e)[:300]})") from None
    place(head.to(dtype or torch.float32), device)
    keep_bf16_matrices(head, DTYPES.get(meta.get("dtype")))
    return head.eval()
