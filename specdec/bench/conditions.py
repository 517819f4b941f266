"""The conditions every measured figure carries (DESIGN.md section 3). What cannot be determined
is written "unknown", never guessed."""
from __future__ import annotations

import os
import platform
import statistics
import subprocess
from pathlib import Path

import torch

from .. import kernels
from ..checkpoint import WEIGHTS, sha256
from ..model import compute_dtype

UNKNOWN = "unknown"


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or UNKNOWN


def git_sha() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=Path(__file__).resolve().parent, timeout=5)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, cwd=Path(__file__).resolve().parent, timeout=5).stdout.strip()
        return out.stdout.strip() + ("+dirty" if dirty else "") if out.returncode == 0 else UNKNOWN
    except (OSError, subprocess.SubprocessError):
        return UNKNOWN


def hardware() -> dict:
    return {"cpu": cpu_model(), "cores": os.cpu_count() or UNKNOWN, "threads": torch.get_num_threads(),
            "accelerator": "none"}


def software() -> dict:
    import transformers

    from .. import __version__
    return {"python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "specdec": __version__, "git": git_sha()}


def model_info(model, path: Path) -> dict:
    weights = path / WEIGHTS
    return {"name": path.name, "path": shown_path(path), "parameters": model.num_parameters(),
            "dtype": str(compute_dtype(model)).removeprefix("torch."),
            "matrices": str(model.lm_head.weight.dtype).removeprefix("torch."),
            "kernels": "specdec CPU kernels (AVX2)" if kernels.compiled() else "PyTorch operators",
            "checkpoint_sha256": sha256(weights) if weights.exists() else UNKNOWN}


def spread(values: list[float]) -> dict:
    """Median, min, max and count of repeated measurements (the spread every figure carries)."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def shown_path(path: Path) -> str:
    """A path inside the repository relative to its root (models/target), others as given."""
    root = Path(__file__).resolve().parents[2]
    try:
        return Path(path).resolve().relative_to(root).as_posix()
    except ValueError:
        return str(path)
