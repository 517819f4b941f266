"""Plain autoregressive decoding, deliberately simple: the oracle every faster decoder is tested
against. One prompt at a time, no KV cache: each step runs the whole sequence through the model
and takes the last position's logits. Works with specdec's model and with any transformers
causal LM (both are called as `model(tokens).logits`).
"""
from __future__ import annotations

import torch

from .sampling import SamplingConfig, pick
from .stopping import Row, StopRule


@torch.no_grad()
def reference_generate(model, prompt: list[int], rule: StopRule, sampling: SamplingConfig,
                       generator: torch.Generator | None = None) -> Row:
    row = Row(rule)
    seq = list(prompt)
    while not row.done:
        logits = model(torch.tensor([seq])).logits[:, -1]  # (1, V)
        token = int(pick(logits, sampling, generator, [len(seq)]))
        row.emit(token)
        seq.append(token)
    return row
