"""Compiled CPU kernels for decoding with bf16-stored or block-quantized weights (Q8_0, Q4_0, Q4_1;
as GGUF files store them also f16, f32, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS) and fp32 arithmetic
(see cpu.cpp).

Built from cpu.cpp and its headers (SOURCES) by the machine's C++ compiler the first time they are
needed (about a minute, once per machine and version; cached under ~/.cache/specdec/kernels, keyed by
`cache_key`). They run on AVX-512 where the CPU has it and on AVX2 + FMA otherwise, with
bit-identical results (SPECDEC_ISA=avx2 forces AVX2; SPECDEC_KERNELS=0 turns the kernels off).
Where they cannot run (no AVX2, no compiler, gradients needed, other dtypes or devices) PyTorch
operators compute the same arithmetic, so a result never depends on whether they were built beyond
fp32 rounding.

The seam with the model: a weight is stored once, at load, as a `Matrix` (its format, shape and
the panels the kernels read); a model hands its decoder layers over as `LayerWeights` and gets one
`Stack` that runs them in a single call. The kernels know nothing else of the model's modules.
Quantized formats (blocks.py, quant.h) compute with each row's activations quantized per block
of 32 to int8; `blocks.linear` is the same arithmetic in PyTorch (same numbers, bit for bit), run
where the kernels cannot.

Threads (threads.h): by default ("auto") each call runs on the cores other processes leave free,
measured from /proc every ~0.2 s, at most torch's thread count; `set_threads(N)` fixes N
(`--threads N`). `thread_report()` says what was done, for the stats. Independently, the OpenMP
threads' spinning at barriers is bounded (GOMP_SPINCOUNT, set by specdec/openmp.py before torch
loads libgomp) so that a thread waiting for a late one soon yields its core.
"""
from __future__ import annotations

import fcntl
import functools
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from ..openmp import SPIN_BOUNDED
from ..errors import SpecdecError, counted
from . import blocks

SOURCES = [Path(__file__).with_name(name) for name in ("cpu.cpp", "types.h", "vectors.h", "isa.h", "quant.h",
                                                        "kquant.h", "threads.h", "matrices.h")]
LANES = 16  # outputs per packed panel
SLICE = 4096  # rows of a GGUF tensor unpacked at a time (Matrix.from_gguf): a whole number of panels
_EMPTY = torch.empty(0)


FLAGS = ["-O3", "-fopenmp", "-ffp-contract=off"]


@functools.cache
def compiled():
    """The built extension module, or None where it cannot be used here."""
    if os.environ.get("SPECDEC_KERNELS", "1") == "0":
        return None
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        warnings.warn("specdec: this CPU has no AVX2, so the CPU kernels cannot run; using PyTorch operators "
                      "(slower for bf16 weights, the same results).")
        return None
    try:
        module = _load_or_build()
    except Exception as e:  # no compiler or ninja: slower, same results
        warnings.warn(f"specdec: the CPU kernels could not be built ({type(e).__name__}: ...{str(e)[-600:]}); using "
                      "PyTorch operators instead, which are slower for bf16 weights. Install a C++ "
                      "compiler (g++) to get them, or set SPECDEC_KERNELS=0 to silence this.")
        return None
    if os.environ.get("SPECDEC_ISA"):
        module.set_isa(os.environ["SPECDEC_ISA"])
    return module


def cache_key() -> str:
    """What the built module depends on: the sources, the flags, the compiler, torch and Python
    (not the virtual environment's path, so environments with the same versions share a build)."""
    from torch.utils import cpp_extension
    compiler = cpp_extension.get_cxx_compiler()
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise RuntimeError(f"no working C++ compiler ({compiler}): {e}") from None
    parts = [p.read_bytes() for p in SOURCES] + [" ".join(FLAGS).encode(), version.encode(),
                                                 torch.__version__.encode(), sys.version.encode()]
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]


def build() -> str | None:
    """The running kernels' build: the `cache_key` (their sources, flags, compiler, torch, Python) of the folder
    they were loaded from, or None where they do not run: what a timing made with them depends on
    (calibration's stored curves)."""
    module = compiled()
    return Path(module.__file__).parent.name if module else None


def cache_root() -> Path:
    """Where the kernels built for each key lie."""
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "specdec" / "kernels"


