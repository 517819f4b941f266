"""A transformers causal LM (LlamaForCausalLM, GPT2LMHeadModel, ...) behind specdec's model
interface (see interface.py), so it can serve as target or draft model, at any batch size.

Each row has its own transformers `DynamicCache`, since one holds a single length for all its
rows while a batch's rows commit different numbers of tokens; rollback crops a row's cache. With a
cache, the rows run one after another (a forward per row, at the row's own positions). Correctness
first: this adapter exists so that any decoder-only transformers model (GPT-2 included) works with
the engine; the families of arch.py run batched in specdec's own model instead, much faster.
"""
from __future__ import annotations

import torch
from transformers import DynamicCache, PreTrainedModel

from ..errors import SpecdecError
from .device import backend
from .model import Abilities, ModelOutput


class HFCache:
    """Per-row transformers caches with the interface of kv_cache.KVCache (lengths, held,
    longest, advance, rollback, regroup, staging); no trees (no compact)."""

    pool = None  # no blocks: each row is a transformers cache of its own, grown as it goes

    def __init__(self, config, rows: int, device: torch.device):
        self.config, self.device = config, device
        self.rows = [DynamicCache(config=config) for _ in range(rows)]
        self.held = [0] * rows  # committed tokens per row, on the host
        self.lengths = torch.zeros(rows, dtype=torch.long, device=device)  # (B,) the same on the device

    def _set(self, rows: list, held: list[int]) -> None:
        self.rows, self.held = rows, list(held)
        self.lengths = torch.tensor(held, dtype=torch.long, device=self.device)

    def regroup(self, keep: list[int], joining: "HFCache | None" = None, empty: int = 0,
                promises: list[int] | None = None) -> None:
        """Rows `keep` (in that order), then every row of `joining`, then `empty` new rows (`promises`:
        nothing to promise, memory is transformers')."""
        rows = [self.rows[b] for b in keep] + (joining.rows if joining is not None else [])
        held = [self.held[b] for b in keep] + (joining.held if joining is not None else [])
        self._set(rows + [DynamicCache(config=self.config) for _ in range(empty)], held + [0] * empty)

    def staging(self, rows: int, promises: list[int] | None = None) -> "HFCache":
        return HFCache(self.config, rows, self.device)

    @property
    def longest(self) -> int:
        return max(self.held, default=0)

    def advance(self, num_new: int) -> None:
        self.lengths += num_new
        self.held = [n + num_new for n in self.held]

    def rollback(self, lengths: torch.Tensor | list[int] | int) -> None:
        if isinstance(lengths, torch.Tensor):
            lengths = lengths.tolist()
        held = [lengths] * len(self.held) if isinstance(lengths, int) else [int(n) for n in lengths]
        for row, old, new in zip(self.rows, self.held, held):
            if new > old:
                raise SpecdecError(f"cannot roll a transformers cache forward ({old} -> {new} positions)")
            if new < old:
                row.crop(new - old)  # transformers: a negative count removes that many
        self._set(self.rows, held)


class HFCausalLM:
    def __init__(self, model: PreTrainedModel):
        if model.training:
            raise SpecdecError(f"{type(model).__name__} is in training mode (dropout would make its "
                               "output random): call model.eval() first")
        self.model = model
        self.config = model.config
        self.abilities = Abilities(trees=False, layers=False, draft_vocab=False, batch=True,
                                   backend=f"transformers {type(model).__name__}: "
                                           f"{backend(model.device, model.dtype)}")

    def new_cache(self, batch_size: int, max_len: int | None = None, dtype: torch.dtype | None = None,
                  tokens: int | None = None) -> HFCache:
        if dtype not in (None, self.model.dtype):
            raise SpecdecError(f"a transformers model keeps its cache in its own dtype ({self.model.dtype}), "
                               f"not {dtype}: leave the KV cache's dtype unset")
        return HFCache(self.model.config, batch_size, self.model.device)

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
        if cache is None:
            out = self.model(input_ids=tokens, position_ids=positions, use_cache=False, output_hidden_states=True)
            logits, hidden = out.logits, out.hidden_states[-1]
        else:  # one forward per row, into the row's own cache
            outs = [self.model(input_ids=tokens[b:b + 1], position_ids=positions[b:b + 1], cache=row, use_cache=True,
                               output_hidden_states=True) for b, row in enumerate(cache.rows)]
            logits = torch.cat([o.logits for o in outs])                # (B, T, V)
            hidden = torch.cat([o.hidden_states[-1] for o in outs])     # (B, T, C)
            cache.advance(T)
        if logits_index is not None:
            logits = logits.gather(1, logits_index[..., None].expand(-1, -1, logits.shape[-1]))
        return ModelOutput(logits, hidden, {})
