"""Token healing for prompts that end in whitespace.

Byte-level BPE merges a line break with the indentation after it ("\n    " is one token,
"\n        " another), so where a prompt's text ends and where the model would have put a token
boundary need not agree. Stripping the whitespace changes the prompt (the model then writes a
line break and indentation of its own, and the completion doubles what the prompt had); keeping
it as its own token asks the model to continue after a token it never saw followed by more
indentation. Healing keeps the prompt exact: the last token is backed off, and the first
generated token must extend the given text, i.e. its bytes must start with the backed-off text.
That first token is chosen from the target's distribution restricted to those tokens (greedy:
their argmax; sampling: the same temperature / top-k / top-p transform on the restricted
logits); everything after it is ordinary decoding of the target. The backed-off token itself is
always allowed, so healing never leaves the model without a choice.

This module knows nothing about drafting or stopping; prompts.py and pipeline.py call it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..lm.interface import Admitted, pad_right
from ..lm.tokenizer import Tokenizer
from .sampling import RowGenerators, SamplingConfig, pick_rows


@dataclass(frozen=True)
class Healed:
    ids: list[int]   # the prompt's token ids, the last one backed off when healing
    text: str        # the backed-off text the first generated token must start with ("" = no healing)


def back_off(tokenizer: Tokenizer, prompt: str, special_tokens: bool = True) -> Healed:
    """Back off the last token of a prompt that ends in whitespace (when that token holds whole
    characters); other prompts are encoded as they are (special_tokens: Tokenizer.encode's)."""
    ids = tokenizer.encode(prompt, special_tokens)
    if not ids or not prompt[-1].isspace():
        return Healed(ids, "")
    last = tokenizer.token_bytes[ids[-1]]
    try:
        text = last.decode("utf-8") if last is not None else ""
    except UnicodeDecodeError:  # the token starts inside a character: leave the prompt as it is
        text = ""
    return Healed(ids[:-1], text) if text else Healed(ids, "")


def allowed(tokenizer: Tokenizer, text: str, vocab_size: int) -> torch.Tensor:
    """(V,) bool: the token ids whose bytes start with `text` (ids past the tokenizer's are not)."""
    prefix = text.encode("utf-8")
    mask = torch.zeros(vocab_size, dtype=torch.bool)
    mask[[i for i, b in enumerate(tokenizer.token_bytes) if b is not None and b.startswith(prefix)]] = True
    return mask


@torch.inference_mode()
def first_tokens(target: Admitted, tokenizer: Tokenizer, prompts: list[list[int]], texts: list[str],
                 samplings: list[SamplingConfig], generator: torch.Generator | RowGenerators | None) -> list[int]:
    """The first generated token of each prompt (its ids already backed off), restricted to the
    tokens that start with its backed-off text, under its own sampling settings: one forward of the
    admitted target over all of them."""
    tokens, lengths = pad_right(prompts, device=target.device)                         # (B, T), (B,)
    logits = target.lm(tokens, logits_index=(lengths - 1)[:, None]).logits[:, 0]       # (B, V)
    masks = torch.stack([allowed(tokenizer, t, logits.shape[-1]) for t in texts]).to(target.device)  # (B, V)
    return pick_rows(logits.masked_fill(~masks, float("-inf")), samplings, generator,
                     list(map(len, prompts))).tolist()
