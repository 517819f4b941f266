"""The EAGLE-3 draft head: one definition, used by training (train/losses.py, the training-time
test) and by drafting (proposers/eagle.py), and its checkpoint folder.

The head drafts from the target's own features (Li et al., EAGLE-3, 2025). Write f_t for the outputs
of the target's decoder layers `layer_ids` (low, middle, high) at position t, concatenated, and
x_0..x_T for the sequence. At position t the head reads

    u_t = proj([RMSNorm(Emb(x_{t+1})); RMSNorm(g_t)]),   g_t = fc(f_t)  (the fused target features)

runs one decoder layer (the target's shape, `model.DecoderLayer`) over u, and its output h_t, through
its own RMSNorm and an unembedding over a draft vocabulary (the N target ids most frequent in the
training tokens, `draft_ids`, N recorded), predicts x_{t+2}. The embedding is the target's (shared,
frozen). To draft further it feeds itself: the next position reads the token it just drafted and its
own output h in place of g, so it drafts any k, one decoder-layer step per token.

Attention. Drafting from position T-1 (the last one with target features), draft step j (0-based) at
position T-1+j attends to the head's entries for positions 0..T-1, computed from target features,
and to its own earlier draft steps T..T-1+j. Training reproduces exactly this ("training-time test",
`unroll`): step j at base position t reads the step-(j-1) output at t, sits at position t+j, and
attends to the step-0 entries at positions <= t and to the entries of steps 1..j at base t (the
diagonal), so that what the head computes while drafting k tokens is what it was trained on.

Weight layout (`layout`, fixed when the head is built and recorded in its folder):
- "specdec": a 2C -> C projection (`proj`) feeds a standard decoder layer, so that the layer runs as
  one call of the CPU kernels (model.py) like the target's own layers. These weights have no exact
  form in the layout serving engines read: the layer's input RMSNorm sits between `proj` and q/k/v,
  so `proj` does not fold into them, and the residual is u, not g (export.py).
- "eagle3": EAGLE-3's reference layer, as the `speculators` package and vLLM run it: the 2C-wide
  x = [RMSNorm(Emb(x_{t+1})); RMSNorm(g_t)] goes straight into a q/k/v projection of 2C inputs, the
  attention output is added to g_t (or to the head's own previous output), then the MLP as in any
  decoder layer (`Eagle3Layer`). Exported with `specdec export --format speculators`. It runs on
  PyTorch's operators (no fused kernel call), so a draft step costs more on the CPU.
The metadata uses the `speculators` EAGLE-3 vocabulary (`speculators_metadata`) in both.

Its head folder (folder.py) holds heads.safetensors and heads.json (kind "eagle3", the target's config and the
sha256 of its model.safetensors, the layer ids, the draft vocabulary size, training settings). It
has no config.json, so it can never be loaded as a model, and `load_eagle` refuses it for any other
target.

This module knows nothing about losses, optimisers, caches beyond one window, or verification.
"""
from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import nn

from ..errors import SpecdecError
from ..lm.arch import Arch
from ..lm.checkpoint import hf_config
from ..lm.device import placement
from ..lm.model import MLP, Attention, DecoderLayer, Linear, RMSNorm, StackedLayers, kernel_layer
from ..lm.window import Window, apply_rotary, rotary
from .folder import HeadFolder, check_head_target, load_head, read_single_head_meta, started_from, write_head_folder

KIND = "eagle3"
LAYOUTS = ("specdec", "eagle3")
SPECULATORS_VERSION = "0.9.0"  # the speculators release whose EAGLE-3 format the metadata and the export follow


