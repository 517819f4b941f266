"""Token counts from text already on this machine, for a draft model saved without the counts of its
training tokens (a GGUF file): a draft vocabulary (the N most frequent ids) is chosen from them.

The text, read in a fixed order so that the counts are the same on every run of one environment, in
three parts: code, the Python standard library's own modules (its `.py` files but the tests', sorted
by path, up to CODE_BYTES); prose, the descriptions of the installed distributions (their METADATA:
mostly READMEs in Markdown, sorted by name); and chat, requests of specdec's own making and an
instruction-tuned model's greedy answers to them (chat_answers.json, written by
benchmarks/pair_chat_answers.py; none of them among the chat benchmark's prompts). Each part weighs alike
(its counts scaled to one total), so that the words of a chat reply rank beside the megabytes of
code (on the Qwen2.5-Coder pair it won back 1 of the 4 accepted tokens a vocabulary of 18,992 ids
lost on 2 chat prompts at T=1, and cost nothing on code: docs/quantized.md). Every id the tokenizer
adds beside its vocabulary (end of turn, end of text: what a chat ends with) counts as often as the
most frequent token, so that every draft vocabulary holds them.

The counts are made once per folder (a GGUF draft's entry in specdec's cache, keyed by its file's
sha256: gguf.entry) and saved there under this corpus's VERSION: a corpus that changes counts again.

This module knows nothing about models or decoding.
"""
from __future__ import annotations

import importlib.metadata
import json
import os
import sysconfig
import tempfile
from pathlib import Path

import torch

CODE_BYTES = 6_000_000
CHAT = Path(__file__).with_name("chat_answers.json")
VERSION = 2  # of the corpus (1: code and prose, counted as one)
SCALE = 1 << 40  # each part's counts sum to about this


def corpus() -> dict[str, list[str]]:
    """The texts counted, by part, each in its fixed order."""
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
    chat = json.loads(CHAT.read_text(encoding="utf-8"))
    return {"code": code, "prose": [prose[name] for name in sorted(prose)],
            "chat": [text for pair in zip(chat["prompts"], chat["answers"]) for text in pair]}


def token_counts(tokenizer, vocab_size: int, parts: tuple[str, ...] | None = None) -> torch.Tensor:
    """(vocab_size,) int64: how often each id occurs in each part of `corpus()` (or those named in
    `parts`) encoded by `tokenizer` (a `tokenizers.Tokenizer`), scaled to SCALE a part and summed; its
    added tokens counted as often as the most frequent id."""
    total = torch.zeros(vocab_size, dtype=torch.float64)
    for name, texts in corpus().items():
        if parts is not None and name not in parts:
            continue
        counts = torch.zeros(vocab_size, dtype=torch.float64)
        for encoding in tokenizer.encode_batch(texts, add_special_tokens=False):
            counts += torch.bincount(torch.tensor(encoding.ids, dtype=torch.int64), minlength=vocab_size)[:vocab_size]
        total += counts * (SCALE / max(float(counts.sum()), 1.0))
    counts = total.round().to(torch.int64)
    added = [i for i in tokenizer.get_added_tokens_decoder() if i < vocab_size]
    counts[added] = int(counts.max())
    return counts


def counted_once(folder: Path, tokenizer, vocab_size: int) -> torch.Tensor:
    """token_counts, made once for `folder` and saved there (atomically) under this VERSION."""
    from safetensors.torch import load_file, save_file

    saved = Path(folder) / f"local_token_counts-v{VERSION}.safetensors"
    if saved.is_file():
        return load_file(saved)["token_counts"]
    counts = token_counts(tokenizer, vocab_size)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        save_file({"token_counts": counts.contiguous()}, Path(tmp) / saved.name)
        os.replace(Path(tmp) / saved.name, saved)
    return counts
