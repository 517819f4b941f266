"""SmolLM2-135M-Instruct, specdec against llama.cpp on the same GGUF file, in one run.

    python benchmarks/vs_llama_cpp_python.py [--prompts 8] [--max-new-tokens 128] [--repeats 3]
        [--model FILE.gguf] [--out FILE] [--without-llama-cpp]

Every decoder runs the same HumanEval prompts (token ids fed directly, no tokenizer round trip),
exactly max_new_tokens tokens each (EOS ignored on both sides), prefill included in the time;
repeats are interleaved (every repeat runs every decoder) and the median tokens/s is reported.

specdec: the file's bf16 conversion (the default target), Q8_0 quantized at load, and the file's
Q4_1 blocks as stored (`--quantize gguf`); plain decoding and its drafters at `-k auto`, greedy
and at T=1 (seeded). llama.cpp (llama-cpp-python): the file as stored (Q4_1), Q8_0 and bf16
files converted from the same weights, plain greedy decoding, and the binding's prompt lookup
decoding (LlamaPromptLookupDecoding); at T=1 llama.cpp's cost per token is its greedy one (its
sampler is not the cost), so its greedy figure stands for both.

Writes docs/evidence/llamacpp.json (or --out) and prints a markdown table with the conditions.
--without-llama-cpp runs specdec's side alone (where llama-cpp-python is not installed), and says so.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from specdec import api, kernels
from specdec.bench import llamacpp
from specdec.bench.conditions import hardware, software
from specdec.bench.workloads import humaneval_prompts
from specdec.decoding.engine import plain_generate
from specdec.decoding.engine import speculative_generate
from specdec.decoding.sampling import SamplingConfig
from specdec.decoding.stopping import StopRule
from specdec.errors import SpecdecError

OUT = Path(__file__).resolve().parents[1] / "docs" / "evidence" / "llamacpp.json"
LOOKUP_KS = (3, 10)  # the binding's num_pred_tokens: a short draft and its default


def specdec_runner(target, proposer, temperature: float, max_new_tokens: int):
    sampling, rule = SamplingConfig(temperature=temperature, seed=None), StopRule(max_new_tokens)

    def run(ids: list[int], seed: int) -> tuple[list[int], dict]:
        generator = torch.Generator().manual_seed(seed)
        if proposer is None:
            rows, _ = plain_generate(target.model, [ids], rule, sampling, generator)
            return rows[0].tokens, {}
        rows, metrics = speculative_generate(target.model, proposer, [ids], rule, sampling, "auto", generator)
        return rows[0].tokens, {"accepted": metrics.accepted, "proposed": metrics.proposed, "steps": metrics.steps}
    return run


def llama_runner(model, max_new_tokens: int):
    def run(ids: list[int], seed: int) -> tuple[list[int], dict]:
        tokens, _, _ = model.generate(ids, max_new_tokens)
        return tokens, {}
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--methods", nargs="+", default=["ngram", "suffix", "eagle", "self"])
    parser.add_argument("--model", help="a .gguf file (default: the default target's)")
    parser.add_argument("--out", default=str(OUT))
    parser.add_argument("--without-llama-cpp", action="store_true", help="specdec's side only")
    args = parser.parse_args()
    gguf = args.model or api.default_target()
    threads = torch.get_num_threads()
    targets = {"bf16": api.load(gguf, quantize="bf16"), "q8_0": api.load(gguf, quantize="q8_0"),
               "q4_1 (the file, as stored)": api.load(gguf, quantize="gguf")}
    bf16 = targets["bf16"]
    prompts = api.encode_prompts(bf16, humaneval_prompts(args.prompts), args.max_new_tokens)
    n = args.max_new_tokens
    runners, info, plain_of = {}, {}, {}  # plain_of: a greedy speculative decoder -> its target's plain one
    for fmt, target in targets.items():
        for temperature in (0.0, 1.0):
            plain = f"specdec {fmt} plain T={temperature:g}"
            runners[plain] = specdec_runner(target, None, temperature, n)
            for method in args.methods:
                if method == "eagle" and target is not bf16:
                    continue  # the head is trained for (and tied to) the bf16 target
                try:
                    proposer = api.load_drafter(target, method)
                except SpecdecError as e:  # a drafter that does not fit this target is named, not hidden
                    info[f"specdec {fmt} {method}"] = f"skipped: {e}"
                    continue
                name = f"specdec {fmt} {method} auto T={temperature:g}"
                runners[name] = specdec_runner(target, proposer, temperature, n)
                if temperature == 0:
                    plain_of[name] = plain
    if not args.without_llama_cpp:
        files = {"q4_1 (the file)": Path(gguf), "q8_0": llamacpp.convert(api.checkpoint_folder(gguf), "q8_0"),
                 "bf16": llamacpp.convert(api.checkpoint_folder(gguf), "bf16")}
        context = max(map(len, prompts)) + n + 16
        for fmt, path in files.items():
            runners[f"llama.cpp {fmt} plain"] = llama_runner(llamacpp.LlamaCppModel(path, threads, context, kv="f16",
                                                                                    flash_attn="auto"), n)
        for k in LOOKUP_KS:
            runners[f"llama.cpp q4_1 (the file) prompt lookup k={k}"] = llama_runner(
                llamacpp.LlamaCppLookup(files["q4_1 (the file)"], threads, context, k), n)
    for run in runners.values():  # warm-up, not timed (kernels built, verify curves measured)
        run(prompts[0], 0)
    speeds = {name: [] for name in runners}
    stats = {name: {} for name in runners}
    outputs = {}
    for repeat in range(args.repeats):
        for name, run in runners.items():
            t0, total = time.perf_counter(), {}
            for i, ids in enumerate(prompts):
                tokens, s = run(ids, 1000 * repeat + i)
                outputs[name, i] = tokens
                for key, v in s.items():
                    total[key] = total.get(key, 0) + v
            speeds[name].append(len(prompts) * n / (time.perf_counter() - t0))
            stats[name] = total
            print(f"repeat {repeat + 1}/{args.repeats} {name}: {speeds[name][-1]:.1f} tok/s", flush=True)
    greedy_equal = {name: all(outputs[name, i] == outputs[plain, i] for i in range(len(prompts)))
                    for name, plain in plain_of.items()}
    result = {"conditions": {"hardware": hardware(), "software": software(), "threads": threads,
                             "kernels": kernels.isa(), "python": platform.python_version(),
                             "llama_cpp_python": "not run (--without-llama-cpp)" if args.without_llama_cpp
                             else llamacpp.available(), "prompts": len(prompts),
                             "prompt_tokens": [len(p) for p in prompts], "max_new_tokens": n,
                             "repeats": args.repeats, "workload": "HumanEval prompts 0..N-1, in order",
                             "eos": "ignored: exactly max_new_tokens per prompt, on every side"},
              "tokens_per_s": {name: {"median": statistics.median(v), "min": min(v), "max": max(v)}
                               for name, v in speeds.items()},
              "acceptance": {name: s for name, s in stats.items() if s}, "skipped": info,
              "greedy_identical_to_plain": greedy_equal}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    best_llama = max((v["median"] for name, v in result["tokens_per_s"].items() if name.startswith("llama.cpp")),
                     default=None)
    print(f"\n| decoder | tokens/s (median of {args.repeats}) | min-max | vs llama.cpp's best |\n|---|---|---|---|")
    for name, v in sorted(result["tokens_per_s"].items(), key=lambda kv: -kv[1]["median"]):
        versus = f"{v['median'] / best_llama:.2f}x" if best_llama else "-"
        print(f"| {name} | {v['median']:.1f} | {v['min']:.1f}-{v['max']:.1f} | {versus} |")
    print(json.dumps({"greedy_identical_to_plain": greedy_equal, "skipped": info}))


if __name__ == "__main__":
    main()
