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

Their folder is a head folder (folder.py) whose heads.json records the kind and the depth;
`load_mtp` refuses it for any other target.

This module knows nothing about losses, optimisers, drafting or verification.
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from ..errors import SpecdecError
from ..lm.arch import Arch
from ..lm.device import placement
from ..lm.kv_cache import KVCache
from ..lm.model import DecoderLayer, Linear, RMSNorm
from ..lm.window import Window
from .folder import HeadFolder, load_head, read_head_meta, write_head_folder


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


MTP_KINDS = {cls.kind: cls for cls in (ParallelHeads, SequentialHeads)}


def build_mtp(kind: str, config: Arch, depth: int) -> MTPHeads:
    if kind not in MTP_KINDS:
        raise SpecdecError(f"unknown MTP head kind {kind!r}; known: {', '.join(MTP_KINDS)}")
    return MTP_KINDS[kind](config, depth)


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


# --- checkpoint (folder.py) ------------------------------------------------------------

def save_mtp(heads: MTPHeads, path: str | Path, target_sha256: str, meta: dict | None = None,
             dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write the heads folder atomically. target_sha256: sha256 of the target's model.safetensors."""
    return write_head_folder(heads, path, heads.kind, target_sha256, meta, dtype, depth=heads.depth)


def read_mtp_meta(path: str | Path) -> dict:
    return read_head_meta(
        path, MTP_KINDS, "not MTP heads: pass it as a target or draft model",
        "is not an MTP heads folder", "train heads with `specdec train --objective mtp-sequential --frozen-trunk "
        "TARGET`", "the heads folder is corrupt",
        f"not MTP heads ({', '.join(MTP_KINDS)}); load it with the proposer made for that kind")


def build_from_meta(meta: dict, state: dict) -> MTPHeads:
    return build_mtp(meta["kind"], Arch.from_dict(meta["target_config"]), meta["depth"])


MTP_FOLDER = HeadFolder(read_mtp_meta, "the MTP heads in {path} belong",
                        "train heads for this target, or pass the target they were trained for", "retrain the heads",
                        build_from_meta)


def load_mtp(path: str | Path, target: str | Path, dtype: torch.dtype | None = None,
             device: str | torch.device = "cpu") -> MTPHeads:
    """MTP heads loaded for the target folder (load_head)."""
    return load_head(MTP_FOLDER, path, target, dtype, device)


def check_mtp_fits(heads: MTPHeads, trunk) -> None:
    """Heads fit a trunk only with the config they were built for (the same width, vocabulary,
    attention shape); the checkpoint hash is checked by load_mtp."""
    diff = heads.config.network_differences(trunk.config)
    if diff:
        raise SpecdecError(f"these MTP heads were built for another model (config differs: {diff})")
    dtype = placement(trunk).dtype
    if placement(heads).dtype != dtype:
        raise SpecdecError(f"the MTP heads compute in {placement(heads).dtype} but the target in {dtype}: "
                           "load both in one dtype (load_mtp(..., dtype=...))")
