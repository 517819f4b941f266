"""The target's verify-cost curve on this machine: seconds of one forward over n new tokens per
row after a cached context, at a given batch size, measured once and kept on disk.

Adaptive speculation (adaptive.py) needs t(n) at the batch size it runs at before its first step;
the bench (bench/) measures the same curve for its reports. A stored curve is keyed by what
changes it: the model (config, compute dtype and a fingerprint of its weights), the batch size
and the points, and the machine (CPU model, kernel instruction set, threads, torch version), so
another machine or model never reuses it. `specdec calibrate` re-measures.

This module knows nothing about drafting or verification.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import statistics
import time
import weakref
from pathlib import Path

import torch

from .. import kernels
from ..lm.device import placement, synchronize
from ..lm.interface import abilities, causal_lm
from .costmodel import VerifyCurve

CONTEXT_TOKENS = 128  # cached tokens before the timed forward (a typical prompt length here)


@torch.inference_mode()
def measure_verify_curve(model, tokens_per_row: list[int], batch_size: int = 1, repeats: int = 7,
                         context_tokens: int = CONTEXT_TOKENS, reduce=statistics.median) -> VerifyCurve:
    """Median (or `reduce`) seconds of a forward over n new tokens per row (every n in
    tokens_per_row) at `batch_size` rows, after `context_tokens` cached ones; the n values are
    interleaved repeat by repeat and the cache is rolled back after each forward, so every forward
    sees the same context."""
    lm = causal_lm(model, role="target")
    vocab = lm.config.vocab_size
    context_tokens = min(context_tokens, lm.config.max_position_embeddings - max(tokens_per_row))
    g, device = torch.Generator().manual_seed(0), placement(lm).device
    cache = lm.new_cache(batch_size, context_tokens + max(tokens_per_row))
    lm(torch.randint(0, vocab, (batch_size, context_tokens), generator=g).to(device), cache=cache)
    windows = {n: torch.randint(0, vocab, (batch_size, n), generator=g).to(device) for n in tokens_per_row}
    times = {n: [] for n in tokens_per_row}
    for r in range(repeats + 1):  # the first round warms up and is not kept
        for n, window in windows.items():
            synchronize(device)
            t0 = time.perf_counter()
            lm(window, cache=cache)
            synchronize(device)  # the device's work done, not only queued
            elapsed = time.perf_counter() - t0
            cache.rollback(context_tokens)
            if r:
                times[n].append(elapsed)
    return VerifyCurve({n: reduce(t) for n, t in times.items()}, batch_size)


def curve_points(max_tokens: int) -> list[int]:
    """1..8 every token, then every other up to 16, every fourth beyond: t(n) is interpolated between."""
    points = [n for n in range(1, 9)] + list(range(10, 17, 2)) + list(range(20, max_tokens + 4, 4))
    return sorted({min(n, max_tokens) for n in points})


def cached_verify_curve(model, batch_size: int, max_tokens: int, remeasure: bool = False,
                        repeats: int = 5, points: list[int] | None = None) -> tuple[VerifyCurve, bool]:
    """The curve t(n), n = 1..max_tokens, at `batch_size` rows: from the disk cache when this model
    was measured on this machine before, else measured now and stored. Returns it and whether it
    was measured now (also when the stored one stops short of max_tokens)."""
    path = _cache_dir() / f"{_key(model, batch_size)}.json"
    if not remeasure and (path in _LOADED or path.exists()):
        if path not in _LOADED:
            stored = json.loads(path.read_text())
            _LOADED[path] = VerifyCurve({int(n): s for n, s in stored["seconds"].items()}, stored["batch_size"])
        if max(_LOADED[path].seconds) >= max_tokens:
            return _LOADED[path], False
    # the fastest of the repeats, made non-decreasing in n (more tokens never cost less): a stored
    # curve outlives the moment it was measured in, so a busy moment must not bend it
    fastest = measure_verify_curve(model, points or curve_points(max_tokens), batch_size, repeats=repeats, reduce=min)
    points = sorted(fastest.seconds)
    curve = VerifyCurve({n: min(fastest.seconds[m] for m in points if m >= n) for n in points}, batch_size)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")  # written whole, then renamed: never half a file
    tmp.write_text(json.dumps({"seconds": curve.seconds, "batch_size": batch_size, "machine": machine()}, indent=1))
    os.replace(tmp, path)
    _LOADED[path] = curve
    return curve, True


_LOADED: dict[Path, VerifyCurve] = {}  # curves read from disk in this process


def machine() -> dict:
    """What a stored curve's times depend on besides the model."""
    return {"cpu": cpu_model(), "isa": kernels.isa() or "pytorch",
            "threads": torch.get_num_threads(), "torch": torch.__version__}


def _key(model, batch_size: int) -> str:
    lm = causal_lm(model, role="target")
    text = json.dumps([_model_identity(lm), batch_size, machine()], sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


_IDENTITIES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _model_identity(lm) -> list:
    """The config, a fingerprint of the weights (a sum over the unembedding) and the backend, computed
    once per model object: a generation asks for it every time."""
    inner = getattr(lm, "model", lm)
    if inner not in _IDENTITIES:
        weights = lm.lm_head.weight if hasattr(lm, "lm_head") else next(lm.parameters())
        fingerprint = float(weights.detach().float().sum()), tuple(weights.shape), str(weights.dtype)
        config = lm.config.to_dict() if hasattr(lm.config, "to_dict") else vars(lm.config)
        _IDENTITIES[inner] = [config, fingerprint, abilities(lm).backend]
    return _IDENTITIES[inner]


def _cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "specdec" / "verify-curves"


@functools.cache
def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"
