"""specdec against llama.cpp's own programs (its native build), interleaved, in one run.

    python benchmarks/vs_llamacpp_native.py --llama-cpp LLAMA_BUILD/bin [--rounds 3] [--new-tokens 128]
    python benchmarks/vs_llamacpp_native.py --llama-cpp LLAMA_BUILD/bin --pair [--prompts 3] [--draft-max 5]

Default: SmolLM2-135M-Instruct in three forms (the pip file's Q4_1 blocks as stored, Q8_0, bf16).
Decoding speed as `llama-bench -p 0 -n N` measures it: N tokens from an empty context (specdec: after
a one-token prompt, greedy, EOS ignored), one run per round per decoder, rounds interleaved, median.
llama.cpp reads the same Q4_1 file, a bf16 file written from the same weights and its own Q8_0 of
that bf16 file (`llama-quantize`); specdec reads the Q4_1 file as stored and quantizes its bf16
conversion to Q8_0 at load.

--pair: Qwen2.5-Coder-1.5B-Instruct drafted by Qwen2.5-Coder-0.5B-Instruct (`specdec pair install`),
both as stored (Q4_K_M). Decoding speed as above, then HumanEval prompts greedy: llama.cpp's
speculative decoding (`llama-speculative-simple`, drafts up to --draft-max) and its prompt lookup
(`llama-lookup`) against specdec plain, specdec's draft-model speculation (`-k auto` and k =
--draft-max; the draft's vocabulary and stopping rule from --draft-vocab and --stop-below), suffix
lookup and the hybrid (suffix lookup on matches of 5 tokens or more, the draft model elsewhere),
each lookup starting every request afresh; decoding time only, prompts' encoding excluded on both
sides. Greedy outputs are checked against plain decoding. Also the acceptance of specdec's drafts
per position, and a plot: tokens/s per decoder, α per position.

Prints the figures and writes docs/evidence/llamacpp-native[-pair].json (or --out's name there, or
--out's path), with --pair also its plot (the same name, .png). --model (default: the default target)
and --target / --draft (default: the packaged pair) name other GGUF files. It needs llama.cpp's
programs: the test suite runs its own parts only.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from specdec import api, kernels
from specdec.bench import llamacpp, llamacpp_native
from specdec.bench.conditions import hardware, software
from specdec.bench.workloads import humaneval_prompts
from specdec.decoding.engine import plain_generate, speculative_generate
from specdec.decoding.pipeline import stop_rule
from specdec.decoding.sampling import SamplingConfig
from specdec.decoding.stopping import StopRule
from specdec.lm import packaged
from specdec.proposers.drafters import DraftModelOptions

EVIDENCE = Path(__file__).resolve().parents[1] / "docs" / "evidence"
GREEDY = SamplingConfig()


def specdec_decode_speed(target, n: int) -> float:
    """Tokens/s of n greedy tokens after a one-token prompt (its prefill included: ~1/n)."""
    first = target.tokenizer.encode("def")[:1]
    t0 = time.perf_counter()
    plain_generate(target.model, [first], StopRule(n), GREEDY)
    return n / (time.perf_counter() - t0)


def rounds(runners: dict, count: int) -> dict:
    """Every runner once per round, rounds interleaved; the median and range of each."""
    speeds = {name: [] for name in runners}
    for r in range(count):
        for name, run in runners.items():
            speeds[name].append(run())
            print(f"round {r + 1}/{count} {name}: {speeds[name][-1]:.1f} tok/s", flush=True)
    return {name: {"median": statistics.median(v), "min": min(v), "max": max(v), "all": v}
            for name, v in speeds.items()}


def smollm2(bin_dir: Path, threads: int, n: int, count: int, gguf=None) -> dict:
    gguf = gguf or api.default_target()
    bf16 = api.load(gguf, quantize="bf16")
    bf16_file = llamacpp.convert(api.checkpoint_folder(gguf), "bf16")
    files = {"q4_1 (the file)": Path(gguf), "q8_0": llamacpp_native.quantize(
        bin_dir, bf16_file, bf16_file.with_name(bf16_file.stem + "-q8_0-native.gguf")), "bf16": bf16_file}
    targets = {"q4_1 (the file)": api.load(gguf, quantize="gguf"), "q8_0": api.load(gguf, quantize="q8_0"),
               "bf16": bf16}
    runners = {}
    for fmt in files:
        target, path = targets[fmt], files[fmt]
        specdec_decode_speed(target, 8)  # warm-up: kernels built
        runners[f"specdec {fmt}"] = lambda t=target: specdec_decode_speed(t, n)
        runners[f"llama.cpp {fmt}"] = lambda p=path: llamacpp_native.decode_speed(bin_dir, p, threads, n)
    result = rounds(runners, count)
    table = [(fmt, result[f"specdec {fmt}"]["median"] / result[f"llama.cpp {fmt}"]["median"]) for fmt in files]
    return {"tokens_per_s": result, "specdec / llama.cpp": dict(table)}


def pair(bin_dir: Path, threads: int, n: int, count: int, prompts: int, draft_max: int,
         options: DraftModelOptions, target_name: str = "qwen2.5-coder-1.5b",
         draft_name: str = "qwen2.5-coder-0.5b") -> dict:
    target_file, draft_file = packaged.resolve(target_name), packaged.resolve(draft_name)
    target = api.load(target_name, quantize="gguf")
    proposer = api.load_drafter(target, "draft-model", draft_name, options)
    specdec_decode_speed(target, 4)
    speeds = rounds({"specdec plain": lambda: specdec_decode_speed(target, n),
                     "llama.cpp plain": lambda: llamacpp_native.decode_speed(bin_dir, Path(target_file), threads, n)},
                    count)
    texts = humaneval_prompts(prompts)
    ids = [target.tokenizer.encode(t) for t in texts]
    rule = stop_rule(target.tokenizer, n)  # the model's own end-of-generation set, as llama.cpp's programs stop

    def ours(drafter, k, i):
        """specdec's tokens and decoding seconds: the time of the whole request less that of a
        one-token request (the prompt's prefill and first token), as llama.cpp reports it. Suffix
        lookup starts each request from an empty trie: it looks up the prompt and the answer so far,
        as llama-lookup does, never another request's text."""
        timed = []
        for rule_ in (StopRule(1), rule):
            if hasattr(drafter, "forget"):
                drafter.forget()
            t0 = time.perf_counter()
            rows, m = speculative_generate(target.model, drafter, [ids[i]], rule_, GREEDY, k)
            timed.append(time.perf_counter() - t0)
        return rows[0].tokens, timed[1] - timed[0], m.accepted, m.proposed, m

    results, outputs, counted = {}, {}, {}  # counted: each drafter's counters, its requests' added up
    decoders = (("specdec plain", None, 0), ("specdec draft-model auto", proposer, "auto"),
                (f"specdec draft-model k={draft_max}", proposer, draft_max),
                ("specdec suffix auto", api.load_drafter(target, "suffix"), "auto"),
                ("specdec hybrid auto", api.load_drafter(target, "hybrid", draft_name, options), "auto"))
    fallback = llamacpp_native.Fallback()
    peers = {"llama.cpp speculative": lambda prompt_file: fallback("llama-speculative-simple", lambda extra:
                 llamacpp_native.speculative(bin_dir, Path(target_file), Path(draft_file), prompt_file, n, draft_max,
                                             threads, extra)),
             "llama.cpp lookup": lambda prompt_file: fallback("llama-lookup", lambda extra: llamacpp_native.lookup(
                 bin_dir, Path(target_file), prompt_file, n, draft_max, threads, extra))}
    for _, drafter, k in decoders:  # warm-up, not timed: the verify curve `-k auto` measures once, the kernels
        ours(drafter, k, 0)
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(count):
            for i, text in enumerate(texts):
                prompt_file = Path(tmp) / f"prompt{i}.txt"
                prompt_file.write_text(text)
                for name, peer in peers.items():
                    spec = peer(prompt_file)
                    results.setdefault(name, []).append((spec.decoded, spec.seconds, spec.accepted, spec.drafted))
                for name, drafter, k in decoders:
                    tokens, seconds, accepted, proposed, m = ours(drafter, k, i)
                    outputs[name, i] = tokens
                    results.setdefault(name, []).append((len(tokens) - 1, seconds, accepted, proposed))
                    if drafter is not None:
                        counted[name] = counted[name] + m if name in counted else m
                print(f"round {r + 1}/{count} prompt {i}: " + ", ".join(
                    f"{name} {v[-1][0] / v[-1][1]:.2f} tok/s" for name, v in results.items()), flush=True)
    per_round = {name: [sum(t for t, *_ in v[r * prompts:(r + 1) * prompts]) /
                        sum(s for _, s, *_ in v[r * prompts:(r + 1) * prompts]) for r in range(count)]
                 for name, v in results.items()}
    identical = {name: all(outputs[name, i] == outputs["specdec plain", i] for i in range(prompts))
                 for name, _ in outputs if name != "specdec plain"}
    return {"decode tokens_per_s": speeds,
            "humaneval tokens_per_s": {name: {"median": statistics.median(v), "all": v} for name, v in per_round.items()},
            "acceptance": {name: [sum(a for *_, a, _ in v), sum(p for *_, p in v)] for name, v in results.items()},
            "acceptance per position": {name: [round(a, 4) for a in m.acceptance_per_position if a is not None]
                                        for name, m in counted.items()},
            "greedy identical to specdec plain": identical,
            "peer failures": fallback.failures,
            "files": {"target": str(Path(target_file).name), "draft": str(Path(draft_file).name)}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--llama-cpp", help=f"llama.cpp's build/bin folder (default ${llamacpp_native.ENV})")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--pair", action="store_true")
    p.add_argument("--prompts", type=int, default=3)
    p.add_argument("--draft-max", type=int, default=5)
    p.add_argument("--draft-vocab", default="auto", help="--pair: the draft's vocabulary (auto: the cost model's "
                   "size; full: all of it; or a number of ids)")
    p.add_argument("--stop-below", type=float, default=0.3, help="--pair: end a draft chain after a draft whose "
                   "probability is below this (0: never)")
    p.add_argument("--out", help="the JSON's name in docs/evidence (default llamacpp-native[-pair].json), or a path")
    p.add_argument("--model", help="the GGUF file (default: the default target's)")
    p.add_argument("--target", default="qwen2.5-coder-1.5b", help="--pair: the target's file or packaged name")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b", help="--pair: the draft's")
    args = p.parse_args()
    bin_dir, threads = llamacpp_native.binaries(args.llama_cpp), torch.get_num_threads()
    if args.pair:
        vocab = None if args.draft_vocab == "full" else args.draft_vocab if args.draft_vocab == "auto" else int(
            args.draft_vocab)
        options = DraftModelOptions(draft_vocab=vocab, stop_below=args.stop_below or None)
        figures = pair(bin_dir, threads, args.new_tokens, args.rounds, args.prompts, args.draft_max, options,
                       args.target, args.draft)
    else:
        figures = smollm2(bin_dir, threads, args.new_tokens, args.rounds, args.model)
    conditions = {"hardware": hardware(), "software": software(), "threads": threads, "kernels": kernels.isa(),
                  "quant kernels": kernels.quant_isa(), "llama.cpp": llamacpp_native.build(bin_dir),
                  "new tokens": args.new_tokens, "rounds": args.rounds,
                  **({"draft options": {"draft_vocab": options.draft_vocab, "stop_below": options.stop_below}}
                     if args.pair else {})}
    out = EVIDENCE / (args.out or f"llamacpp-native{'-pair' if args.pair else ''}.json")
    out.write_text(json.dumps({"conditions": conditions, **figures}, indent=1))
    print(json.dumps(figures, indent=1))
    print(f"written: {out}")
    if args.pair:
        plot_pair(figures, out.with_suffix(".png"))
        print(f"written: {out.with_suffix('.png')}")


def plot_pair(figures: dict, path: Path) -> None:
    """Two panels: HumanEval tokens/s per decoder (median, the rounds' range as a bar), specdec's and
    llama.cpp's; α per draft position of each specdec drafter."""
    import matplotlib
    import matplotlib.ticker
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    speeds = figures["humaneval tokens_per_s"]
    names = sorted(speeds, key=lambda n: speeds[n]["median"])
    fig, (bars, alphas) = plt.subplots(1, 2, figsize=(12, 4.2))
    medians = [speeds[n]["median"] for n in names]
    low = [m - min(speeds[n]["all"]) for n, m in zip(names, medians)]
    high = [max(speeds[n]["all"]) - m for n, m in zip(names, medians)]
    bars.barh(names, medians, xerr=[low, high], color=["tab:blue" if n.startswith("specdec") else "tab:gray"
                                                     for n in names])
    bars.set_xlabel("tokens/s (HumanEval greedy, median of rounds)")
    for y, (m, h) in enumerate(zip(medians, high)):
        bars.text(m + h, y, f" {m:.1f}", va="center")
    for name, alpha in figures["acceptance per position"].items():
        alphas.plot(range(1, len(alpha) + 1), alpha, marker="o", label=name.removeprefix("specdec "))
    alphas.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    alphas.set_xlabel("draft position")
    alphas.set_ylabel("α at that position (accepted / reached)")
    alphas.set_ylim(0, 1.05)
    alphas.legend(fontsize=8)
    fig.suptitle(f"Qwen2.5-Coder-1.5B drafted by 0.5B, Q4_K_M as stored: specdec vs llama.cpp "
                 f"({figures['files']['target']})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
