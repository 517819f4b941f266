"""Fast plain autoregressive decoding with specdec's model: batched prompts of different lengths,
a preallocated KV cache with a length per row, one token per row per forward pass.

Prompts are right-padded for prefill and each row's cache is then rolled back to its own
length, so positions stay exact and no left padding is needed. Finished rows keep riding along
in the batch (their tokens are ignored) until every row is done.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..lm.interface import pad_right
from ..lm.model import LlamaForCausalLM
from .sampling import SamplingConfig, pick
from .stopping import Row, StopRule


@dataclass
class Timing:
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0


def prefill(model: LlamaForCausalLM, cache, prompts: list[list[int]]) -> torch.Tensor:
    """Write every prompt into the cache; return the last prompt position's logits (B, V)."""
    tokens, lengths = pad_right(prompts, device=cache.lengths.device)
    out = model(tokens, cache=cache, logits_index=(lengths - 1)[:, None])
    cache.rollback([len(p) for p in prompts])
    return out.logits[:, 0]


@torch.inference_mode()
def plain_generate(model: LlamaForCausalLM, prompts: list[list[int]], rule: StopRule,
                   sampling: SamplingConfig, generator: torch.Generator | None = None,
                   on_tokens: Callable[[int, list[int]], None] | None = None) -> tuple[list[Row], Timing]:
    """Each prompt decoded to its stop; on_tokens(i, [token]): prompt i's tokens as they come (a stream)."""
    rows = [Row(rule) for _ in prompts]
    timing = Timing()
    t0 = time.perf_counter()
    cache = model.new_cache(len(prompts), max(map(len, prompts)) + rule.max_new_tokens)
    logits = prefill(model, cache, prompts)
    timing.prefill_seconds = time.perf_counter() - t0
    while True:
        positions = [len(p) + len(row.tokens) for p, row in zip(prompts, rows)]  # where a seeded draw's noise is
        next_tokens = pick(logits, sampling, generator, positions)  # (B,)
        for i, (row, token) in enumerate(zip(rows, next_tokens.tolist())):
            if not row.done:
                row.append(token)
                if on_tokens is not None:
                    on_tokens(i, [token])
        if all(row.done for row in rows):
            break
        logits = model(next_tokens[:, None], cache=cache).logits[:, -1]
    timing.decode_seconds = time.perf_counter() - t0 - timing.prefill_seconds
    return rows, timing
