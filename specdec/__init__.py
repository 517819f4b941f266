"""specdec: lossless speculative decoding and multi-token prediction in plain PyTorch."""
import os as _os
import sys as _sys

__version__ = "0.1.0"

# OpenMP threads that wait at a barrier spin before they sleep; libgomp's default (300000 spins,
# milliseconds) lets a waiting thread keep the core that the thread it waits for needs whenever
# another process is running. Bounded here, before torch loads libgomp (which reads it once), unless
# the user chose; SPIN_BOUNDED says whether it took effect (kernels.thread_report).
SPIN_BOUNDED = "GOMP_SPINCOUNT" in _os.environ or "torch" not in _sys.modules
_os.environ.setdefault("GOMP_SPINCOUNT", "10000")
