"""A GGUF file mapped into memory: its metadata read once, its tensors as views of the mapped bytes.

The layout (llama.cpp's gguf.h, versions 2 and 3, little-endian): the magic "GGUF", the version, the
tensor and key counts, the keys with their typed values, each tensor's name, dims, type and offset,
then the tensors' data from an aligned start (`general.alignment`, default 32). Reading it costs the
header only: a tensor's `data` is a read-only numpy view of the file's mapped pages, so nothing is
copied until someone copies it, and processes mapping the same file share the page cache; `release`
lets this process's pages of a tensor go once it holds a copy in its own layout. A string
array (a vocabulary, its merges) is walked once, in Python, without numpy per element: the `gguf`
package's GGUFReader makes one array per element, seconds for a 150k-token vocabulary.

Tensors keep the `gguf` package's conventions, so that code written for GGUFReader reads these:
`shape` in GGUF order (fastest dim first), `data` in numpy order, of the float or integer dtype for
F32, F16, F64 and the integer types, else uint8 rows of the type's blocks (bytes per row last).

This module knows nothing about models or tokenizers.
"""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
# GGUF value types: the fixed-size ones by struct format; 8 is a string, 9 an array
SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8",
         12: "<f8"}
STRING, ARRAY = 8, 9
# GGML types read as numpy values rather than blocks (the gguf package's ReaderTensor.data)
VALUES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16,
          "I32": np.int32, "I64": np.int64}


@dataclass(frozen=True)
class Tensor:
    """One tensor of the file, as the gguf package's ReaderTensor holds it."""
    name: str
    tensor_type: object        # gguf.GGMLQuantizationType
    shape: tuple[int, ...]     # GGUF order: the fastest-varying dim first
    n_bytes: int
    data: np.ndarray           # a read-only view of the mapped file (see the module docstring)


class GGUFFile:
    """The metadata (`fields`: key -> value, strings as str, arrays as lists) and the tensors of a
    GGUF file; ValueError for a file that is not one (truncated, corrupt, another format)."""

    def __init__(self, path: str | Path):
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        self.path = Path(path)
        with open(self.path, "rb") as f:
            self.map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if self.path.stat().st_size else b""
        self.pos = 0
        if self.read(4) != MAGIC:
            raise ValueError("no GGUF magic at the start")
        version = self.scalar("<I")
        if version not in VERSIONS:
            raise ValueError(f"GGUF version {version} (big-endian, or not 2 or 3)")
        n_tensors, n_keys = self.scalar("<Q"), self.scalar("<Q")
        self.fields: dict = {}
        for _ in range(n_keys):
            key = self.string()
            self.fields[key] = self.value(self.scalar("<I"))
        infos = []
        for _ in range(n_tensors):
            name = self.string()
            dims = tuple(self.scalar("<Q") for _ in range(self.scalar("<I")))
            infos.append((name, dims, self.scalar("<I"), self.scalar("<Q")))
        alignment = int(self.fields.get("general.alignment", DEFAULT_ALIGNMENT))
        start = -(-self.pos // alignment) * alignment
        size = len(self.map)
        values = np.frombuffer(self.map, np.uint8)  # read-only views of the one mapping (`release`)
        self.tensors: list[Tensor] = []
        for name, dims, type_id, offset in infos:
            qtype = GGMLQuantizationType(type_id)
            block, type_size = GGML_QUANT_SIZES[qtype]
            count = int(np.prod(dims, dtype=np.int64))
            n_bytes = count * type_size // block
            at = start + offset
            if at + n_bytes > size:
                raise ValueError(f"tensor {name} has {max(size - at, 0)} of its {n_bytes} bytes")
            shape = tuple(reversed(dims))
            raw = values[at:at + n_bytes]
            if qtype.name in VALUES:
                data = raw.view(VALUES[qtype.name]).reshape(shape)
            else:
                if shape[-1] % block:
                    raise ValueError(f"tensor {name} has rows of {shape[-1]} values, not whole {qtype.name} blocks")
                data = raw.reshape(*shape[:-1], shape[-1] // block * type_size)
            self.tensors.append(Tensor(name, qtype, dims, n_bytes, data))
        if len({t.name for t in self.tensors}) != len(self.tensors):
            raise ValueError("two tensors share a name")

    def release(self, data: np.ndarray | None = None) -> None:
        """Let go of this process's resident pages of `data` (a tensor's view of the map), or of the whole
        file: a tensor copied into another layout (a model's packed blocks) need not keep the file's pages
        beside the copy. Nothing changes for a reader: a page read again comes back from the page cache.
        Memory that is not the map's (a tensor's copy, its rows reordered) is left alone."""
        if not len(self.map) or not hasattr(mmap, "MADV_DONTNEED"):
            return
        start, end = 0, len(self.map)
        if data is not None:
            if not data.flags.c_contiguous:
                return
            start = data.ctypes.data - np.frombuffer(self.map, np.uint8).ctypes.data
            end = start + data.nbytes
            if not 0 <= start <= end <= len(self.map):
                return
        start -= start % mmap.PAGESIZE  # whole pages: a neighbour's page dropped too comes back when read
        if end > start:
            self.map.madvise(mmap.MADV_DONTNEED, start, end - start)

    def read(self, n: int) -> bytes:
        if self.pos + n > len(self.map):
            raise ValueError("the header ends early (truncated)")
        out = self.map[self.pos:self.pos + n]
        self.pos += n
        return out

    def scalar(self, form: str):
        return struct.unpack(form, self.read(struct.calcsize(form)))[0]

    def string(self) -> str:
        return self.read(self.scalar("<Q")).decode("utf-8")

    def value(self, kind: int):
        if kind in SCALARS:
            return self.scalar(SCALARS[kind])
        if kind == STRING:
            return self.string()
        if kind != ARRAY:
            raise ValueError(f"unknown GGUF value type {kind}")
        item, count = self.scalar("<I"), self.scalar("<Q")
        if item in NUMPY:
            width = np.dtype(NUMPY[item]).itemsize
            return np.frombuffer(self.read(count * width), NUMPY[item]).tolist()
        if item == STRING:
            return self.strings(count)
        return [self.value(item) for _ in range(count)]

    def strings(self, count: int) -> list[str]:
        """`count` strings in a row, walked without a call per field (a vocabulary: 150k of them)."""
        data, pos, out = self.map, self.pos, []
        end = len(data)
        unpack = struct.Struct("<Q").unpack_from
        for _ in range(count):
            if pos + 8 > end:
                raise ValueError("the header ends early (truncated)")
            n = unpack(data, pos)[0]
            pos += 8
            if pos + n > end:
                raise ValueError("the header ends early (truncated)")
            out.append(data[pos:pos + n].decode("utf-8"))
            pos += n
        self.pos = pos
        return out