def _load_or_build():
    """Load the module built for this key, or build it: in a private folder renamed into place
    when complete, under a lock that the operating system releases if its holder dies (a killed
    build leaves no lock to wait on, and its half-built folder is removed by the next one)."""
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    key = cache_key()
    built = root / key / "specdec_cpu.so"
    if not built.exists():
        with open(root / f"{key}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # another process building the same key: wait for it
            if not built.exists():
                for stale in root.glob(f"{key}.build-*"):
                    shutil.rmtree(stale, ignore_errors=True)
                print("specdec: building the CPU kernels (once per machine and version, about a minute) in "
                      f"{root / key}", file=sys.stderr)
                from torch.utils import cpp_extension
                work = Path(tempfile.mkdtemp(dir=root, prefix=f"{key}.build-"))
                cpp_extension.load(name="specdec_cpu", sources=[str(SOURCES[0])], build_directory=str(work),
                                   extra_cflags=FLAGS, extra_ldflags=["-fopenmp"], verbose=False,
                                   is_python_module=False)
                shutil.rmtree(root / key, ignore_errors=True)  # an incomplete copy, if any
                work.rename(root / key)  # the module appears whole or not at all
    spec = importlib.util.spec_from_file_location("specdec_cpu", built)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def isa() -> str | None:
    """The instruction set the kernels run on ("avx512" or "avx2"), None without kernels."""
    return compiled().isa() if compiled() else None


def quant_isa() -> str | None:
    """The instruction set the quantized kernels run on ("avx512_vnni" or "avx2"), None without kernels."""
    return compiled().quant_isa() if compiled() else None


def _inference(*tensors: torch.Tensor) -> bool:
    return all(t.device.type == "cpu" for t in tensors) and not (
        torch.is_grad_enabled() and any(t.requires_grad for t in tensors))


FORMATS = ("bf16",) + blocks.QUANTIZED  # the formats a weight can be stored in (Matrix.store)


class FloatFormat(NamedTuple):
    """A float format of panels (isa.h), as a GGUF file stores it and as the kernels run it."""
    gguf: str    # the GGML type's name
    kernel: int  # cpu.cpp's Format (types.h)
    dtype: torch.dtype


FLOAT_FORMATS = {"bf16": FloatFormat("BF16", 0, torch.bfloat16), "f16": FloatFormat("F16", 10, torch.float16),
                 "f32": FloatFormat("F32", 11, torch.float32)}
# every format a Matrix may hold -> cpu.cpp's Format (types.h)
KERNEL_FORMAT = {name: f.kernel for name, f in (FLOAT_FORMATS | blocks.BLOCK_FORMATS).items()}
GGUF_FORMATS = {f.gguf: name for name, f in (FLOAT_FORMATS | blocks.BLOCK_FORMATS).items()}  # GGML type -> format
MIXED = 7  # cpu.cpp's kMixed: runs of outputs in different quantized formats (Matrix.from_runs)
FINE = 32  # cpu.cpp's kFine: a format's flag, the matrix multiplies fine activations (Matrix.fine)


def pack(w: torch.Tensor) -> torch.Tensor:
    """A float matrix (N, K) as the kernels read it, in its dtype: panels of 16 outputs, (ceil(N/16), K, 16)."""
    N, K = w.shape
    panels = -(-N // LANES)
    padded = F.pad(w.detach(), (0, 0, 0, panels * LANES - N))
    return padded.view(panels, LANES, K).transpose(1, 2).contiguous()


class Matrix:
    """A weight matrix (N, K) stored for inference in one of FORMATS: bf16 panels of 16 outputs (`pack`),
    or blocks of 32 quantized weights (blocks.py) packed for quant.h — also, as a GGUF file stores them,
    f16 and f32 panels, Q5_0, Q5_1, IQ4_NL, and the K-quants and IQ4_XS (kquant.h), or runs of outputs in
    several of these (`from_runs`, format "q4_k+q6_k", say). What a model holds per Linear: the packed data
    alone (a run of a mixed one is a Matrix over its part of that data), the Blocks (a byte per code)
    unpacked where asked for.

    `fine`: a quantized matrix that multiplies each input row twice, as its int8 rows and as the int8
    rows of their rounding residuals, and adds the two products (blocks.fine_linear): the same weight
    bytes read once, twice the integer work, and a product within ~1e-5 of each block's largest input
    where int8 rows alone are within ~4e-3 (a drafter's unembedding, whose logits decide agreement).

    `damage`: why a file's blocks cannot run (scales or mins not finite), found while they were packed,
    or None."""

    def __init__(self, format: str, shape: tuple[int, int], data: torch.Tensor, runs: list[Matrix] | None = None,
                 fine: bool = False, damage: str | None = None):
        if fine and format in FLOAT_FORMATS:
            raise ValueError(f"fine activations are for a quantized matrix; a {format} one multiplies fp32 rows as "
                             "they are")
        self.format, self.shape, self.data, self.runs, self.fine = format, tuple(shape), data, runs, fine
        self.damage = damage
        self._reference: list[blocks.Blocks] | None = None  # unpacked by the first `reference` call, then kept

    @classmethod
    def store(cls, weight: torch.Tensor, format: str = "bf16", fine: bool = False) -> Matrix:
        """weight (N, K) in `format` (a float format's values rounded to it; quantized with llama.cpp's
        rounding: blocks.quantize), `fine` as above."""
        if format in FLOAT_FORMATS:
            return cls(format, weight.shape, pack(weight.detach().to(FLOAT_FORMATS[format].dtype)), fine=fine)
        return cls.from_blocks(blocks.quantize(weight, format), fine)

    @classmethod
    def from_blocks(cls, stored: blocks.Blocks, fine: bool = False) -> Matrix:
        """Quantized weights as stored (a GGUF file's, say), repacked exactly."""
        return cls(stored.format, stored.shape, blocks.pack(stored), fine=fine, damage=blocks.stored_error(stored))

    @classmethod
    def from_gguf(cls, raw, format: str, shape: tuple[int, int], release=None) -> Matrix:
        """A GGUF tensor's raw blocks (N rows of bytes, blocks.from_gguf) or values (a float format: its
        values, or their bytes) packed exactly, SLICE rows at a time into the matrix's panels: what is
        unpacked at once (a byte per code, and its copies) stays small beside a table of V rows, and
        nothing the size of the matrix is made beside its panels. `raw` may be a list of such arrays,
        their rows stacked (the parts of a fused matrix, of one type). release: called with each part's
        rows once they are packed (the file's pages can go: gguf_file.GGUFFile.release)."""
        N, K = shape
        parts = list(raw) if isinstance(raw, (list, tuple)) else [raw]
        data, damage = None, None
        for i in range(0, N, SLICE):
            n = min(SLICE, N - i)
            pieces = stacked_rows(parts, i, i + n)
            rows = pieces[0] if len(pieces) == 1 else np.concatenate(pieces)
            if format in FLOAT_FORMATS:
                panels = pack(float_values(rows, format, (n, K)))
            else:
                part = blocks.from_gguf(rows, format, (n, K))
                damage = damage or blocks.stored_error(part)
                panels = blocks.pack(part)
            if data is None:
                data = torch.empty((-(-N // LANES),) + tuple(panels.shape[1:]), dtype=panels.dtype)
            data[i // LANES:i // LANES + len(panels)] = panels
            for piece in pieces if release is not None else ():
                release(piece)
        return cls(format, shape, data, damage=damage)

    @classmethod
    def from_runs(cls, parts: list[blocks.Blocks]) -> Matrix:
        """The outputs of `parts` (each (N_i, K), quantized) one after another, each part as stored:
        consecutive parts of a format are merged; parts of different formats become runs (cpu.cpp's
        kMixed: a 64-byte header, int32 runs then (format, N) per run, then each run's panels), every
        run but the last a whole number of panels of 16 outputs (else ValueError)."""
        runs: list[blocks.Blocks] = []
        for part in parts:
            if runs and runs[-1].format == part.format:
                part = blocks.Blocks(part.format, *[None if a is None else torch.cat((a, b))
                                                   for a, b in zip(runs.pop()[1:], part[1:])])
            runs.append(part)
        if len(runs) == 1:
            return cls.from_blocks(runs[0])
        if len(runs) > 7 or any(run.shape[0] % LANES for run in runs[:-1]):
            raise ValueError(f"runs of {[run.shape[0] for run in runs]} outputs: at most 7, each but the last a "
                             f"multiple of {LANES}")
        header = torch.zeros(16, dtype=torch.int32)
        header[0] = len(runs)
        for i, run in enumerate(runs):
            header[1 + 2 * i], header[2 + 2 * i] = KERNEL_FORMAT[run.format], run.shape[0]
        packed = [blocks.pack(run) for run in runs]
        data = torch.cat([header.view(torch.uint8)] + [p.reshape(-1) for p in packed])
        ends = (header.numel() * 4 + torch.tensor([p.numel() for p in packed]).cumsum(0)).tolist()
        damage = next((why for why in map(blocks.stored_error, runs) if why), None)
        views = [cls(run.format, run.shape, data[end - p.numel():end].view(p.shape))
                 for run, p, end in zip(runs, packed, ends)]
        shape = (sum(run.shape[0] for run in runs), runs[0].shape[1])
        return cls("+".join(run.format for run in runs), shape, data, runs=views, damage=damage)

    def reference(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x (..., K) times the quantized matrix, transposed [+ bias], in PyTorch: blocks.linear's numbers
        (each run's, side by side). The blocks are unpacked by the first call and kept: only where the
        kernels cannot run does anything call this."""
        if self._reference is None:
            self._reference = [run.blocks() for run in self.runs or [self]]
        ends = torch.tensor([run.shape[0] for run in self._reference]).cumsum(0).tolist()
        product = blocks.fine_linear if self.fine else blocks.linear
        return torch.cat([product(x, run, None if bias is None else bias[end - run.shape[0]:end])
                          for run, end in zip(self._reference, ends)], dim=-1)

    @property
    def quantized(self) -> bool:
        return self.format not in FLOAT_FORMATS

    @property
    def kernel_format(self) -> int:
        """cpu.cpp's Format of the packed data (| FINE where it multiplies fine activations)."""
        return (MIXED if self.runs is not None else KERNEL_FORMAT[self.format]) | (FINE if self.fine else 0)

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def blocks(self) -> blocks.Blocks:
        """The blocks it holds, unpacked anew (not kept: a byte per code)."""
        self._single()
        return blocks.unpack(self.data, self.format, self.shape)

    def _single(self) -> None:
        if self.runs is not None:
            raise ValueError(f"a matrix of runs in {self.format} (a fused projection) has no single Blocks and "
                             "no rows to pick: use its runs")

    def row_blocks(self, ids: torch.Tensor) -> blocks.Blocks:
        """The Blocks of the output rows `ids` (n,) of a quantized matrix, unpacking only the panels that
        hold them (an embedding's lookup, a draft vocabulary's rows); an id outside 0..N-1 is an IndexError."""
        self._single()
        N, K = self.shape
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= N):
            raise IndexError(f"row ids {int(ids.min())}..{int(ids.max())} outside a matrix of {N} rows")
        panels = self.data.reshape(-(-N // LANES), -1)[ids // LANES]  # (n, bytes of a panel of 16 rows)
        held = blocks.unpack(panels, self.format, (len(ids) * LANES, K))
        return held.rows(torch.arange(len(ids)) * LANES + ids % LANES)

    def requantized(self, format: str) -> Matrix:
        """Its exact values quantized into `format` (llama.cpp's rounding, blocks.quantize), SLICE rows
        at a time: no float copy of a whole table is made (a tied unembedding's is 0.5 GB in fp32)."""
        N, K = self.shape
        if self.runs is not None or not self.quantized:
            return Matrix.store(self.dense().float(), format)
        slices = (torch.arange(i, min(i + SLICE, N)) for i in range(0, N, SLICE))
        return Matrix(format, self.shape, torch.cat([blocks.pack(blocks.quantize(self.row_blocks(ids).dense(), format))
                                                     for ids in slices]))

    def dense(self) -> torch.Tensor:
        """(N, K) the weights it holds, exactly: fp32 for a quantized format, else in its float format's dtype."""
        if not self.quantized:
            return self.data.transpose(1, 2).reshape(-1, self.shape[1])[:self.shape[0]]
        if self.runs is not None:
            return torch.cat([run.dense() for run in self.runs])
        return self.blocks().dense()

    def rows(self, ids: torch.Tensor) -> Matrix:
        """The output rows `ids` (N',) as a Matrix of the same format (a draft vocabulary's unembedding)."""
        if not self.quantized:
            return Matrix.store(self.dense()[ids], self.format)
        rows = self.row_blocks(ids)
        return Matrix(rows.format, rows.shape, blocks.pack(rows), fine=self.fine)


def stacked_rows(parts: list[np.ndarray], start: int, stop: int) -> list[np.ndarray]:
    """Rows start..stop of arrays stacked along their first axis, as views of the parts they lie in."""
    pieces, at = [], 0
    for part in parts:
        lo, hi = max(start - at, 0), min(stop - at, len(part))
        if lo < hi:
            pieces.append(part[lo:hi])
        at += len(part)
    return pieces


def float_values(raw, format: str, shape: tuple[int, int]) -> torch.Tensor:
    """A GGUF tensor of a float format (its values, or their bytes: N rows) as (N, K) in that format's
    dtype, bit for bit (a copy: the file's memory map stays read-only)."""
    return torch.from_numpy(np.array(raw).view(np.uint8).reshape(shape[0], -1)).view(FLOAT_FORMATS[format].dtype)


def storing_error(weight: torch.Tensor, format: str | None, given: Matrix | None = None) -> str | None:
    """Why a Linear's weight (N, K) cannot be stored in `format`, or its `given` Matrix (a file's
    blocks) run as stored, or None. bf16 (or None, nothing to store) takes any weight; a quantized
    format refuses rows that do not cut into blocks and values that are not finite."""
    if given is not None:
        return given.damage
    if format is None or format == "bf16":
        return None
    return blocks.quantizing_error(format, weight)


def linear(x: torch.Tensor, w: torch.Tensor, stored: Matrix | None = None,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w.T [+ bias] for nn.Linear's weight layout. With `stored`, w as the kernels hold it: fp32 x
    times float panels by the kernels (w None: the panels' values alone, a file's as stored); a quantized
    format always in its own arithmetic (the kernels, or blocks.linear where they cannot run: the same
    numbers)."""
    if stored is not None and x.dtype == torch.float32 and _inference(x) and compiled():
        return compiled().linear(x, stored.data, stored.kernel_format, stored.shape[0], _EMPTY,
                                 _EMPTY if bias is None else bias.detach())
    if stored is not None and stored.quantized:
        return stored.reference(x, bias).to(x.dtype)
    if w is None:
        w = stored.dense()
    return F.linear(x, w if w.dtype == x.dtype else w.to(x.dtype), bias)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == w.dtype == torch.float32 and _inference(x, w) and compiled():
        return compiled().rms_norm(x, w, eps)
    return F.rms_norm(x, x.shape[-1:], w, eps)


ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}  # cpu.cpp's Shape.activation


def cannot_stack(arch) -> str | None:
    """Why the kernels cannot run decoder layers of this architecture (model.Arch) as one call,
    or None where they can. Each attention row is reduced in 16-lane blocks of a head."""
    if arch.head_dim % LANES:
        return (f"the CPU kernels' attention needs head_dim to be a multiple of {LANES}; this model's is "
                f"{arch.head_dim}")
    gemma3 = [what for what, has in (("norms around attention and MLP", arch.sandwich_norms),
                                     ("sliding-window layers", bool(arch.local_layers)),
                                     ("a query scale of its own", arch.query_pre_attn_scalar is not None),
                                     ("soft-capped logits", arch.final_logit_softcapping is not None)) if has]
    if gemma3:
        return f"the CPU kernels' decoder layer has no {', '.join(gemma3)} (Gemma 3's)"
    return None


class LayerWeights(NamedTuple):
    """One decoder layer as the kernels read it (cpu.cpp's LayerWeights): the norms' scales (C,) as
    computed (Gemma's 1 + w), the matrices, and biases or q/k norms, None where the layer has none.
    norm1 None: EAGLE-3's layer (the first of its stack), whose qkv reads 2C-wide rows given with
    the call (draft_block) and adds its attention to the input as given."""
    norm1: torch.Tensor | None
    qkv: Matrix
    qkv_bias: torch.Tensor | None
    o: Matrix
    o_bias: torch.Tensor | None
    norm2: torch.Tensor
    gate_up: Matrix
    gate_up_bias: torch.Tensor | None
    down: Matrix
    down_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None


def stack(layers: list[LayerWeights], arch):
    """Decoder layers of architecture `arch` (lm.arch.Arch) as one kernel call: a `Stack` whose
    forward(x, k_pool, v_pool, table, layer0, lengths, positions, inv_freq, tree, keep) runs them over a
    window of new tokens (cpu.cpp)."""
    weights, formats = [], []
    for layer in layers:
        weights.append({name: (_EMPTY if value is None else value.data if isinstance(value, Matrix)
                               else value.detach().float().contiguous())
                        for name, value in layer._asdict().items()})
        formats.append({name: value.kernel_format for name, value in layer._asdict().items()
                        if isinstance(value, Matrix)})
    shape = compiled().Shape()
    shape.C, shape.H, shape.Hkv, shape.D, shape.F = (arch.hidden_size, arch.num_attention_heads,
                                                     arch.num_key_value_heads, arch.head_dim, arch.intermediate_size)
    shape.R, shape.eps, shape.rotary_factor = arch.rotary_dim, arch.rms_norm_eps, arch.attention_factor
    shape.activation = ACTIVATIONS[arch.activation]
    return compiled().Stack(weights, formats, shape)


def set_threads(n: int | None) -> None:
    """Run the kernels (and torch's own operators) on n threads, or None: auto, up to torch's
    threads, fewer while other processes hold cores. More threads than this process's cores are
    allowed, and said: they take turns on the cores."""
    if n is not None:
        if n < 1:
            raise SpecdecError(f"threads must be >= 1, got {n}")
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or n
        if n > cores:
            print(f"specdec: warning: {n} threads are more than the {counted(cores, 'core')} this process may use: "
                  f"allowed, but the threads then take turns on them, which is slower than {cores} (leave --threads "
                  "out for auto)", file=sys.stderr)
        torch.set_num_threads(n)
    if compiled():
        compiled().set_fixed_threads(n or 0)


def thread_report() -> dict:
    """What the thread policy did: mode (auto or fixed), the threads of the latest calls, the
    ceiling (torch's threads), the cores other processes used over the latest window, the
    machine's cores and whether libgomp's spinning is bounded."""
    spin = os.environ.get("GOMP_SPINCOUNT")
    report = {"mode": "pytorch", "threads": torch.get_num_threads(), "ceiling": torch.get_num_threads(),
              "other_processes_cores": None, "cores": os.cpu_count(),
              "omp_spin": f"GOMP_SPINCOUNT={spin}" + ("" if SPIN_BOUNDED else " (set after libgomp loaded: no effect)")
              if spin else "libgomp's default"}
    if compiled():
        fixed, chosen, others, cores = compiled().thread_state()
        report.update(mode="fixed" if fixed else "auto", cores=cores,
                      threads=fixed or min(chosen or report["ceiling"], report["ceiling"]),
                      other_processes_cores=None if others < 0 else round(others, 2))
    return report


def can_store_bf16() -> bool:
    """Whether fp32 arithmetic on bf16-stored matrices runs at kernel speed here."""
    return compiled() is not None


def draft_block(stack, embedding: torch.Tensor, ids: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                table: torch.Tensor, lengths: torch.Tensor, positions: torch.Tensor | None, inv_freq: torch.Tensor, columns: torch.Tensor,
                norm: torch.Tensor, eps: float, unembedding: Matrix, vocab_ids: torch.Tensor, logits: bool,
                fuse=None) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """A drafter's step as ONE kernel call (cpu.cpp's draft_block): the rows of `embedding` (V, C) for
    ids (B, W) — with `fuse` = (prev (B, W, C), embed_norm (C,), prev_norm (C,), proj): an EAGLE head's
    input proj([RMSNorm(emb); RMSNorm(prev)]), proj a Matrix; proj None for an EAGLE-3 layer (a stack
    whose LayerWeights.norm1 is None), whose q/k/v read that concatenation and whose residual is
    prev — through the decoder layers `stack`,
    their cache keys and values (pool views, blocks `table` (B, W)) written after each row's `lengths` (B,), then an RMSNorm multiplying
    by `norm` (C,) with `eps`, and the unembedding (a Matrix over the ids vocab_ids (N,)) at columns
    (B, m). Norm scales are fp32. Returns each slot's argmax as target ids (B, m), the logits (B, m, N)
    when `logits` is asked (else None), and the layers' output at the columns (B, m, C); the caller's
    cache holds W more entries per row (lm/model.py: LlamaForCausalLM.draft_block)."""
    prev, embed_norm, prev_norm, proj = (_EMPTY, _EMPTY, _EMPTY, _EMPTY_BF16) if fuse is None else (
        fuse[0].contiguous(), fuse[1], fuse[2], _EMPTY_BF16 if fuse[3] is None else fuse[3].data)
    proj_format = 0 if fuse is None or fuse[3] is None else fuse[3].kernel_format
    tokens, out, picked = compiled().draft_block(
        stack, embedding.detach(), ids.contiguous(), prev, embed_norm, prev_norm, proj, proj_format, keys, values,
        table, lengths, _EMPTY_LONG if positions is None else positions.contiguous(), inv_freq, columns.contiguous(), norm,
        eps, unembedding.data, unembedding.kernel_format, vocab_ids, logits)
    return tokens, out if logits else None, picked


_EMPTY_LONG = torch.empty(0, dtype=torch.long)
_EMPTY_BF16 = torch.empty(0, 1, 16, dtype=torch.bfloat16)
