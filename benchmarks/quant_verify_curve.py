r"""The quantized verify curve, old kernels against new in one process: t(n), the time of one target
forward over n = 1, 2, 4, 8 new tokens after 120 cached ones, for SmolLM2-135M-Instruct
from its Q4_1 GGUF file (`gguf`: the file's Q4_1 layers and Q8_0 unembedding as stored) or
quantized at load (`q8_0`), and t(n)/t(1).

Two copies of the model are loaded, each bound to its own build of the kernels (this checkout's, and
an old checkout's built under another module name), and their forwards alternate (old n=1, new n=1,
old n=4, ...), so that whatever else the machine runs weighs on both alike. On one thread the time is the thread's
CPU time (everything runs on the calling thread): on a shared machine that leaves out the time spent
waiting for a core, not what a busy sibling hyperthread or the memory traffic of other jobs adds; on
more threads it is the wall time. Both the least and the median of the repeats are printed. Build the old kernels once, from a checkout of the old version in OLD,
its C++ types renamed (pybind11 registers a C++ type once per process) and under another module name:

    cp -r OLD/specdec/kernels /tmp/oldsrc
    TYPES='Shape|Stack|LayerWeights|Window|Cache|Scratch|QuantRows|Mat|QuantOps|Ops'
    sed -i -E "s/(^|[^\"A-Za-z_])($TYPES)\b/\1Old\2/g" /tmp/oldsrc/*.cpp /tmp/oldsrc/*.h
    python -c "from torch.utils import cpp_extension as c; c.load(name='specdec_cpu_old',
        sources=['/tmp/oldsrc/cpu.cpp'], build_directory='/tmp/old', is_python_module=False,
        extra_cflags=['-O3', '-fopenmp', '-ffp-contract=off'], extra_ldflags=['-fopenmp'])"
    PYTHONPATH=. python benchmarks/quant_verify_curve.py gguf avx2 8 1 /tmp/old/specdec_cpu_old.so

(arguments: the weights, gguf or q8_0 or q4_k; the instruction set; the repeats; the threads; the old
build, if any; --model: another target than the default one, e.g. a checkpoint folder with q8_0).
Prints one JSON line: t(n) in ms and the ratios, old and new (the least of the repeats; `med_`: their
median), and t_old(1) / t_new(1).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import time

import torch

from specdec import kernels
from specdec.api import default_target, load

CONTEXT, POINTS = 120, (1, 2, 4, 8)


def old_kernels(path: str):
    spec = importlib.util.spec_from_file_location("specdec_cpu_old", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def bound(module):
    """Make `module` the kernels specdec calls (the model's Stack is bound to its own at load)."""
    kernels.compiled = lambda: module


@torch.inference_mode()
def curves(builds: list, form: str, repeats: int, threads: int, model=None) -> list[dict[int, list[float]]]:
    models = []
    for module in builds:
        bound(module)
        models.append(load(model or default_target(), quantize=form).model)
    g = torch.Generator().manual_seed(0)
    context = torch.randint(0, models[0].config.vocab_size, (1, CONTEXT), generator=g)
    caches = [model.new_cache(1, CONTEXT + max(POINTS)) for model in models]
    for module, model, cache in zip(builds, models, caches):
        bound(module)
        model(context, cache=cache)
    clock = time.thread_time if threads == 1 else time.perf_counter
    times = [{n: [] for n in POINTS} for _ in builds]
    for r in range(repeats + 1):  # the first round warms up
        for n in POINTS:
            window = torch.randint(0, models[0].config.vocab_size, (1, n), generator=g)
            order = range(len(builds)) if r % 2 else reversed(range(len(builds)))
            for i in order:
                bound(builds[i])
                t0 = clock()
                models[i](window, cache=caches[i])
                elapsed = clock() - t0
                caches[i].rollback(CONTEXT)
                if r:
                    times[i][n].append(elapsed)
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("form", help="the weights: gguf (the file as stored), q8_0 or q4_k")
    p.add_argument("isa")
    p.add_argument("repeats", type=int)
    p.add_argument("threads", type=int)
    p.add_argument("old", nargs="?", help="an old build of the kernels (a .so) to compare with")
    p.add_argument("--model", help="the target (default: the default target)")
    args = p.parse_args()
    form, isa, repeats, threads = args.form, args.isa, args.repeats, args.threads
    torch.set_num_threads(threads)
    builds = ([old_kernels(args.old)] if args.old else []) + [kernels.compiled()]
    for module in builds:
        module.set_isa(isa)
        module.set_fixed_threads(threads)
    result = {"weights": form, "quant_isa": builds[-1].quant_isa(), "threads": threads}
    for name, samples in zip(["old", "new"][-len(builds):], curves(builds, form, repeats, threads, args.model)):
        for stat, f in (("", min), ("med_", statistics.median)):
            t = {n: f(samples[n]) for n in POINTS}
            result.update({f"{stat}{name}_t{n}_ms": round(1e3 * t[n], 3) for n in POINTS})
            result.update({f"{stat}{name}_t{n}/t1": round(t[n] / t[1], 3) for n in POINTS[1:]})
    if len(builds) == 2:
        result["t1_old/t1_new"] = round(result["old_t1_ms"] / result["new_t1_ms"], 3)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
