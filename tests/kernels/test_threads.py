"""The kernels' thread policy (kernels/threads.h): auto mode runs on the cores other processes leave
free, measured from /proc; a fixed count is kept; the result never depends on the count."""
from __future__ import annotations

import os
import subprocess
import time

import pytest
import torch

from specdec import kernels

HANG = 600  # seconds: a state that never comes fails the test instead of hanging it


@pytest.fixture(autouse=True)
def policy():
    if kernels.compiled() is None:
        pytest.skip("the CPU kernels do not run here")
    before = torch.get_num_threads()
    yield
    kernels.set_threads(None)
    torch.set_num_threads(before)


def big_linear():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 1024, generator=g), torch.randn(1024, 1024, generator=g).to(torch.bfloat16)
    return x, w, kernels.Matrix.store(w)


def test_auto_mode_gives_way_to_busy_processes():
    if (os.cpu_count() or 1) < 2:
        pytest.skip("one core: there is nothing to give way")
    torch.set_num_threads(os.cpu_count())
    kernels.set_threads(None)
    x, w, packed = big_linear()
    loops = [subprocess.Popen(["sh", "-c", "while :; do :; done"]) for _ in range(os.cpu_count())]
    try:
        # until the policy has seen a window with every core taken by a loop (the state tested), however
        # long a loaded machine takes to get there; a policy that never gives way fails after HANG
        deadline = time.monotonic() + HANG
        report = kernels.thread_report()
        while report["threads"] >= os.cpu_count() and time.monotonic() < deadline:
            kernels.linear(x, w, packed)
            report = kernels.thread_report()
    finally:
        for p in loops:
            p.kill()
            p.wait()
    assert report["mode"] == "auto"
    assert report["threads"] < os.cpu_count(), report
    # it gave way for the others' cores it counted (threads = round(cores - others); others to 0.01), not
    # for a share the loops were to take: on a busy machine they get less than their cores
    assert report["other_processes_cores"] >= report["cores"] - report["threads"] - 0.51, report


def cpu_ticks() -> tuple[int, int]:
    """(niced user ticks, every other busy tick) of all CPUs since boot, from /proc/stat."""
    with open("/proc/stat") as f:
        user, nice, system, idle, iowait, irq, softirq, steal = map(int, f.readline().split()[1:9])
    return nice, user + system + irq + softirq + steal


def test_auto_mode_does_not_count_niced_processes_as_others():
    if (os.cpu_count() or 1) < 2 or os.nice(0) > 0:
        pytest.skip("needs 2 cores and this process not niced (niced processes are then its peers)")
    torch.set_num_threads(os.cpu_count())
    kernels.set_threads(None)
    x, w, packed = big_linear()
    loops = [subprocess.Popen(["nice", "-n", "19", "sh", "-c", "while :; do :; done"]) for _ in range(os.cpu_count())]
    try:
        time.sleep(0.5)
        seen, (nice0, busy0), self0, t0 = [], cpu_ticks(), os.times(), time.monotonic()
        while time.monotonic() - t0 < 3:  # ~15 of the policy's windows
            kernels.linear(x, w, packed)
            others = kernels.thread_report()["other_processes_cores"]
            if others is not None:
                seen.append(others)
        (nice1, busy1), self1, elapsed = cpu_ticks(), os.times(), time.monotonic() - t0
    finally:
        for p in loops:
            p.kill()
            p.wait()
    ticks = os.sysconf("SC_CLK_TCK") * elapsed
    niced = (nice1 - nice0) / ticks
    own = (self1.user + self1.system - self0.user - self0.system) / elapsed
    if niced < 0.5:
        pytest.skip(f"the niced loops got {niced:.2f} cores (a machine busy at normal priority): nothing to tell apart")
    # the others the policy should see: busy time at normal priority less this process's own; counting
    # the niced loops as well would add `niced` (>= 0.5 core) to the mean
    assert sum(seen) / len(seen) < max(0.0, (busy1 - busy0) / ticks - own) + niced / 2, (seen, niced)


def test_a_fixed_count_is_kept_and_the_result_does_not_depend_on_it():
    x, w, packed = big_linear()
    kernels.set_threads(1)
    one = kernels.linear(x, w, packed)
    assert kernels.thread_report()["mode"] == "fixed" and kernels.thread_report()["threads"] == 1
    kernels.set_threads(2)
    assert torch.equal(kernels.linear(x, w, packed), one)
    assert kernels.thread_report()["threads"] == 2 and torch.get_num_threads() == 2


def test_a_bad_count_is_refused():
    from specdec.errors import SpecdecError
    with pytest.raises(SpecdecError, match="threads must be >= 1"):
        kernels.set_threads(0)
