"""specdec: lossless speculative decoding and multi-token prediction in plain PyTorch."""
from . import openmp as _openmp  # noqa: F401  (bounds OpenMP's barrier spinning before anything loads torch)

__version__ = "0.1.0"
