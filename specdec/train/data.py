"""Token streams for training: a corpus split tokenised once into one flat array, and batches of
random windows drawn as a pure function of (seed, step), so that resuming after an interruption
and running under torchrun see exactly the batches a single uninterrupted process sees.
"""
from __future__ import annotations

import numpy as np
import torch

from ..errors import SpecdecError
from ..lm.checkpoint import sha256
from ..lm.tokenizer import EOS_ID, Tokenizer
from .corpus import Document, fingerprint


def preparation_key(sources: list[str] | None, vocab_size: int, tokenizer: str | None, seq_len: int) -> dict:
    """What a run's prepared token files depend on: the corpus files (paths, sizes, modification
    times), the vocabulary size, the tokenizer file (or none: trained on the corpus) and seq_len
    (the validation hold-out of a small corpus is measured in windows)."""
    return {"corpus": fingerprint(sources), "vocab_size": vocab_size,
            "tokenizer": sha256(tokenizer) if tokenizer else "trained on the corpus", "seq_len": seq_len}


def tokenize(docs: list[Document], tokenizer: Tokenizer) -> np.ndarray:
    """Concatenate documents, each followed by the tokenizer's EOS (specdec's <|endoftext|>, or a
    foreign checkpoint's first EOS id), into one int32 token array."""
    ids = tokenizer.encode_batch([d.text for d in docs])
    eos = EOS_ID if tokenizer.eos_id is None else tokenizer.eos_id
    return np.fromiter((t for doc in ids for t in (*doc, eos)), dtype=np.int32)


def window_batch(tokens: np.ndarray, seed: int, step: int, batch_size: int, seq_len: int) -> torch.Tensor:
    """(batch_size, seq_len + 1) windows at offsets fixed by (seed, step)."""
    if len(tokens) <= seq_len + 1:
        raise SpecdecError(f"the corpus split has {len(tokens)} tokens, fewer than one training window of "
                           f"{seq_len + 1}; add text or lower --seq-len")
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, len(tokens) - seq_len - 1, size=batch_size)
    return torch.from_numpy(np.stack([tokens[s:s + seq_len + 1] for s in starts]).astype(np.int64))


def eval_batches(tokens: np.ndarray, seq_len: int, max_windows: int, batch_size: int = 8):
    """At most max_windows non-overlapping windows spread evenly over the split (deterministic),
    in batches of (batch_size, seq_len + 1)."""
    available = (len(tokens) - 1) // seq_len
    if available <= 0:
        raise SpecdecError(f"an evaluation split has {len(tokens)} tokens, fewer than one window of "
                           f"{seq_len + 1}; give the corpus more text or lower --seq-len")
    picks = np.linspace(0, available - 1, min(available, max_windows)).round().astype(int)
    windows = [tokens[i * seq_len:(i + 1) * seq_len + 1] for i in np.unique(picks)]
    for i in range(0, len(windows), batch_size):
        yield torch.from_numpy(np.stack(windows[i:i + batch_size]).astype(np.int64))
