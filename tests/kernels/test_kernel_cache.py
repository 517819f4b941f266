"""The kernels' build cache: a killed build leaves nothing to wait on, a build prints one line, and a
missing compiler or CPU feature falls back to PyTorch with one warning. Each case runs in a fresh
process with its own cache folder."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

PROBE = ("import warnings; warnings.simplefilter('always');"
         "from specdec import kernels; m = kernels.compiled(); print('MODULE', m is not None)")

# the build path of kernels.compiled() on another source: a module with nothing in it
BUILD_ONE = ("import sys; from pathlib import Path; from specdec import kernels; kernels.SOURCES = [Path(sys.argv[1])];"
             "m = kernels._load_or_build(); print('MODULE', m is not None)")
ONE_MODULE = """#include <Python.h>
static struct PyModuleDef one = {PyModuleDef_HEAD_INIT, "specdec_cpu", nullptr, -1, nullptr};
PyMODINIT_FUNC PyInit_specdec_cpu(void) { return PyModule_Create(&one); }
"""


def probe(cache, code=PROBE, *args, timeout=600, **env):
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "XDG_CACHE_HOME": str(cache), **env})


@pytest.mark.skipif(os.environ.get("SPECDEC_KERNELS") == "0", reason="the kernels are turned off (SPECDEC_KERNELS=0)")
def test_a_build_killed_while_holding_the_lock_neither_blocks_nor_leaves_debris(tmp_path, monkeypatch):
    """The build cache's locking and clean-up, on a one-line extension module built the same way
    (the kernels' own sources take ~40 s to compile; every other test builds or loads those)."""
    from specdec import kernels
    source = tmp_path / "one.cpp"
    source.write_text(ONE_MODULE)
    root = tmp_path / "specdec" / "kernels"
    root.mkdir(parents=True)
    monkeypatch.setattr(kernels, "SOURCES", [source])
    key = kernels.cache_key()
    (root / f"{key}.build-killed").mkdir()  # what a build killed half-way leaves
    (root / f"{key}.build-killed" / "cpu.o").write_bytes(b"half")
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, sys, time; f = open(sys.argv[1], 'w'); fcntl.flock(f, fcntl.LOCK_EX); "
        "print('locked', flush=True); time.sleep(600)"), str(root / f"{key}.lock")], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "locked"
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    start = time.monotonic()
    first = probe(tmp_path, BUILD_ONE, str(source))
    assert "MODULE True" in first.stdout, first.stderr
    assert first.stderr.count("building the CPU kernels") == 1
    assert not list(root.glob(f"{key}.build-*")) and (root / key / "specdec_cpu.so").exists()
    second = probe(tmp_path, BUILD_ONE, str(source))
    assert "MODULE True" in second.stdout and "building" not in second.stderr
    assert time.monotonic() - start < 600


def test_no_compiler_warns_once_and_falls_back(tmp_path):
    out = probe(tmp_path, CXX="/nonexistent/c++")
    assert "MODULE False" in out.stdout
    assert out.stderr.count("UserWarning: specdec: the CPU kernels could not be built") == 1


def test_a_cpu_without_avx2_warns_and_falls_back(tmp_path):
    out = probe(tmp_path, ATEN_CPU_CAPABILITY="default")
    assert "MODULE False" in out.stdout
    assert out.stderr.count("UserWarning: specdec: this CPU has no AVX2") == 1
