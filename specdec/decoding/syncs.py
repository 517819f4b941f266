"""Host syncs: the points where the host waits for values computed on the model's device, or hands
it values built from Python data. On a GPU each one stalls the host until the queued work is done
(a read) or a copy is made (a write), so a step's count of them bounds how far the host can run
ahead; on the CPU they are cheap, but the same code on a GPU would stall at every one of them.

`count_host_syncs()` counts them without changing the code it watches, so the same count is
taken before and after a change, on any device: while it is open, every read of a tensor's
values into Python (`tolist`, `item`, `int()`, `float()`, `bool()`, use as an index, `numpy`,
`cpu`) and every tensor made from Python data (`torch.tensor`, `torch.as_tensor` of a list or a
number) is counted. It patches torch while open and is for measurement, not for timed runs.
"""
from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass

import torch

READS = ("tolist", "item", "__int__", "__float__", "__bool__", "__index__", "numpy", "cpu")
WRITES = ("tensor", "as_tensor")
_LOCK = threading.Lock()


@dataclass
class HostSyncs:
    reads: int = 0   # device values read into Python
    writes: int = 0  # tensors made from Python data

    @property
    def total(self) -> int:
        return self.reads + self.writes

    def per(self, steps: int) -> dict:
        return {"reads": self.reads / steps, "writes": self.writes / steps, "total": self.total / steps}


@contextlib.contextmanager
def count_host_syncs():
    """Count host syncs (module docstring) in the block, from this thread only; yields a HostSyncs."""
    counts, thread, inside = HostSyncs(), threading.get_ident(), [False]  # a read inside another counts once

    def counted(fn, kind: str, data_check=None):
        def wrapper(*args, **kwargs):
            if inside[0] or threading.get_ident() != thread:
                return fn(*args, **kwargs)
            if data_check is None or data_check(args):
                setattr(counts, kind, getattr(counts, kind) + 1)
            inside[0] = True
            try:
                return fn(*args, **kwargs)
            finally:
                inside[0] = False
        return wrapper

    def from_python(args) -> bool:
        return bool(args) and not isinstance(args[0], torch.Tensor)

    with _LOCK:
        saved = [(torch.Tensor, name, getattr(torch.Tensor, name)) for name in READS]
        saved += [(torch, name, getattr(torch, name)) for name in WRITES]
        try:
            for owner, name, fn in saved:
                reads = owner is torch.Tensor
                setattr(owner, name, counted(fn, "reads" if reads else "writes", None if reads else from_python))
            yield counts
        finally:
            for owner, name, fn in saved:
                setattr(owner, name, fn)
