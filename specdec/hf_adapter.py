"""A transformers causal LM (LlamaForCausalLM, GPT2LMHeadModel, ...) behind specdec's model
interface (see lm.py), so it can serve as target or draft model.

The cache is transformers' `DynamicCache`; rollback crops it. A DynamicCache holds one length
for all rows, so these models run at batch size 1 (a chain of drafts per step). Correctness
first: this adapter exists to show the engine is not tied to specdec's model, not for speed.
"""
from __future__ import annotations

import torch
from transformers import DynamicCache, PreTrainedModel

from .errors import SpecdecError
from .model import Abilities, ModelOutput


class HFCache:
    def __init__(self, model: PreTrainedModel):
        self.config = model.config
        self.inner = DynamicCache(config=model.config)
        self.lengths = torch.zeros(1, dtype=torch.long, device=model.device)  # (1,)
        self.held = [0]  # the same on the host

    def regroup(self, keep: list[int], joining=None, empty: int = 0) -> None:
        """Batch size 1 only: keep the row, or start an empty one (see KVCache.regroup)."""
        if len(keep) + empty > 1 or joining is not None:
            raise SpecdecError("transformers models run at batch size 1 here: one request at a time "
                               "(use specdec's LlamaForCausalLM to batch requests)")
        if not keep:
            self.inner = DynamicCache(config=self.config)
            self.lengths = torch.zeros(empty, dtype=torch.long, device=self.lengths.device)
            self.held = [0] * empty

    @property
    def longest(self) -> int:
        return max(self.held, default=0)

    def advance(self, num_new: int) -> None:
        self.lengths += num_new
        self.held = [n + num_new for n in self.held]

    def rollback(self, lengths: torch.Tensor | list[int] | int) -> None:
        length = int(torch.as_tensor(lengths).max())
        held = self.held[0]
        if length > held:
            raise SpecdecError(f"cannot roll a transformers cache forward ({held} -> {length} positions)")
        if length < held:
            self.inner.crop(length - held)  # transformers: a negative count removes that many
        self.lengths.fill_(length)
        self.held = [length]


class HFCausalLM:
    abilities = Abilities(trees=False, layers=False, draft_vocab=False, batch=False)

    def __init__(self, model: PreTrainedModel):
        if model.training:
            raise SpecdecError(f"{type(model).__name__} is in training mode (dropout would make its "
                               "output random): call model.eval() first")
        self.model = model
        self.config = model.config

    def new_cache(self, batch_size: int, max_len: int | None = None) -> HFCache:
        if batch_size != 1:
            raise SpecdecError(f"transformers models run at batch size 1 here (got {batch_size}); "
                               "use specdec's LlamaForCausalLM for batched decoding")
        return HFCache(self.model)

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                 cache: HFCache | None = None, attention_mask: torch.Tensor | None = None,
                 logits_index: torch.Tensor | None = None) -> ModelOutput:
        """tokens (B, T); positions (B, T), default: after the cached ones; logits_index (B, N).
        attention_mask: causal only (None); draft trees need specdec's own model."""
        if attention_mask is not None:
            raise SpecdecError("draft trees need specdec's own LlamaForCausalLM as the target; a transformers "
                               "model verifies chains only")
        T = tokens.shape[1]
        if positions is None:
            start = cache.lengths[:, None] if cache is not None else 0
            positions = start + torch.arange(T, device=tokens.device)[None]
        out = self.model(input_ids=tokens, position_ids=positions,
                         cache=cache.inner if cache is not None else None, use_cache=cache is not None,
                         output_hidden_states=True)
        if cache is not None:
            cache.advance(T)
        logits = out.logits
        if logits_index is not None:
            logits = logits.gather(1, logits_index[..., None].expand(-1, -1, logits.shape[-1]))
        return ModelOutput(logits, out.hidden_states[-1], {})
