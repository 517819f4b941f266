r"""The quantized verify curve, old kernels against new in one process: t(n), the CPU time of one target
forward over n = 1, 4, 8 new tokens after 120 cached ones, on one thread, for SmolLM2-135M-Instruct
from its Q4_1 GGUF file (`gguf`: the file's Q4_1 layers and Q8_0 unembedding as stored) or
quantized at load (`q8_0`), and t(n)/t(1).

Two copies of the model are loaded, each bound to its own build of the kernels (this checkout's, and
an old checkout's built under another module name), and their forwards alternate (old n=1, new n=1,
old n=4, ...), so that whatever else the machine runs weighs on both alike. The time is the thread's
CPU time (everything runs on the calling thread), the least of the repeats: on a shared machine that
leaves out the time spent waiting for a core, not what a busy sibling hyperthread or the memory
traffic of other jobs adds. Build the old kernels once, from a checkout of the old version in OLD,
its C++ types renamed (pybind11 registers a C++ type once per process) and under another module name:

    cp -r OLD/specdec/kernels /tmp/oldsrc
    TYPES='Shape|Stack|LayerWeights|Window|Cache|Scratch|QuantRows|Mat|QuantOps|Ops'
    sed -i -E "s/(^|[^\"A-Za-z_])($TYPES)\b/\1Old\2/g" /tmp/oldsrc/cpu.cpp /tmp/oldsrc/isa.h /tmp/oldsrc/quant.h
    python -c "from torch.utils import cpp_extension as c; c.load(name='specdec_cpu_old',
        sources=['/tmp/oldsrc/cpu.cpp'], build_directory='/tmp/old', is_python_module=False,
        extra_cflags=['-O3', '-fopenmp', '-ffp-contract=off'], extra_ldflags=['-fopenmp'])"
    PYTHONPATH=. python docs/quant-curve.py gguf avx2 8 /tmp/old/specdec_cpu_old.so

Prints one JSON line: t(n) in ms and the ratios, old and new, and t_old(1) / t_new(1).
"""
from __future__ import annotations

import importlib.util
import json
import sys
import time

import torch

from specdec import kernels
from specdec.api import default_target, load

CONTEXT, POINTS = 120, (1, 4, 8)


def old_kernels(path: str):
    spec = importlib.util.spec_from_file_location("specdec_cpu_old", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def bound(module):
    """Make `module` the kernels specdec calls (the model's Stack is bound to its own at load)."""
    kernels.compiled = lambda: module


@torch.inference_mode()
def curves(builds: list, form: str, repeats: int) -> list[dict[int, float]]:
    models = []
    for module in builds:
        bound(module)
        models.append(load(default_target(), quantize=form).model)
    g = torch.Generator().manual_seed(0)
    context = torch.randint(0, models[0].config.vocab_size, (1, CONTEXT), generator=g)
    caches = [model.new_cache(1, CONTEXT + max(POINTS)) for model in models]
    for module, model, cache in zip(builds, models, caches):
        bound(module)
        model(context, cache=cache)
    best = [{n: float("inf") for n in POINTS} for _ in builds]
    for r in range(repeats + 1):  # the first round warms up
        for n in POINTS:
            window = torch.randint(0, models[0].config.vocab_size, (1, n), generator=g)
            order = range(len(builds)) if r % 2 else reversed(range(len(builds)))
            for i in order:
                bound(builds[i])
                t0 = time.thread_time()
                models[i](window, cache=caches[i])
                elapsed = time.thread_time() - t0
                caches[i].rollback(CONTEXT)
                if r:
                    best[i][n] = min(best[i][n], elapsed)
    return best


def main() -> None:
    form, isa, repeats = sys.argv[1], sys.argv[2], int(sys.argv[3])
    torch.set_num_threads(1)
    builds = ([old_kernels(sys.argv[4])] if len(sys.argv) > 4 else []) + [kernels.compiled()]
    for module in builds:
        module.set_isa(isa)
        module.set_fixed_threads(1)
    result = {"weights": form, "quant_isa": builds[-1].quant_isa()}
    for name, t in zip(["old", "new"][-len(builds):], curves(builds, form, repeats)):
        result.update({f"{name}_t{n}_ms": round(1e3 * t[n], 3) for n in POINTS})
        result.update({f"{name}_t{n}/t1": round(t[n] / t[1], 3) for n in POINTS[1:]})
    if len(builds) == 2:
        result["t1_old/t1_new"] = round(result["old_t1_ms"] / result["new_t1_ms"], 3)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
