"""The target drafts for itself: its own weights with every decoder layer's matrix quantized to 4
bits (Q4_1, the kernels' block format) and its unembedding to 8 (Q8_0: a 4-bit unembedding costs
the most agreement) multiplying fine activations (kernels.Matrix.fine: the logits that decide
agreement nearly as unrounded activations give them, for the same weight bytes), run as a draft
model. No training, no second checkpoint: any model specdec loads gets a draft that agrees with it
most of the time at a fraction of its weight traffic (a bf16 target's layers: 20 bytes per 32
weights instead of 64).

Its layers have the target's shapes, so it keeps no KV cache of its own: it attends to the target's
keys and values of the text so far (DraftModelProposer.start's target_cache), which saves its
prefill of every prompt and its catch-up after plain steps, and agrees with the target more often
than over its own 4-bit keys and values (benchmarks/self_draft_shared_cache.py). Everything else is
DraftModelProposer's (trees, sampling); the engine's verification makes it lossless like any drafter.
"""
from __future__ import annotations

import torch

from ..lm.checkpoint import quantized_copy
from .draft_model import DraftModelProposer

FORMAT = "q4_1"  # llama.cpp's 4-bit blocks with a min: closer to the target than Q4_0 (higher acceptance)
HEAD_FORMAT = "q8_0"


class SelfDraftProposer(DraftModelProposer):
    name = "self"
    reads_target_cache = True  # its layers have the target's shapes: it attends to the target's cache (`start`)

    def __init__(self, target, format: str = FORMAT, head_format: str = HEAD_FORMAT, draft_vocab: int | None = None,
                 token_counts: torch.Tensor | None = None, tree: str = "static", fine_head: bool = True):
        """target: specdec's own model (any stored format); format, head_format: the draft's layers'
        and unembedding's (kernels.FORMATS); fine_head: a quantized unembedding multiplies fine
        activations; the rest as DraftModelProposer (token_counts: the target's)."""
        super().__init__(quantized_copy(target, format, head_format, fine_head), draft_vocab, token_counts, tree)
        self.format, self.head_format = format, head_format
