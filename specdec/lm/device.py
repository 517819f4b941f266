"""The device a run computes on, chosen once when its models are loaded, and the backend that goes
with it: specdec's CPU kernels (kernels/, where they run) or PyTorch's operators (SDPA attention,
matmuls in the compute dtype: bf16 on CUDA by default). Everything the engine, the proposers, the
sampler and the metrics create lives on the model's device (`placement`)."""
from __future__ import annotations

import ctypes
import gc
from pathlib import Path
from typing import NamedTuple

import torch

from ..errors import SpecdecError

DEVICES = ("cpu", "cuda")
UNKNOWN = "unknown"


class Placement(NamedTuple):
    device: torch.device  # where its parameters are, and what it creates goes
    dtype: torch.dtype    # what it computes in: its activations' and KV cache's dtype


def placement(model) -> Placement:
    """Where a model computes, and in which dtype: specdec's model or a head, a transformers model,
    or either admitted as a causal LM (interface.causal_lm; an adapter holds its transformers model
    as `model`). The dtype is that of its vectors (norm weights, biases), which stay in the compute
    dtype where its matrices are stored in bf16 for fp32 arithmetic (model.store_matrices_bf16);
    a model without vectors computes in its parameters' dtype."""
    module = model if isinstance(model, torch.nn.Module) else model.model
    params = module.parameters()
    first = next(params)
    vector = first if first.dim() == 1 else next((p for p in params if p.dim() == 1), first)
    return Placement(first.device, vector.dtype)


def resolve(name: str | torch.device | None) -> torch.device:
    """"cpu", "cuda" or "cuda:N" as a torch.device, refused with what to do where it cannot run."""
    device = torch.device(name or "cpu")
    if device.type not in DEVICES:
        raise SpecdecError(f"device {str(device)!r} is not supported: use one of {', '.join(DEVICES)} (or cuda:N)")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise SpecdecError(f"--device cuda: torch {torch.__version__} sees no CUDA GPU here (a CPU-only build, "
                               "no driver, or no GPU); run with --device cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise SpecdecError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA GPU(s), "
                               f"numbered 0..{torch.cuda.device_count() - 1}")
    return device


def default_dtype(device: torch.device) -> torch.dtype:
    """The compute dtype when none is asked for: fp32 on the CPU (the kernels compute in fp32 from
    bf16-stored matrices: exact), bf16 on CUDA (its tensor cores' matmuls)."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def synchronize(device: torch.device) -> None:
    """Wait until the work queued on `device` is done (a no-op on the CPU): before reading a clock."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def backend(device: torch.device, dtype: torch.dtype, stack=None, unstacked: str | None = None,
            stored: str = "bf16") -> str:
    """The operators a model runs on, as the conditions name them: from its device, compute dtype and,
    for specdec's own model, its kernels' Stack (or why its decoder layers are not stacked) and the
    formats its matrices are stored in (model.stored_formats)."""
    from .. import kernels
    dtype = str(dtype).removeprefix("torch.")
    floats = all(part in kernels.FLOAT_FORMATS for part in stored.replace("+", " ").split())  # no quantized one
    isa = kernels.isa() if floats else f"{kernels.isa()}; quantized: {kernels.quant_isa()}"
    if stack is not None:
        return f"specdec CPU kernels ({isa}), {dtype} arithmetic on {stored}-stored matrices"
    if unstacked is not None:  # the kernels run its matrices, not its layers
        return (f"PyTorch operators on the CPU for the decoder layers ({unstacked}), specdec CPU kernels "
                f"({isa}) for its matrices, {dtype} arithmetic on {stored}-stored matrices")
    if stored not in ("bf16", "unstored"):
        return f"PyTorch operators on the CPU ({dtype} arithmetic on {stored}-stored matrices, the kernels' numbers)"
    if device.type == "cuda":
        return f"PyTorch operators on {torch.cuda.get_device_name(device)} (SDPA attention, {dtype} matmuls)"
    return f"PyTorch operators on the CPU (SDPA attention, {dtype} matmuls)"


# CPU features that decide which kernels and which PyTorch paths run (x86 flags; ARM "Features")
FEATURES = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
            "avx512_fp16", "amx_bf16", "amx_int8", "asimd", "sve", "bf16")


def cpu_features() -> list[str] | str:
    """The FEATURES this CPU reports in /proc/cpuinfo, or "unknown" where there is none to read."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                flags = set(line.split(":", 1)[1].split())
                return [f for f in FEATURES if f in flags]
    except OSError:
        pass
    return UNKNOWN


def native_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AMX or AVX-512 BF16), where PyTorch's bf16 matmuls
    run several times faster than fp32 ones (docs/evidence/behind-the-code.md)."""
    features = cpu_features()
    return isinstance(features, list) and bool({"amx_bf16", "avx512_bf16"} & set(features))


def release_freed_memory() -> None:
    """Give the system back the heap pages a phase freed (a load's slices of rows and the file's metadata,
    a measurement's activations): collected first where they are held in reference cycles, then trimmed
    (`trim_heap`); glibc keeps them otherwise, ~0.2 GB after Qwen2.5-Coder-1.5B's load."""
    gc.collect()
    trim_heap()


def trim_heap() -> None:
    """Give the C allocator's free memory back to the system (glibc's malloc_trim; elsewhere nothing):
    what is freed goes into its arenas, which otherwise keep it resident."""
    trim = getattr(_LIBC, "malloc_trim", None)
    if trim is not None:
        trim(0)


_LIBC = ctypes.CDLL(None)