class Eagle3Layer(StackedLayers, nn.Module):
    """EAGLE-3's decoder layer: attention over the 2C-wide [RMSNorm(embedding); RMSNorm(g)] whose
    output is added to g (not to its input), then the MLP with its own RMSNorm; the names are those of
    transformers' decoder layer, so the export renames nothing but the fused q/k/v and gate/up. Its
    `stack` (StackedLayers) runs it in the kernels' drafting call (LlamaForCausalLM.draft_block)."""

    def __init__(self, config: Arch):
        super().__init__()
        self.config = config
        self.self_attn = Attention(config)
        self.self_attn.qkv_proj = Linear(2 * config.hidden_size, self.self_attn.qkv_proj.out_features, bias=False)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def stacked(self) -> list["Eagle3Layer"]:
        return [self]

    def kernel_weights(self):
        """The layer as the kernels read it (its matrices stored): no input norm (model.kernel_layer)."""
        return kernel_layer(None, self.self_attn, self.post_attention_layernorm.scale, self.mlp)

    def forward(self, x: torch.Tensor, residual: torch.Tensor, window: Window) -> torch.Tensor:
        """x (B, T, 2C) the normalised [embedding; g]; residual (B, T, C) g -> (B, T, C) h."""
        h = residual + self.self_attn(x, 0, window)
        return h + self.mlp(self.post_attention_layernorm(h))


