"""The target's verify-cost curve on this machine: seconds of one forward over n new tokens per
row after a cached context, at a given batch size, measured once and kept on disk.

Adaptive speculation (adaptive.py) needs t(n) at the batch size it runs at before its first step;
the bench (bench/) measures the same curve for its reports. A stored curve is keyed by what
changes it: the model (config, compute dtype and a fingerprint of its weights), the batch size
and the points, and the machine (CPU model, the kernels' instruction set and build, threads, torch
version), so another machine, model or version of the kernels never reuses it. `specdec calibrate` re-measures, and can write the
curves to a file of their own (`write_curve_file`) that `specdec simulate` reads.

This module knows nothing about drafting or verification.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import statistics
import sys
import time
import weakref
from pathlib import Path

import torch
from tqdm import tqdm

from .. import kernels
from ..errors import SpecdecError
from ..lm.device import release_freed_memory, synchronize
from ..lm.interface import Admitted
from .costmodel import VerifyCurve

CONTEXT_TOKENS = 128  # cached tokens before the timed forward (a typical prompt length here)


@torch.inference_mode()
def measure_verify_curve(admitted: Admitted, tokens_per_row: list[int], batch_size: int = 1, repeats: int = 7,
                         context_tokens: int = CONTEXT_TOKENS, reduce=statistics.median,
                         progress=None) -> VerifyCurve:
    """Median (or `reduce`) seconds of a forward over n new tokens per row (every n in
    tokens_per_row) at `batch_size` rows, after `context_tokens` cached ones; the n values are
    interleaved repeat by repeat and the cache is rolled back after each forward, so every forward
    sees the same context. `progress(1)` is called after each forward, when given."""
    model, vocab = admitted.model, admitted.model.config.vocab_size
    context_tokens = min(context_tokens, admitted.context - max(tokens_per_row))
    g, device = torch.Generator().manual_seed(0), admitted.device
    cache = model.new_cache(batch_size, context_tokens + max(tokens_per_row))
    model(torch.randint(0, vocab, (batch_size, context_tokens), generator=g).to(device), cache=cache)
    windows = {n: torch.randint(0, vocab, (batch_size, n), generator=g).to(device) for n in tokens_per_row}
    times = {n: [] for n in tokens_per_row}
    for r in range(repeats + 1):  # the first round warms up and is not kept
        for n, window in windows.items():
            synchronize(device)
            t0 = time.perf_counter()
            model(window, cache=cache)
            synchronize(device)  # the device's work done, not only queued
            elapsed = time.perf_counter() - t0
            cache.rollback(context_tokens)
            if progress is not None:
                progress(1)
            if r:
                times[n].append(elapsed)
    return VerifyCurve({n: reduce(t) for n, t in times.items()}, batch_size)


def curve_points(max_tokens: int) -> list[int]:
    """1..8 every token, then every other up to 16, every fourth beyond: t(n) is interpolated between."""
    points = [n for n in range(1, 9)] + list(range(10, 17, 2)) + list(range(20, max_tokens + 4, 4))
    return sorted({min(n, max_tokens) for n in points})


def verify_curves(admitted: Admitted, batch_sizes: list[int], max_tokens: int, name: str = "the target",
                  remeasure: bool = False, repeats: int = 5, points: list[int] | None = None
                  ) -> tuple[dict[int, VerifyCurve], float]:
    """The curves t(n), n = 1..max_tokens, at each batch size: from the disk cache where this model
    was measured on this machine before (and reached max_tokens), the others measured now and
    stored. Measuring says so first, once, on stderr ("measuring this machine's verify cost for
    NAME, once, ~N s"), then shows a progress bar. Returns the curves by batch size and the seconds
    spent measuring (0 when every curve was stored)."""
    curves = {} if remeasure else {b: c for b in batch_sizes if (c := _stored(admitted, b, max_tokens)) is not None}
    missing = [b for b in batch_sizes if b not in curves]
    if not missing:
        return curves, 0.0
    t0 = time.perf_counter()
    points = points or curve_points(max_tokens)
    if not remeasure:  # `specdec calibrate` asked for it: no news
        seconds = estimate(admitted, missing, points, repeats)
        print(f"measuring this machine's verify cost for {name}, once, ~{seconds:.0f} s (stored for later runs; "
              "not part of any timing)", file=sys.stderr, flush=True)
    with tqdm(total=(repeats + 1) * len(points) * len(missing), desc="verify cost", unit="forward", leave=False,
              file=sys.stderr) as bar:
        for batch in missing:
            curves[batch] = _measure_and_store(admitted, batch, points, repeats, bar.update)
    release_freed_memory()  # the measuring forwards' activations: a server's idle memory is not their peak
    return curves, time.perf_counter() - t0


def cached_verify_curve(admitted: Admitted, batch_size: int, max_tokens: int, remeasure: bool = False,
                        repeats: int = 5, points: list[int] | None = None) -> tuple[VerifyCurve, bool]:
    """The curve at one batch size (as `verify_curves`), and whether it was measured now."""
    curves, seconds = verify_curves(admitted, [batch_size], max_tokens, remeasure=remeasure, repeats=repeats,
                                    points=points)
    return curves[batch_size], seconds > 0


def _stored(admitted: Admitted, batch_size: int, max_tokens: int) -> VerifyCurve | None:
    """The curve measured for this model, batch size and machine before, if it reaches max_tokens."""
    path = cache_root() / f"{_key(admitted, batch_size)}.json"
    if path not in _LOADED and path.exists():
        stored = json.loads(path.read_text())
        _LOADED[path] = VerifyCurve({int(n): s for n, s in stored["seconds"].items()}, stored["batch_size"])
    curve = _LOADED.get(path)
    return curve if curve is not None and max(curve.seconds) >= max_tokens else None


def _measure_and_store(admitted: Admitted, batch_size: int, points: list[int], repeats: int, progress) -> VerifyCurve:
    # the fastest of the repeats, made non-decreasing in n (more tokens never cost less): a stored
    # curve outlives the moment it was measured in, so a busy moment must not bend it
    fastest = measure_verify_curve(admitted, points, batch_size, repeats, CONTEXT_TOKENS, min, progress)
    points = sorted(fastest.seconds)
    curve = VerifyCurve({n: min(fastest.seconds[m] for m in points if m >= n) for n in points}, batch_size)
    path = cache_root() / f"{_key(admitted, batch_size)}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")  # written whole, then renamed: never half a file
    tmp.write_text(json.dumps({"seconds": curve.seconds, "batch_size": batch_size, "machine": machine()}, indent=1))
    os.replace(tmp, path)
    _LOADED[path] = curve
    return curve


@torch.inference_mode()
def estimate(admitted: Admitted, batch_sizes: list[int], points: list[int], repeats: int) -> float:
    """Seconds `verify_curves` will take to measure these batch sizes: two forwards timed now (one
    token, and as many as its largest forward carries), the cost linear in the tokens in between."""
    model, device = admitted.model, admitted.device
    largest = min(max(batch_sizes) * max(points), admitted.context)
    seconds = {}
    for n in (1, largest):
        synchronize(device)
        t0 = time.perf_counter()
        model(torch.zeros(1, n, dtype=torch.long, device=device))
        synchronize(device)
        seconds[n] = time.perf_counter() - t0
    per_token = max(seconds[largest] - seconds[1], 0.0) / max(largest - 1, 1)

    def forward(tokens: int) -> float:
        return seconds[1] + per_token * (tokens - 1)
    return sum(forward(b * CONTEXT_TOKENS) + (repeats + 1) * sum(forward(b * n) for n in points) for b in batch_sizes)


_LOADED: dict[Path, VerifyCurve] = {}  # curves read from disk in this process


def machine() -> dict:
    """What a stored curve's times depend on besides the model."""
    return {"cpu": cpu_model(), "isa": kernels.isa() or "pytorch", "kernels": kernels.build(),
            "threads": torch.get_num_threads(), "torch": torch.__version__}


def _key(admitted: Admitted, batch_size: int) -> str:
    text = json.dumps([_model_identity(admitted), batch_size, machine()], sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


_IDENTITIES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _model_identity(admitted: Admitted) -> list:
    """The config, a fingerprint of the weights (a sum over the unembedding) and the backend, computed
    once per model object: a generation asks for it every time."""
    model = admitted.model
    inner = getattr(model, "model", model)
    if inner not in _IDENTITIES:
        head = getattr(model, "lm_head", None)
        if head is not None and head.weight is None:  # held as stored (blocks or a file's floats): a sum of its bytes
            fingerprint = int(head.stored.data.view(torch.uint8).sum()), head.stored.shape, head.stored.format
        else:
            weights = next(model.parameters()) if head is None else head.weight
            fingerprint = float(weights.detach().float().sum()), tuple(weights.shape), str(weights.dtype)
        config = model.config.to_dict() if hasattr(model.config, "to_dict") else vars(model.config)
        _IDENTITIES[inner] = [config, fingerprint, admitted.abilities.backend]
    return _IDENTITIES[inner]


def cache_root() -> Path:
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


CURVE_SCHEMA = "specdec-verify-curve/1"


def write_curve_file(path: str | Path, curves: dict[int, dict[int, float]], target: str, backend: str,
                     hardware: dict) -> None:
    """The curves by batch size (`specdec calibrate --out`) with their conditions, as JSON."""
    Path(path).write_text(json.dumps({
        "schema": CURVE_SCHEMA, "target": target, "backend": backend, "hardware": hardware, "machine": machine(),
        "note": "seconds of one target forward over n new tokens per row, the fastest of 5 repeats, "
                "made non-decreasing in n", "seconds": curves}, indent=1))


def read_curve_file(path: str | Path, batch_size: int) -> tuple[VerifyCurve, str]:
    """The verify curve at `batch_size` from a `write_curve_file` file, and where it came from."""
    try:
        stored = json.loads(Path(path).read_text())
        curves = {int(b): {int(n): float(s) for n, s in seconds.items()} for b, seconds in stored["seconds"].items()}
    except (OSError, ValueError, KeyError, AttributeError) as e:
        raise SpecdecError(f"{path} is not a verify-curve file of `specdec calibrate --out` ({type(e).__name__}: {e})")
    if batch_size not in curves:
        raise SpecdecError(f"{path} holds curves at batch sizes {sorted(curves)}, not {batch_size}: pick one of them "
                           "with --batch-size, or calibrate that batch size")
    device = stored.get("hardware", {}).get("device_used", "unknown")
    return VerifyCurve(curves[batch_size], batch_size), (f"the verify curve in {path} (target {stored.get('target')}, "
                                                          f"{stored.get('backend')}, measured on {device})")
