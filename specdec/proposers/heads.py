"""Multi-token prediction (MTP) heads: one definition, used by training (train/losses.py) and by
drafting (proposers/mtp.py), and their checkpoint folder.

Head j (j = 1..depth) reads some input u^j_t at every position t and predicts the token x_{t+1+j};
the trunk's own output predicts x_{t+1} ("head 0"). Both published designs are here:

- "mtp-parallel" (Gloeckle et al. 2024): u^j_t = the trunk's final hidden state h_t. Each head is
  one transformer layer; the unembedding (the trunk's final norm and lm_head) is shared. The
  heads are independent of each other, so one pass over h drafts all of them.
- "mtp-sequential" (DeepSeek-V3): u^j_t = W [RMSNorm(h^{j-1}_t); RMSNorm(Emb(x_{t+j}))], with
  h^0 = the trunk's final hidden state and h^j the output of module j (one transformer layer,
  then its own RMSNorm before the shared lm_head). The embedding is the trunk's. The chain is
  causal: module j at position t reads the tokens up to x_{t+j}, so when drafting, module j at
  the last position needs the drafts of modules 1..j-1 (`reads_ahead`).

Attention inside a head is causal over the positions of its own input, exactly as in the trunk,
so a head drafting with a KV cache computes what it computed in training.

A heads folder holds heads.safetensors and heads.json (kind, depth, the target's config, the
sha256 of the target's model.safetensors, training settings). It has no config.json, so it can
never be loaded as a model, and `load_heads` refuses it for any other target.

This module knows nothing about losses, optimisers, drafting or verification.
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
from ..lm.arch import Arch
from ..lm.atomic import atomic_dir
from ..lm.checkpoint import CONFIG, DTYPES, WEIGHTS, keep_bf16_matrices
from ..lm.gguf import is_gguf, target_config, weights_sha256
from ..lm.device import placement
from ..lm.kv_cache import KVCache
from ..lm.model import DecoderLayer, Linear, RMSNorm, Window, place

HEADS_WEIGHTS, HEADS_META = "heads.safetensors", "heads.json"
TOKEN_COUNTS = "token_counts"  # (V,) int64 in heads.safetensors, next to the weights


class MTPHeads(nn.Module):
    """`depth` heads for a trunk with config `config`; subclasses define the head's input."""
    kind: str
    reads_ahead: bool  # does head j (0-based) at t read x_{t+j+1}, the token before its target? (drafts, when drafting)
    chained: bool      # does head j+1 read head j's output?

    def __init__(self, config: Arch, depth: int):
        super().__init__()
        if depth < 1:
            raise SpecdecError(f"MTP needs at least one head (depth >= 1), got {depth}")
        self.config, self.depth = config, depth
        # how often each token id occurred in the heads' training tokens (None: not recorded);
        # a proposer may draft over the most frequent ones only (proposers/mtp.py, draft_vocab)
        self.token_counts: torch.Tensor | None = None
        self.blocks = nn.ModuleList(DecoderLayer(config) for _ in range(depth))
        # derived from the config, not a weight (as in the trunk)
        self.inv_freq = config.inv_freq()

    def context(self, positions: torch.Tensor | None, dtype: torch.dtype, cache: KVCache | None = None,
                width: int | None = None) -> Window:
        """The window of one call, shared by all heads: positions (B, T), or None for each row's
        cache length + 0..width-1. With a cache (layer j: head j), the T new entries go after each
        row's length (the caller advances the cache once all heads have written); without,
        attention is causal over the input (training)."""
        window = Window(positions, self.inv_freq, dtype, cache, width=width, rotary_factor=self.config.attention_factor)
        if cache is not None:
            cache.reserve(window.width)
        return window

    def forward_head(self, j: int, trunk, prev: torch.Tensor, ahead: torch.Tensor, window: Window) -> torch.Tensor:
        """Output of head j (0-based here) over T positions (B, T, C). prev (B, T, C): the head's
        hidden input (the trunk's hidden state, or the previous module's output); ahead (B, T):
        the token x_{t+j+1} at each position t (read only when `reads_ahead`)."""
        x = self.head_input(j, trunk, prev, ahead)
        return self.blocks[j](x, j, window)

    def head_input(self, j: int, trunk, prev: torch.Tensor, ahead: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def logits(self, j: int, trunk, out: torch.Tensor) -> torch.Tensor:
        """(B, T, C) head output -> (B, T, V) logits through the shared lm_head."""
        return trunk.lm_head(self.normed(j, trunk, out))

    def normed(self, j: int, trunk, out: torch.Tensor) -> torch.Tensor:
        """(B, T, C) head output -> (B, T, C) the normalised state the lm_head reads."""
        raise NotImplementedError

    def next_prev(self, trunk_hidden: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The hidden input of head j+1, given the trunk's hidden state and head j's output."""
        raise NotImplementedError


class ParallelHeads(MTPHeads):
    """Gloeckle et al. 2024: independent one-layer heads on the trunk's final hidden state."""
    kind = "mtp-parallel"
    reads_ahead = chained = False

    def head_input(self, j, trunk, prev, ahead):
        return prev

    def normed(self, j, trunk, out):
        return trunk.model.norm(out)

    def next_prev(self, trunk_hidden, out):
        return trunk_hidden


class SequentialHeads(MTPHeads):
    """DeepSeek-V3: module j combines the previous depth's hidden state and the embedding of the
    token j+1 ahead through a 2C -> C projection, then one transformer layer."""
    kind = "mtp-sequential"
    reads_ahead = chained = True

    def __init__(self, config: Arch, depth: int):
        super().__init__(config, depth)
        C, eps = config.hidden_size, config.rms_norm_eps
        self.hidden_norms = nn.ModuleList(RMSNorm(C, eps) for _ in range(depth))
        self.embed_norms = nn.ModuleList(RMSNorm(C, eps) for _ in range(depth))
        self.projections = nn.ModuleList(Linear(2 * C, C, bias=False) for _ in range(depth))
        self.output_norms = nn.ModuleList(RMSNorm(C, eps) for _ in range(depth))

    def head_input(self, j, trunk, prev, ahead):
        embedded = trunk.model.embed(ahead)  # (B, T, C)
        return self.projections[j](torch.cat([self.hidden_norms[j](prev), self.embed_norms[j](embedded)], -1))

    def normed(self, j, trunk, out):
        return self.output_norms[j](out)

    def next_prev(self, trunk_hidden, out):
        return out


HEAD_KINDS = {cls.kind: cls for cls in (ParallelHeads, SequentialHeads)}


def build_heads(kind: str, config: Arch, depth: int) -> MTPHeads:
    if kind not in HEAD_KINDS:
        raise SpecdecError(f"unknown MTP head kind {kind!r}; known: {', '.join(HEAD_KINDS)}")
    return HEAD_KINDS[kind](config, depth)


def teacher_forced(heads: MTPHeads, trunk, hidden: torch.Tensor, tokens: torch.Tensor, detach: bool = False):
    """Training forward of every head over a window: hidden (B, S, C) is the trunk's final hidden
    state over tokens[:, :S] of tokens (B, S+1). Yields (j, out, leaf, targets) per head, 0-based
    j: out (B, T, C) with T = S-1-j, and targets (B, T) = tokens[:, j+2:], the tokens it predicts.
    Each head sees one position fewer than the one before: what it predicts must be in the window.

    leaf is what the logits and the next head read: `out` itself, or with detach=True a detached
    copy that collects their gradient, so a head's loss can be backpropagated in turn (the
    memory-saving order in train/losses.py); `hidden` is then expected to be such a leaf too."""
    S = hidden.shape[1]
    if S - heads.depth <= 0:
        raise SpecdecError(f"a window of {S + 1} tokens is too short for {heads.depth} MTP heads: "
                           "raise seq_len or lower the depth")
    positions = torch.arange(S, device=hidden.device)[None].expand(hidden.shape[0], S)
    window = heads.context(positions, hidden.dtype)
    prev = hidden
    for j in range(heads.depth):
        T = S - 1 - j
        out = heads.forward_head(j, trunk, prev[:, :T], tokens[:, j + 1:j + 1 + T], window.first(T))
        leaf = out.detach().requires_grad_() if detach else out
        yield j, out, leaf, tokens[:, j + 2:]
        prev = heads.next_prev(hidden, leaf)


# --- checkpoint ---------------------------------------------------------------------------

def save_heads(heads: MTPHeads, path: str | Path, target_sha256: str, meta: dict | None = None,
               dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write the heads folder atomically. target_sha256: sha256 of the target's model.safetensors."""
    return write_head_folder(heads, path, heads.kind, target_sha256, meta, dtype, depth=heads.depth)


def read_heads_meta(path: str | Path) -> dict:
    return read_head_meta(
        path, HEAD_KINDS, "not MTP heads: pass it as a target or draft model",
        "is not an MTP heads folder", "train heads with `specdec train --objective mtp-sequential --frozen-trunk "
        "TARGET`", "the heads folder is corrupt",
        f"not MTP heads ({', '.join(HEAD_KINDS)}); load it with the proposer made for that kind")


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


def build_from_meta(meta: dict, state: dict) -> MTPHeads:
    return build_heads(meta["kind"], Arch.from_dict(meta["target_config"]), meta["depth"])


MTP_FOLDER = HeadFolder(read_heads_meta, "the MTP heads in {path} belong",
                        "train heads for this target, or pass the target they were trained for", "retrain the heads",
                        build_from_meta)


def check_heads_target(path: str | Path, target: str | Path) -> dict:
    """MTP heads' metadata, checked against the target folder (check_head_target)."""
    return check_head_target(MTP_FOLDER, path, target)


def load_heads(path: str | Path, target: str | Path, dtype: torch.dtype | None = None,
               device: str | torch.device = "cpu") -> MTPHeads:
    """MTP heads loaded for the target folder (load_head)."""
    return load_head(MTP_FOLDER, path, target, dtype, device)


# --- the folder of a drafter trained on a target: MTP heads here, an EAGLE head (eagle.py) ---

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


def check_heads_fit(heads: MTPHeads, trunk) -> None:
    """Heads fit a trunk only with the config they were built for (the same width, vocabulary,
    attention shape); the checkpoint hash is checked by load_heads."""
    if heads.config != trunk.config:
        diff = {k: (v, getattr(trunk.config, k)) for k, v in heads.config.to_dict().items()
                if getattr(trunk.config, k) != v}
        raise SpecdecError(f"these MTP heads were built for another model (config differs: {diff})")
    dtype = placement(trunk).dtype
    if placement(heads).dtype != dtype:
        raise SpecdecError(f"the MTP heads compute in {placement(heads).dtype} but the target in {dtype}: "
                           "load both in one dtype (load_heads(..., dtype=...))")
