"""The block head: a DFlash / P-EAGLE style drafter that drafts a whole block of k tokens in ONE
forward from the target's features. One definition, used by training (train/losses.py, block
section) and by drafting (proposers/block.py), and its checkpoint folder.

Context. As in the EAGLE head (eagle.py), f_t are the outputs of the target's decoder layers
`layer_ids` at position t, concatenated, and x_0..x_T the sequence. Context position t enters the
head's own KV cache as

    u_t = proj([RMSNorm(Emb(x_{t+1})); RMSNorm(fc(f_t))])

at rotary position t; its output predicts x_{t+2}. The embedding is the target's (shared, frozen).

Block. After the context x_0..x_T (features up to T-1), k-1 mask queries, each the learned vector
`mask`, sit at positions T..T+k-2. They attend to the context and to each other: all of the block
(`causal` False, bidirectional) or only the masks before them (`causal` True). One forward over
[context positions not yet in the cache, mask x (k-1)] gives all k drafts: block slot 0 is the
output at the last context position (predicting x_{T+1}), slot j the output at mask j (predicting
x_{T+1+j}), each without seeing the drafts before it. The mask entries are then dropped from the
cache. A bidirectional head always runs its k_trained - 1 masks (what it was trained with) and
uses the first ones; a causal head runs just the masks it needs (the others cannot change them).

The layers are standard decoder layers of the target's shape (`model.DecoderLayer`, one or more),
so that they run as one call of the CPU kernels (one Stack) over the whole block. Their outputs go
through the head's own RMSNorm and an unembedding over a draft vocabulary (the N target ids most
frequent in the training tokens, `draft_ids`).

Training (train/anchors.py) lays a window of context positions and a block of mask slots per random
anchor into one forward with exactly the attention drafting uses (`training_outputs`), so what the
head computes while drafting is what it was trained on.

Its head folder (folder.py) holds heads.safetensors and heads.json (kind "block", the target's config and the
sha256 of its model.safetensors, the layer ids, the block size it was trained for, its attention,
the draft vocabulary size, training settings); `load_block` refuses it for any other target, and a
target without the layers it reads.

This module knows nothing about losses, optimisers, verification or the proposer's bookkeeping.
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from ..errors import SpecdecError
from ..lm.arch import Arch
from ..lm.gguf import target_config
from ..lm.model import DecoderLayer, Linear, RMSNorm, StackedLayers
from ..lm.window import Window
from .eagle import check_head_fits as check_eagle_head_fits
from .eagle import check_draft_ids, check_layer_ids
from .folder import HeadFolder, check_head_target, load_head, read_single_head_meta, started_from, write_head_folder

KIND = "block"


class BlockHead(StackedLayers, nn.Module):
    """Its `stack` (StackedLayers) runs all its layers as one kernel call, used with a cache."""
    kind = KIND

    def __init__(self, config: Arch, layer_ids, draft_ids: torch.Tensor, block: int,
                 num_layers: int = 1, causal: bool = False):
        """config: the target's; layer_ids: which of its decoder layers' outputs the head reads;
        draft_ids (N,): the sorted target ids of the draft vocabulary; block: the most drafts per
        forward it is trained for (k); causal: attention among the masks (module docstring)."""
        super().__init__()
        V, C = config.vocab_size, config.hidden_size
        if block < 1 or num_layers < 1:
            raise SpecdecError(f"a block head drafts blocks of k >= 1 tokens with >= 1 layers, got k={block} "
                               f"and {num_layers} layers")
        check_draft_ids(draft_ids, V)
        self.config, self.layer_ids = config, check_layer_ids(layer_ids, config.num_hidden_layers)
        self.block, self.causal = int(block), bool(causal)
        self.fc = Linear(len(self.layer_ids) * C, C, bias=False)
        self.embed_norm = RMSNorm(C, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(C, config.rms_norm_eps)
        self.proj = Linear(2 * C, C, bias=False)
        self.mask = nn.Parameter(torch.zeros(C))  # the input of every mask query
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(num_layers))
        self.norm = RMSNorm(C, config.rms_norm_eps)
        self.lm_head = Linear(C, draft_ids.numel(), bias=False)
        self.register_buffer("draft_ids", draft_ids.to(torch.long).clone())  # (N,) draft id -> target id
        # how often each token id occurred in the training tokens (None: not recorded)
        self.token_counts: torch.Tensor | None = None
        # derived from the config, not a weight (as in the target)
        self.inv_freq = config.inv_freq()  # the target's rotary embedding, scaled where its config scales it

    @property
    def draft_vocab_size(self) -> int:
        return self.draft_ids.numel()

    @property
    def attention(self) -> str:
        return "causal" if self.causal else "bidirectional"

    def masks_for(self, drafts: int) -> int:
        """Mask queries one forward runs to draft `drafts` tokens (module docstring)."""
        return max(drafts - 1, 0) if self.causal else self.block - 1

    def encode(self, embedded: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """(B, T, C) embedding of the next token and (B, T, nC) target features -> (B, T, C) u."""
        return self.proj(torch.cat([self.embed_norm(embedded), self.hidden_norm(self.fc(features))], -1))

    def mask_inputs(self, batch: int, count: int) -> torch.Tensor:
        """(batch, count, C) the mask queries' input."""
        return self.mask.to(self.norm.weight.dtype).expand(batch, count, -1)

    def stacked(self) -> list[DecoderLayer]:
        return list(self.layers)

    def forward(self, x: torch.Tensor, window: Window) -> torch.Tensor:
        """The layers over a window of inputs (B, T, C) -> (B, T, C) h; with the head's KV cache and
        the kernels, one call."""
        stacked = self.stacked_forward(x, window)
        if stacked is not None:
            return stacked[0]
        for i, layer in enumerate(self.layers):
            x = layer(x, i, window)
        return x

    def logits(self, h: torch.Tensor, unembedding: nn.Module | None = None) -> torch.Tensor:
        """(..., C) head output -> (..., N) logits over the draft vocabulary (or over the rows of it
        that `unembedding` holds)."""
        return (self.lm_head if unembedding is None else unembedding)(self.norm(h))

    def window(self, positions: torch.Tensor, visible: torch.Tensor | None, cache=None) -> Window:
        """positions (B, T), visible (B, T, T) among the new inputs (None: causal); the caller
        advances or rolls back the cache."""
        window = Window(positions, self.inv_freq, self.norm.weight.dtype, cache, visible,
                        rotary_factor=self.config.attention_factor)
        if cache is not None:
            cache.reserve(window.width)
        return window

    def training_outputs(self, features: torch.Tensor, ahead: torch.Tensor, embedding: nn.Embedding,
                         positions: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """One training forward (train/anchors.py's layout): features (B, S, nC) f_0..f_{S-1},
        ahead (B, S) x_1..x_S, then the layout's L - S mask slots; positions (L,), visible (L, L)
        -> (B, L, C) outputs."""
        B, S, _ = features.shape
        L = positions.shape[0]
        x = torch.cat([self.encode(embedding(ahead), features), self.mask_inputs(B, L - S)], 1)  # (B, L, C)
        return self(x, self.window(positions[None].expand(B, L), visible[None].expand(B, L, L)))


def initial_head(target, layer_ids, draft_ids: torch.Tensor, block: int, num_layers: int = 1,
                 causal: bool = False) -> BlockHead:
    """A fresh head for `target` (fp32): the unembedding starts as the target's lm_head rows of the
    draft vocabulary and the output norm as the target's, the rest at random (the caller seeds)."""
    head = started_from(BlockHead(target.config, layer_ids, draft_ids, block, num_layers, causal), target)
    with torch.no_grad():
        nn.init.normal_(head.mask, std=0.02)
    return head


# --- checkpoint ---------------------------------------------------------------------------

def save_block(head: BlockHead, path: str | Path, target_sha256: str, meta: dict | None = None,
               dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write the head folder atomically; matrices and norms in `dtype`, the draft ids as int64."""
    return write_head_folder(head, path, KIND, target_sha256, meta, dtype, layer_ids=list(head.layer_ids),
                             block=head.block, attention=head.attention, num_layers=len(head.layers),
                             draft_vocab_size=head.draft_vocab_size)


def read_block_meta(path: str | Path) -> dict:
    return read_single_head_meta(path, KIND, "a block head", "block", "EAGLE: --draft eagle, MTP heads: --draft mtp")


def build_block(meta: dict, state: dict) -> BlockHead:
    return BlockHead(Arch.from_dict(meta["target_config"]), meta["layer_ids"], state["draft_ids"], meta["block"],
                     meta["num_layers"], meta["attention"] == "causal")


def target_has_layers(meta: dict, target: str | Path) -> None:
    """The target's model (a folder's, a .gguf file's) has every decoder layer the head reads."""
    check_layers(meta["layer_ids"], target_config(target).get("num_hidden_layers", 0), target)


BLOCK_FOLDER = HeadFolder(read_block_meta, "the block head in {path} belongs",
                          "train a head for this target (specdec train --objective block --target ...), or pass the "
                          "target it was trained for", "retrain the head", build_block, target_has_layers)


def check_block_target(path: str | Path, target: str | Path) -> dict:
    """A block head's metadata, checked against the target folder (heads.folder.check_head_target)."""
    return check_head_target(BLOCK_FOLDER, path, target)


def load_block(path: str | Path, target: str | Path, dtype: torch.dtype | None = None,
               device: str | torch.device = "cpu") -> BlockHead:
    """A block head loaded for the target folder (heads.folder.load_head)."""
    return load_head(BLOCK_FOLDER, path, target, dtype, device)


def check_layers(layer_ids, layers: int, target) -> None:
    """The target (`layers` decoder layers) has every layer the head reads."""
    if max(layer_ids) >= layers:
        raise SpecdecError(f"this block head reads the target's decoder layers {list(layer_ids)}, but the target "
                           f"{target} has {layers}: pass the target it was trained for")


def check_head_fits(head: BlockHead, target) -> None:
    """A head fits a target only with the config it was built for and the layers it reads; the
    checkpoint hash is checked by load_block."""
    check_layers(head.layer_ids, getattr(getattr(target, "config", None), "num_hidden_layers", 0),
                 type(target).__name__)
    check_eagle_head_fits(head, target, "block head", "load_block")
