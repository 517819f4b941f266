"""Token counts from text already on this machine, for a draft model saved without the counts of its
training tokens (a GGUF file): a draft vocabulary (the N most frequent ids) is chosen from them.

The text, read in a fixed order so that the counts are the same on every run of one environment:
code, the Python standard library's own modules (its `.py` files but the tests', sorted by path, up
to CODE_BYTES), and prose, the descriptions of the installed distributions (their METADATA: mostly
READMEs in Markdown, sorted by name). Every id the tokenizer adds beside its vocabulary (end of
turn, end of text: what a chat ends with) counts as often as the most frequent token, so that every
draft vocabulary holds them.

This module knows nothing about models or decoding.
"""
from __future__ import annotations

import importlib.metadata
import sysconfig
from pathlib import Path

import torch

CODE_BYTES = 6_000_000


def corpus() -> list[str]:
    """The texts counted, in their fixed order."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    code, size = [], 0
    for path in sorted(stdlib.rglob("*.py")):
        if {"site-packages", "test", "tests", "idle_test"} & set(path.relative_to(stdlib).parts):
            continue
        code.append(path.read_text(encoding="utf-8", errors="replace"))
        size += len(code[-1])
        if size >= CODE_BYTES:
            break
    prose = {}
    for dist in importlib.metadata.distributions():
        name = (dist.metadata["Name"] or "").lower()
        prose.setdefault(name, dist.read_text("METADATA") or "")  # the first of a name found on the path
    return code + [prose[name] for name in sorted(prose)]


def token_counts(tokenizer, vocab_size: int) -> torch.Tensor:
    """(vocab_size,) int64: how often each id occurs in `corpus()` encoded by `tokenizer`
    (a `tokenizers.Tokenizer`), its added tokens counted as often as the most frequent id."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for encoding in tokenizer.encode_batch(corpus(), add_special_tokens=False):
        counts += torch.bincount(torch.tensor(encoding.ids, dtype=torch.int64), minlength=vocab_size)[:vocab_size]
    added = [i for i in tokenizer.get_added_tokens_decoder() if i < vocab_size]
    counts[added] = int(counts.max())
    return counts