def default_layer_ids(num_layers: int) -> tuple[int, ...]:
    """Low, middle and high: the outputs of layers min(1, L/3), L/2 and L-1 (0-based; the last one
    is the output of the final layer, before the target's norm): 1, 3, 5 of 6 layers."""
    return tuple(sorted({min(1, num_layers // 3), num_layers // 2, num_layers - 1}))


def check_layer_ids(layer_ids, num_layers: int) -> tuple[int, ...]:
    layer_ids = tuple(int(i) for i in layer_ids)
    if not layer_ids or any(not 0 <= i < num_layers for i in layer_ids) or len(set(layer_ids)) != len(layer_ids):
        raise SpecdecError(f"EAGLE layer ids {list(layer_ids)} must be distinct decoder layers of the target, "
                           f"which has {num_layers} (ids 0..{num_layers - 1}): e.g. "
                           f"{' '.join(map(str, default_layer_ids(num_layers)))}")
    return layer_ids


def check_draft_ids(draft_ids: torch.Tensor, vocab_size: int) -> None:
    """A head's draft vocabulary (N,) lies in its target's, 0..vocab_size-1."""
    V = vocab_size
    if draft_ids.numel() > V:
        raise SpecdecError(f"a draft vocabulary of {draft_ids.numel()} tokens is larger than the target's "
                           f"{V}: choose --draft-vocab <= {V}")
    if draft_ids.numel() < 1 or int(draft_ids.min()) < 0 or int(draft_ids.max()) >= V:
        raise SpecdecError(f"draft vocabulary ids must lie in the target's vocabulary 0..{V - 1}")


class EagleHead(nn.Module):
    kind = KIND

    def __init__(self, config: Arch, layer_ids, draft_ids: torch.Tensor, layout: str = "specdec"):
        """config: the target's; layer_ids: which of its decoder layers' outputs the head reads;
        draft_ids (N,): the sorted target ids of the draft vocabulary; layout: LAYOUTS (module docstring)."""
        super().__init__()
        if layout not in LAYOUTS:
            raise SpecdecError(f"unknown EAGLE head layout {layout!r}: the layouts are {', '.join(LAYOUTS)}")
        self.layout = layout
        V, C = config.vocab_size, config.hidden_size
        check_draft_ids(draft_ids, V)
        self.config, self.layer_ids = config, check_layer_ids(layer_ids, config.num_hidden_layers)
        self.fc = Linear(len(self.layer_ids) * C, C, bias=False)
        self.embed_norm = RMSNorm(C, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(C, config.rms_norm_eps)
        if layout == "eagle3":
            self.layer = Eagle3Layer(config)
        else:
            self.proj = Linear(2 * C, C, bias=False)
            self.layer = DecoderLayer(config)
        self.norm = RMSNorm(C, config.rms_norm_eps)
        self.lm_head = Linear(C, draft_ids.numel(), bias=False)
        self.register_buffer("draft_ids", draft_ids.to(torch.long).clone())  # (N,) draft id -> target id
        # how often each token id occurred in the training tokens (None: not recorded); a proposer may
        # draft over the most frequent of draft_ids only (proposers/eagle.py, draft_vocab)
        self.token_counts: torch.Tensor | None = None
        # derived from the config, not a weight (as in the target)
        self.inv_freq = config.inv_freq()

    @property
    def draft_vocab_size(self) -> int:
        return self.draft_ids.numel()

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """(B, T, len(layer_ids) * C) target features -> (B, T, C) g."""
        return self.fc(features)

    def layer_input(self, embedded: torch.Tensor, prev: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, T, C) embedding of the next token and (B, T, C) g or the head's own output -> what q/k/v
        read and what the attention output is added to: (RMSNorm(u), u) with u = proj([..]) in the
        specdec layout, ([RMSNorm(Emb); RMSNorm(g)], g) in the eagle3 layout."""
        x = torch.cat([self.embed_norm(embedded), self.hidden_norm(prev)], -1)
        if self.layout == "eagle3":
            return x, prev
        u = self.proj(x)
        return self.layer.input_layernorm(u), u

    def forward(self, embedded: torch.Tensor, prev: torch.Tensor, window: Window) -> torch.Tensor:
        """One drafting call over a window of positions with the head's KV cache (layer 0): (B, T, C) h."""
        x = torch.cat([self.embed_norm(embedded), self.hidden_norm(prev)], -1)
        if self.layout == "eagle3":
            return self.layer(x, prev, window)
        return self.layer(self.proj(x), 0, window)  # one kernel call where the CPU kernels run

    def logits(self, h: torch.Tensor, unembedding: nn.Module | None = None) -> torch.Tensor:
        """(..., C) head output -> (..., N) logits over the draft vocabulary (or over the rows of it
        that `unembedding` holds: a smaller draft vocabulary at drafting time)."""
        return (self.lm_head if unembedding is None else unembedding)(self.norm(h))

    def window(self, positions: torch.Tensor | None, cache=None, width: int | None = None) -> Window:
        """The window of one drafting call: positions (B, T), or None for each row's cache length +
        0..width-1; the caller advances or rolls back the cache."""
        # the compute dtype (device.placement) read off its own norm: no search through the modules per draft
        window = Window(positions, self.inv_freq, self.norm.weight.dtype, cache, width=width,
                        rotary_factor=self.config.attention_factor)
        if cache is not None:
            cache.reserve(window.width)
        return window

    def unroll(self, features: torch.Tensor, ahead: torch.Tensor, embedding: nn.Embedding, steps: int):
        """The training-time test: yields (j, h_j) for draft steps j = 0..steps-1 over S base positions.

        features (B, S, nC): target features f_t at positions 0..S-1; ahead (B, S + steps - 1): the
        tokens x_1.. (ahead[:, t + j] = x_{t+1+j} is what step j at base t reads: the token its
        previous step drafted, when that draft was accepted). h_j (B, S, C) at base t predicts
        x_{t+2+j}. Step j attends as drafting does (module docstring): step-0 keys at positions <= t,
        then the keys of steps 1..j at base t; step j sits at position t + j.
        """
        B, S, _ = features.shape
        layer, attn = self.layer, self.layer.self_attn
        H, Hkv, D = attn.n_heads, attn.n_kv, attn.head_dim
        base = torch.arange(S, device=features.device)
        causal = base[None, :] <= base[:, None]                              # (S, S) key s visible from t
        prev, keys, values = self.fuse(features), [], []
        for j in range(steps):
            x, residual = self.layer_input(embedding(ahead[:, j:j + S]), prev)  # what q/k/v read; (B, S, C)
            qkv = attn.qkv_proj(x).view(B, S, H + 2 * Hkv, D)
            cos, sin = rotary((base + j)[None].expand(B, S), self.inv_freq, x.dtype, self.config.attention_factor)
            qk = apply_rotary(qkv[:, :, :H + Hkv], cos, sin)
            q = qk[:, :, :H].transpose(1, 2)                                   # (B, H, S, D)
            keys.append(qk[:, :, H:].transpose(1, 2).repeat_interleave(H // Hkv, 1))     # (B, H, S, D)
            values.append(qkv[:, :, H + Hkv:].transpose(1, 2).repeat_interleave(H // Hkv, 1))
            scores = (q @ keys[0].transpose(-1, -2)).masked_fill(~causal, float("-inf"))  # (B, H, S, S)
            diagonal = [(q * k).sum(-1, keepdim=True) for k in keys[1:]]      # (B, H, S, 1) each
            weights = torch.softmax(torch.cat([scores, *diagonal], -1) / math.sqrt(D), -1)
            y = weights[..., :S] @ values[0]                                    # (B, H, S, D)
            for i, v in enumerate(values[1:]):
                y = y + weights[..., S + i:S + i + 1] * v
            x = residual + attn.o_proj(y.transpose(1, 2).reshape(B, S, H * D))
            h = x + layer.mlp(layer.post_attention_layernorm(x))
            yield j, h
            prev = h


def initial_head(target, layer_ids, draft_ids: torch.Tensor, layout: str = "specdec") -> EagleHead:
    """A fresh head for `target` (fp32) in `layout`: the unembedding starts as the target's lm_head rows
    of the draft vocabulary and the output norm as the target's, the rest at random (the caller seeds)."""
    return started_from(EagleHead(target.config, layer_ids, draft_ids, layout), target)


def speculators_metadata(head: EagleHead, verifier: str, num_speculative_tokens: int) -> dict:
    """The head described as the `speculators` package's EAGLE-3 config.json (version 0.9): what an
    export of an eagle3-layout head writes, recorded with every head. Their aux layer ids index
    transformers' hidden_states (0 = the embedding), so ours shift by one; the extra norms of their
    variants are off (the reference layer)."""
    layer = {k: v for k, v in hf_config(head.config, torch.bfloat16).items() if k not in ("architectures", "dtype")}
    return {
        "speculators_model_type": KIND,
        "speculators_version": SPECULATORS_VERSION,
        "architectures": ["Eagle3Speculator"],
        "draft_vocab_size": head.draft_vocab_size,
        "target_hidden_size": head.config.hidden_size,
        "eagle_aux_hidden_state_layer_ids": [i + 1 for i in head.layer_ids],
        "embed_requires_grad": False, "fc_norm": False, "norm_before_fc": False, "norm_before_residual": False,
        "norm_output": False,
        "transformer_layer_config": {**layer, "num_hidden_layers": 1},
        "speculators_config": {
            "algorithm": KIND,
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": num_speculative_tokens,
                                  "accept_tolerance": 0.0, "verifier_accept_k": 1}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": ["LlamaForCausalLM"]},
        },
    }


# --- checkpoint ---------------------------------------------------------------------------

def save_eagle(head: EagleHead, path: str | Path, target_sha256: str, meta: dict | None = None,
               dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write the head folder atomically; matrices and norms in `dtype`, the draft ids as int64."""
    return write_head_folder(head, path, KIND, target_sha256, meta, dtype, layer_ids=list(head.layer_ids),
                             draft_vocab_size=head.draft_vocab_size, layout=head.layout)


def read_eagle_meta(path: str | Path) -> dict:
    return read_single_head_meta(path, KIND, "an EAGLE head", "eagle", "MTP heads: --draft mtp")


def build_eagle(meta: dict, state: dict) -> EagleHead:
    return EagleHead(Arch.from_dict(meta["target_config"]), meta["layer_ids"], state["draft_ids"],
                     meta.get("layout", "specdec"))  # folders from before layouts: specdec's


EAGLE_FOLDER = HeadFolder(read_eagle_meta, "the EAGLE head in {path} belongs",
                          "train a head for this target (specdec train --objective eagle --target ...), or pass the "
                          "target it was trained for", "retrain the head", build_eagle)


def check_eagle_target(path: str | Path, target: str | Path) -> dict:
    """An EAGLE head's metadata, checked against the target folder (heads.folder.check_head_target)."""
    return check_head_target(EAGLE_FOLDER, path, target)


def load_eagle(path: str | Path, target: str | Path, dtype: torch.dtype | None = None,
               device: str | torch.device = "cpu") -> EagleHead:
    """An EAGLE head loaded for the target folder (heads.folder.load_head)."""
    return load_head(EAGLE_FOLDER, path, target, dtype, device)


def check_head_fits(head, target, what: str = "EAGLE head", loader: str = "load_eagle") -> None:
    """A head (EAGLE's, or one like it: `what`, loaded by `loader`) fits a target only with the config
    it was built for; the checkpoint hash is checked by its loader."""
    diff = head.config.network_differences(target.config)
    if diff:
        raise SpecdecError(f"this {what} was built for another target (config differs: {diff})")
    if placement(head).dtype != placement(target).dtype:
        raise SpecdecError(f"the {what} computes in {placement(head).dtype} but the target in "
                           f"{placement(target).dtype}: load both in one dtype ({loader}(..., dtype=...))")

