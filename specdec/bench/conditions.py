"""The conditions every measured figure carries (docs/design.md, "Metrics and conditions"). What cannot be determined
is written "unknown", never guessed."""
from __future__ import annotations

import os
import platform
import statistics
import subprocess
from pathlib import Path

import torch

from .. import kernels
from ..decoding.calibration import cpu_model
from ..lm.checkpoint import WEIGHTS, sha256, shown_path
from ..lm.device import UNKNOWN, cpu_features, placement
from ..lm.gguf import is_gguf
from ..lm.interface import abilities
from ..lm.model import stored_formats


def git_sha() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=Path(__file__).resolve().parent, timeout=5)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, cwd=Path(__file__).resolve().parent, timeout=5).stdout.strip()
        return out.stdout.strip() + ("+dirty" if dirty else "") if out.returncode == 0 else UNKNOWN
    except (OSError, subprocess.SubprocessError):
        return UNKNOWN


def accelerator() -> str:
    """The accelerators torch can see (whether the run uses one: "device_used"), or "none" with the
    reason; "unknown" if torch cannot be asked."""
    try:
        found = [f"cuda {torch.cuda.get_device_name(i)}" for i in range(torch.cuda.device_count())]
        if torch.backends.mps.is_available():
            found.append("mps")
        if hasattr(torch, "xpu") and torch.xpu.is_available():
            found.append("xpu")
    except (RuntimeError, AssertionError):
        return UNKNOWN
    return ", ".join(found) if found else "none (torch sees no CUDA, MPS or XPU device)"


def hardware(device: torch.device | str = "cpu") -> dict:
    """The machine, and the device the run computes on (its GPU's name and memory on CUDA)."""
    device = torch.device(device)
    used = str(device)
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        used = (f"cuda: {props.name}, {props.total_memory / 2**30:.0f} GiB, compute capability "
                f"{props.major}.{props.minor}, {props.multi_processor_count} SMs, CUDA {torch.version.cuda}")
    return {"cpu": cpu_model(), "cores": os.cpu_count() or UNKNOWN, "threads": torch.get_num_threads(),
            "cpu_features": cpu_features(), "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "accelerator": accelerator(), "device_used": used}


def software() -> dict:
    import transformers

    from .. import __version__
    return {"python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "specdec": __version__, "git": git_sha()}


def roofline(read_bandwidth_GBps: float) -> dict:
    """The machine's two roofs, measured now: fp32 FMA GFLOP/s at the threads in use (the kernels'
    register-only loop; "unknown" without kernels) and the read bandwidth."""
    peak = kernels.compiled().fma_peak(torch.get_num_threads(), 0.5) if kernels.compiled() else UNKNOWN
    return {"fma_peak_gflops": peak, "read_bandwidth_GBps": read_bandwidth_GBps,
            "isa": kernels.isa() or UNKNOWN, "threads": torch.get_num_threads()}


def matrix_parameters(model) -> int:
    """Parameters of the matrices a forward multiplies by (every Linear; not the embedding table)."""
    from ..lm.model import Linear
    return sum(m.in_features * m.out_features for m in model.modules() if isinstance(m, Linear))


def model_info(model, path: Path) -> dict:
    """A model's name, size, formats and the sha256 of its weights (a folder's model.safetensors, a
    .gguf file itself)."""
    weights = path if is_gguf(path) else path / WEIGHTS
    return {"name": path.stem if is_gguf(path) else path.name, "path": shown_path(path), "parameters": model.num_parameters(),
            "matrix_parameters": matrix_parameters(model),
            "dtype": str(placement(model).dtype).removeprefix("torch."),
            "matrices": stored_formats(model) if model.lm_head.stored is not None
            else str(model.lm_head.weight.dtype).removeprefix("torch."),
            "backend": abilities(model).backend,
            "checkpoint_sha256": sha256(weights) if weights.exists() else UNKNOWN}


def spread(values: list[float]) -> dict:
    """Median, min, max and count of repeated measurements (the spread every figure carries)."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}
