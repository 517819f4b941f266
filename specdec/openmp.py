"""OpenMP's barrier spinning, bounded before torch loads libgomp.

OpenMP threads that wait at a barrier spin before they sleep; libgomp's default (300000 spins,
milliseconds) lets a waiting thread keep the core that the thread it waits for needs whenever
another process is running. libgomp reads GOMP_SPINCOUNT once, when torch loads it, so the package
imports this module first (specdec/__init__.py); the user's own value is kept. SPIN_BOUNDED says
whether the bound took effect (kernels.thread_report). Imports nothing but the standard library.
"""
import os
import sys

SPIN_BOUNDED = "GOMP_SPINCOUNT" in os.environ or "torch" not in sys.modules
os.environ.setdefault("GOMP_SPINCOUNT", "10000")
