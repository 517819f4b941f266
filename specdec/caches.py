"""specdec's caches in the user cache folder ($XDG_CACHE_HOME or ~/.cache, then specdec/): what each
holds, how much, and clearing them (`specdec cache list`, `specdec cache clear NAME... | all`). Each
is made again on use once cleared, at the cost its description names; none is needed to run a .gguf
file, which is read where it lies.

This module knows nothing about what the caches' files hold: each cache's owner names its folder.
"""
from __future__ import annotations

import importlib
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from .errors import SpecdecError


@dataclass(frozen=True)
class Cache:
    name: str
    owner: str  # the module (within specdec) whose cache_root() names its folder, following $XDG_CACHE_HOME
    holds: str  # what it holds, and what clearing it costs

    def root(self) -> Path:
        return importlib.import_module(self.owner, __package__).cache_root()


CACHES = {c.name: c for c in (
    Cache("from-gguf", ".lm.gguf", "checkpoint folders converted from .gguf files where something needs one "
          "(training, transformers' and llama.cpp's comparisons, a head trained for a .gguf target) and a GGUF "
          "draft's token counts; keyed by the file's sha256, the most recently used kept (gguf.KEEP); made "
          "again when next needed"),
    Cache("packaged", ".lm.packaged", "the packaged models' files (`specdec pair`), assembled from their "
          "installed pip parts: assembled again on next use"),
    Cache("kernels", ".kernels", "the CPU kernels built for this machine, Python and torch: built again on next use"),
    Cache("verify-curves", ".decoding.calibration", "each target's verify cost measured for -k auto: measured "
          "again on next use"),
    Cache("llama.cpp", ".bench.llamacpp", "checkpoints written as GGUF files for llama.cpp's side of `specdec bench`: "
          "written again when next compared"),
    Cache("sizes", ".bench.sizes", "the random-weight models of `specdec bench plain --size`: built again when "
          "next asked"),
)}


def footprint(root: Path) -> tuple[int, int]:
    """(bytes, files) under `root`; (0, 0) where it does not exist."""
    total = files = 0
    for folder, _, names in os.walk(root):
        for name in names:
            path = Path(folder) / name
            if not path.is_symlink() and path.is_file():
                total, files = total + path.stat().st_size, files + 1
    return total, files


def listing() -> list[dict]:
    """Each cache: its name, folder, bytes, files and what it holds."""
    rows = []
    for cache in CACHES.values():
        root = cache.root()
        size, files = footprint(root)
        rows.append({"name": cache.name, "path": root, "bytes": size, "files": files, "holds": cache.holds})
    return rows


def clear(names: list[str]) -> dict[str, int]:
    """Remove the caches named ("all": every one); {name: bytes freed}. An unknown name is refused
    before anything is removed."""
    chosen = list(CACHES) if names == ["all"] else names
    unknown = [n for n in chosen if n not in CACHES]
    if unknown or not chosen:
        raise SpecdecError(f"no cache {unknown[0]!r}: name one or more of {', '.join(CACHES)}, or all"
                           if unknown else f"name the caches to clear ({', '.join(CACHES)}), or all")
    freed = {}
    for name in dict.fromkeys(chosen):
        root = CACHES[name].root()
        freed[name] = footprint(root)[0]
        if root.exists():
            shutil.rmtree(root)
    return freed


def human(n: int) -> str:
    """Bytes as a reader takes them in: 0 B, 812 KB, 3.4 GB."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"
