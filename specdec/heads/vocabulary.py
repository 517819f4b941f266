"""A drafter's unembedding over some of the target's token ids (a draft vocabulary): trained with an
EAGLE or block head, or rows of a model's own lm_head kept as stored. Used by the drafters that draft
over one (proposers/) and by the losses that train one (train/).
"""
from __future__ import annotations

import torch

from ..errors import SpecdecError
from ..lm.model import Linear, frozen_linear


def linear_rows(linear: Linear, rows: torch.Tensor) -> Linear:
    """A frozen Linear over the output rows `rows` (N,) of `linear`, in its format (a quantized one's
    rows as stored: each output the very number the whole matrix gives it)."""
    if linear.stored is not None and linear.stored.quantized:
        part = Linear(linear.in_features, len(rows), bias=False, device="meta")
        part.store(matrix=linear.stored.rows(rows))
        return part
    return frozen_linear(linear.dense_rows(rows))


class DraftVocabulary:
    """A drafter's unembedding over the N token ids most frequent in its training tokens, and the
    map back to target ids. Lossless: the draft's probability is 0 outside the N ids, which the
    acceptance rules account for; it only makes the unembedding cheaper (N rows instead of V). A
    quantized lm_head's rows keep its format (each row's logit the very number the full
    unembedding gives it: the kernels compute each output row alone)."""

    def __init__(self, ids: torch.Tensor, lm_head: Linear):
        self.ids = ids  # (N,) sorted target ids
        self.unembedding = linear_rows(lm_head, ids)

    @classmethod
    def trained(cls, ids: torch.Tensor, unembedding: torch.nn.Module) -> "DraftVocabulary":
        """A drafter's own unembedding over ids (N,), trained with it (an EAGLE head's lm_head)."""
        vocab = cls.__new__(cls)
        vocab.ids, vocab.unembedding = ids, unembedding
        return vocab

    @staticmethod
    def ids_for(size: int | None, vocab_size: int, token_counts: torch.Tensor | None, no_counts: str,
                device: torch.device) -> torch.Tensor | None:
        """The `size` most frequent ids (sorted) on `device` (the drafter's), or None for the full
        vocabulary (size None or >= vocab_size); `no_counts` is the error when the counts were not saved."""
        if size is None or size >= vocab_size:
            return None
        if size < 1:
            raise SpecdecError(f"draft_vocab must be >= 1 token, got {size}")
        if token_counts is None:
            raise SpecdecError(no_counts)
        return token_counts.cpu().topk(size).indices.sort().values.to(device)  # counts are kept on the host
