"""Plain decoding speed: specdec's decoder vs transformers' `generate` and, when the optional
`llama-cpp-python` is installed, llama.cpp's greedy decoding of the same weights converted to GGUF
(bf16 and f32), on the same prompts, in the same run, interleaved repeat by repeat —
transformers both in specdec's arithmetic dtype (like for like) and in bf16 (its faster setting
on a CPU without native bf16). specdec and llama.cpp report prompt evaluation and decoding apart,
so their decode-only tokens/s are compared too; transformers' figure includes its prefill.
Also the memory bandwidth reached: the weight bytes one decoding step reads (every matrix except
the embedding table, of which a step reads one row) times tokens/s, as a fraction of the build
machine's read bandwidth (MACHINE_READ_BANDWIDTH) and of the one measured on this machine now.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from .. import kernels
from ..api import checkpoint_folder, encode_prompts, load
from ..decoding.calibration import measure_verify_curve
from ..decoding.costmodel import VerifyCurve, predicted_speedup
from ..decoding.engine import plain_generate
from ..decoding.sampling import SamplingConfig
from ..decoding.stopping import StopRule
from ..errors import counted
from ..lm.checkpoint import load_model, shown_path
from ..lm.interface import admit
from ..lm.model import Linear
from . import llamacpp, sizes
from .conditions import hardware, model_info, software, spread
from .workloads import humaneval_prompts

MACHINE_READ_BANDWIDTH = 47e9  # bytes/s, the build machine's (docs/design.md, "Machines: measure on the one you have")


def measured_read_bandwidth(megabytes: int = 512, repeats: int = 7) -> float:
    """Bytes/s of summing a buffer far beyond the caches, with torch's threads (median)."""
    buffer = torch.ones(megabytes * 2 ** 20 // 4)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        buffer.sum()
        times.append(time.perf_counter() - t0)
    return buffer.numel() * 4 / sorted(times)[repeats // 2]


def weight_bytes_per_token(model) -> int:
    """The weight bytes one token reads: each matrix as the kernels store it (bf16 panels or
    quantized blocks), the rest as held; the embedding table only where it is the unembedding."""
    matrices = [m for m in model.modules() if isinstance(m, Linear) and m.stored is not None]
    stored = {id(m.weight): m.stored.nbytes for m in matrices if m.weight is not None}
    total = sum(stored.get(id(p), p.numel() * p.element_size()) for p in model.parameters())
    total += sum(m.stored.nbytes for m in matrices if m.weight is None)  # held as blocks only
    embed = model.model.embed_tokens.weight  # None: held as blocks, not among the parameters
    return total - (0 if embed is None or model.lm_head.weight is embed else embed.numel() * embed.element_size())


@dataclass
class Decoded:
    tokens: list[int]
    decode_seconds: float | None = None  # after the prompt and the first token; None: not reported apart


def llama_cpp_peers(target, prompts: list[list[int]], enabled: bool, dtypes: tuple[str, ...] = ("bf16", "f32")
                    ) -> tuple[dict, dict]:
    """llama.cpp models (GGUF in `dtypes`) on specdec's threads, each checked against specdec's
    logits on the first prompt; or none, with the reason."""
    version = llamacpp.available()
    if not enabled or version is None:
        reason = ("--no-llamacpp" if not enabled else
                  f"llama-cpp-python is not installed; install with {llamacpp.INSTALL_HINT}")
        return {}, {"status": "skipped", "reason": reason, "version": version or "absent"}
    threads = torch.get_num_threads()
    reference = target.model(torch.tensor([prompts[0]])).logits[0].float().numpy()  # (T, V)
    models, info = {}, {}
    for dtype in dtypes:
        settings = llamacpp.PEER_SETTINGS[dtype]
        model = llamacpp.LlamaCppModel(llamacpp.convert(checkpoint_folder(target.path), dtype), threads,
                                       target.model.config.max_position_embeddings, **settings)
        logits = model.logits(prompts[0])
        name = f"llama.cpp {dtype}"
        models[name] = model
        info[name] = {"gguf": shown_path(model.path), "weights": dtype, "kv_cache": settings["kv"],
                      "flash_attention": settings["flash_attn"],
                      "max_abs_logit_diff_vs_specdec": float(np.abs(logits - reference).max()),
                      "argmax_agreement_vs_specdec": float((logits.argmax(-1) == reference.argmax(-1)).mean()),
                      "logit_check_tokens": len(prompts[0])}
    return models, {"status": "ran", "version": version, "threads": threads, "models": info,
                    "sampling": "llama.cpp's greedy sampler (argmax)",
                    "eos": "ignored (exactly max_new_tokens per prompt)",
                    "input": "token ids fed directly (llama.cpp's tokenizer bypassed)"}


VERIFY_POINTS = [1, 2, 3, 4, 5, 6, 7, 8]


@torch.inference_mode()
def verify_curve(target) -> dict:
    """t(n) of the target (seconds, the median of 7 interleaved repeats after 128 cached tokens) and t(n)/t(1)."""
    curve = measure_verify_curve(target.admitted, VERIFY_POINTS)
    return {"seconds": curve.seconds, "relative": curve.relative()}


@torch.inference_mode()
def draft_predictions(size: str, curve_seconds: dict[int, float]) -> dict:
    """The cost model's speedup for each shipped draft design at target size `size`: its drafting
    seconds measured now on a random model doing one drafted token's work (sizes.draft_designs),
    k of them per step, the measured verify curve, and the per-position acceptance the design
    reached on the shipped pair (ASSUMED_ACCEPTANCE: an assumption at another size, stated)."""
    curve = VerifyCurve(curve_seconds)
    out = {}
    for name, design in sizes.draft_designs(size).items():
        drafter = load_model(sizes.build_config(f"{size}-{name}", design))
        per_token = measure_verify_curve(admit(drafter), [1]).seconds[1]
        alphas = ASSUMED_ACCEPTANCE[name]
        out[name] = {"draft_model": design.like, "draft_seconds_per_token": per_token, "k": len(alphas),
                     "assumed_acceptance_per_position": alphas, "draft_cost_ratio": per_token / curve.at(1),
                     "predicted_speedup": predicted_speedup(alphas, per_token * len(alphas), curve)}
        del drafter
    alphas = ASSUMED_ACCEPTANCE["ngram"]
    out["ngram"] = {"draft_model": "none (lookup in the prompt and output; its seconds taken as 0)",
                    "draft_seconds_per_token": 0.0, "k": len(alphas), "assumed_acceptance_per_position": alphas,
                    "draft_cost_ratio": 0.0, "predicted_speedup": predicted_speedup(alphas, 0.0, curve)}
    return out


# Per-position acceptance of each design at k = 3 on the shipped pair (22M target), HumanEval,
# greedy, batch 1, as `specdec bench` measured it (docs/evidence/bench/bench.json; EAGLE: not in that run,
# so the draft model's is assumed). At another target size it is an assumption, not a measurement.
ASSUMED_ACCEPTANCE = {"draft-model": [0.656, 0.509, 0.503], "ngram": [0.625, 0.883, 0.915],
                      "mtp": [0.797, 0.575, 0.33], "eagle": [0.656, 0.509, 0.503]}


@torch.inference_mode()
def bench_plain(target_path: str | Path | None = None, n_prompts: int = 20, repeats: int = 5,
                max_new_tokens: int = 128, dtype: torch.dtype | None = None, llama_cpp: bool = True,
                size: str | None = None, quantize: str | None = None) -> dict:
    """size: a named shape of sizes.SIZES built with random weights (instead of target_path),
    measured also for its verify curve and the cost model's predictions; llama.cpp then runs the
    bf16 and Q8_0 files (f32 instead of Q8_0 otherwise). quantize: specdec's target quantized at
    load (api.load); its peers run the checkpoint as stored."""
    import transformers

    if size is not None:
        target_path = sizes.build(size)
    target = load(target_path, dtype=dtype, quantize=quantize)
    same = target.admitted.dtype
    peers = {f"transformers.generate {short(d)}": d for d in dict.fromkeys([same, torch.bfloat16])}
    hfs = {}
    for name, d in peers.items():
        hfs[name] = transformers.AutoModelForCausalLM.from_pretrained(checkpoint_folder(target.path), dtype=d).eval()
        hfs[name].generation_config.eos_token_id = None   # every decoder produces exactly max_new_tokens
        hfs[name].generation_config.pad_token_id = 0
    prompts = encode_prompts(target, humaneval_prompts(n_prompts), max_new_tokens)
    cpps, cpp_info = llama_cpp_peers(target, prompts, llama_cpp, ("bf16", "q8_0") if size else ("bf16", "f32"))
    load_before = os.getloadavg()[0]  # a busy shared machine slows the peers unevenly: say how busy it was
    methods = decoders(target.model, hfs, cpps, max_new_tokens)
    try:
        tokens_per_s, decode_per_s, outputs = interleaved(methods, prompts, repeats)
    finally:
        for model in cpps.values():
            model.close()
    speeds = {name: spread(v) for name, v in tokens_per_s.items()}
    decode_speeds = {name: spread(v) for name, v in decode_per_s.items() if v}
    ours_s, like = speeds["specdec"], f"transformers.generate {short(same)}"
    fastest = max(peers, key=lambda name: speeds[name]["median"])
    bytes_per_token = weight_bytes_per_token(target.model)
    measured = measured_read_bandwidth()
    curve = verify_curve(target) if size else None
    predictions = draft_predictions(size, curve["seconds"]) if size else None
    load_after = os.getloadavg()[0]
    identical = {name: f"{sum(outputs['specdec', i] == outputs[name, i] for i in range(len(prompts)))}/{len(prompts)}"
                 for name in methods if name != "specdec"}
    return {
        "tokens_per_s": speeds,
        "decode_tokens_per_s": decode_speeds,
        "speedup_vs_transformers": ours_s["median"] / speeds[like]["median"],
        "speedup_vs_fastest_transformers": {"peer": fastest, "speedup": ours_s["median"] / speeds[fastest]["median"]},
        "speedup_vs_llama_cpp": {name: decode_speeds["specdec"]["median"] / decode_speeds[name]["median"]
                                 for name in cpps},
        "llama_cpp": cpp_info,
        "weight_bytes_per_token": bytes_per_token,
        "bandwidth_GBps": bytes_per_token * ours_s["median"] / 1e9,
        "bandwidth_fraction": bytes_per_token * ours_s["median"] / MACHINE_READ_BANDWIDTH,
        "measured_read_bandwidth_GBps": measured / 1e9,
        "bandwidth_fraction_of_measured": bytes_per_token * ours_s["median"] / measured,
        "decode_bandwidth_GBps": bytes_per_token * decode_speeds["specdec"]["median"] / 1e9,
        "decode_bandwidth_fraction_of_measured": bytes_per_token * decode_speeds["specdec"]["median"] / measured,
        "identical_outputs": identical,
        "verify_curve": curve,
        "draft_predictions": predictions,
        "threads": kernels.thread_report(),
        "conditions": plain_conditions(target, prompts, max_new_tokens, repeats, size, same, cpp_info,
                                       (load_before, load_after)),
    }


def decoders(model, hfs: dict, cpps: dict, max_new_tokens: int) -> dict:
    """Each decoder by name as a function of one prompt's ids to its greedy tokens (and its decoding
    seconds where it times them): specdec's plain decoding, transformers' models `hfs`, llama.cpp's `cpps`."""
    rule, greedy = StopRule(max_new_tokens), SamplingConfig()

    def ours(ids):
        rows, metrics = plain_generate(model, [ids], rule, greedy)
        return Decoded(rows[0].tokens, metrics.total_seconds - metrics.first_token_seconds)

    def theirs(hf):
        def run(ids):
            out = hf.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False)
            return Decoded(out[0, len(ids):].tolist())
        return run

    def llama(cpp):
        def run(ids):
            tokens, _, decode_seconds = cpp.generate(ids, max_new_tokens)
            return Decoded(tokens, decode_seconds)
        return run

    return {"specdec": ours, **{name: theirs(hf) for name, hf in hfs.items()},
            **{name: llama(m) for name, m in cpps.items()}}


def interleaved(methods: dict, prompts: list[list[int]], repeats: int) -> tuple[dict, dict, dict]:
    """Every decoder warmed up once, then `repeats` rounds in which each decodes every prompt in turn
    (a busy machine slows them alike): tokens/s per round, decode-only tokens/s per round where the
    decoder times its decoding, and the tokens of each (decoder, prompt)."""
    tokens_per_s = {m: [] for m in methods}
    decode_per_s = {m: [] for m in methods}
    outputs = {}
    for fn in methods.values():
        fn(prompts[0])  # warm-up, not timed
    with tqdm(total=repeats * len(methods) * len(prompts), desc="plain decoding", unit="gen") as bar:
        for _ in range(repeats):
            for name, fn in methods.items():  # interleaved: every repeat runs every decoder
                t0, produced, decoded, decode_seconds = time.perf_counter(), 0, 0, 0.0
                for i, ids in enumerate(prompts):
                    out = fn(ids)
                    outputs[name, i] = out.tokens
                    produced += len(out.tokens)
                    if out.decode_seconds is not None:
                        decoded += len(out.tokens) - 1
                        decode_seconds += out.decode_seconds
                    bar.update(1)
                tokens_per_s[name].append(produced / (time.perf_counter() - t0))
                if decode_seconds > 0:
                    decode_per_s[name].append(decoded / decode_seconds)
    return tokens_per_s, decode_per_s, outputs


def plain_conditions(target, prompts: list[list[int]], max_new_tokens: int, repeats: int, size: str | None,
                     same: torch.dtype, cpp_info: dict, load: tuple[float, float]) -> dict:
    """What `bench_plain` measured under: the target, workload, settings, hardware (with the load
    average before and after) and software."""
    load_before, load_after = load
    return {
        "size": None if size is None else {"name": size, "like": sizes.SIZES[size].like,
                                           "weights": "random (bench/sizes.py), in the user cache"},
        "target": model_info(target.model, target.path),
        "method": "plain autoregressive decoding",
        "workload": {"dataset": "HumanEval", "prompts": len(prompts),
                     "prompt_tokens": [len(p) for p in prompts], "max_new_tokens": max_new_tokens,
                     "eos": "ignored (exactly max_new_tokens per prompt)"},
        "sampling": {"temperature": 0},
        "batch_size": 1,
        "repeats": repeats,
        "tokens_per_s_includes": "prefill and decoding, one prompt after another",
        "decode_tokens_per_s_includes": "the forwards after the prompt's: (max_new_tokens - 1) tokens per "
                                        "prompt over their seconds (specdec and llama.cpp)",
        "hardware": {**hardware(), "read_bandwidth_assumed_GBps": MACHINE_READ_BANDWIDTH / 1e9,
                     "load_average_1min": {"before": load_before, "after": load_after}},
        "software": {**software(), "llama_cpp": cpp_info["version"]},
        "baseline": f"transformers generate (greedy, KV cache) on the same weights, in {short(same)} "
                    "(specdec's arithmetic) and in bfloat16; llama.cpp (greedy) on the same weights in "
                    "GGUF bf16 and f32 when installed",
    }


def short(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def format_plain(r: dict) -> str:
    c, decode = r["conditions"], r["decode_tokens_per_s"]
    ours = r["tokens_per_s"]["specdec"]["median"]

    def row(name: str, s: dict) -> str:
        d = decode.get(name)
        if name == "specdec":
            ratio, same = "1.00x", "-"
        elif d:
            ratio, same = f"{decode['specdec']['median'] / d['median']:.2f}x (decode)", r["identical_outputs"][name]
        else:
            ratio, same = f"{ours / s['median']:.2f}x (prefill+decode)", r["identical_outputs"][name]
        shown = f"{d['median']:.1f} ({d['min']:.1f}-{d['max']:.1f})" if d else "n/a (not reported apart)"
        return (f"| {'specdec plain' if name == 'specdec' else name} | {s['median']:.1f} ({s['min']:.1f}-{s['max']:.1f}) "
                f"| {shown} | {ratio} | {same} |")

    fastest, cpp = r["speedup_vs_fastest_transformers"], r["llama_cpp"]
    if cpp["status"] == "ran":
        checks = "; ".join(f"{name}: max |logit diff| vs specdec {m['max_abs_logit_diff_vs_specdec']:.2g} over "
                           f"{m['logit_check_tokens']} tokens, argmax agreement {100 * m['argmax_agreement_vs_specdec']:.0f}%, "
                           f"KV cache {m['kv_cache']}, flash attention {m['flash_attention']}" for name, m in cpp["models"].items())
        cpp_line = (f"llama.cpp {cpp['version']} (llama-cpp-python), {cpp['threads']} threads, token ids fed directly, "
                    f"greedy sampler, EOS ignored; {checks}")
    else:
        cpp_line = f"llama.cpp peer skipped: {cpp['reason']}"
    return "\n".join([
        "| decoder | tokens/s (prefill+decode) median (min-max) | decode tokens/s median (min-max) "
        "| specdec / decoder | greedy tokens = specdec |",
        "|---|---|---|---|---|",
        *[row(name, s) for name, s in r["tokens_per_s"].items()],
        "",
        f"speedup vs transformers in the same dtype: {r['speedup_vs_transformers']:.2f}x; vs its fastest "
        f"({fastest['peer']}): {fastest['speedup']:.2f}x",
        cpp_line,
        f"memory bandwidth {r['bandwidth_GBps']:.1f} GB/s ({r['weight_bytes_per_token'] / 1e6:.1f} MB of weights "
        f"per token) = {100 * r['bandwidth_fraction']:.0f}% of {c['hardware']['read_bandwidth_assumed_GBps']:.0f} "
        f"GB/s, {100 * r['bandwidth_fraction_of_measured']:.0f}% of the {r['measured_read_bandwidth_GBps']:.1f} "
        f"GB/s measured on this machine now (prefill + decode); decoding alone {r['decode_bandwidth_GBps']:.1f} GB/s = "
        f"{100 * r['decode_bandwidth_fraction_of_measured']:.0f}% of it; identical outputs {r['identical_outputs']}",
        *size_lines(r),
        f"conditions: target {c['target']['name']} ({c['target']['parameters'] / 1e6:.1f}M params, "
        f"{c['target']['dtype']} on {c['target']['matrices']} matrices, sha256 "
        f"{c['target']['checkpoint_sha256'][:12]}), HumanEval {c['workload']['prompts']} prompts, "
        f"{c['workload']['max_new_tokens']} new tokens, greedy, batch 1, "
        f"{c['repeats']} interleaved repeats, {c['hardware']['cpu']}, {c['hardware']['threads']} threads, load "
        f"average {c['hardware']['load_average_1min']['before']:.1f} before / "
        f"{c['hardware']['load_average_1min']['after']:.1f} after, "
        f"torch {c['software']['torch']}, transformers {c['software']['transformers']}, "
        f"llama.cpp {c['software']['llama_cpp']}",
    ])


def size_lines(r: dict) -> list[str]:
    """The verify curve, the cost model's predictions and the thread policy, where measured."""
    t = r["threads"]
    others = t["other_processes_cores"]  # None: not sampled (a fixed thread count, or no kernels)
    lines = [f"threads: {t['threads']} ({t['mode']}; "
             + ("" if others is None else f"other processes used {counted(others, 'core')}; ") + f"{t['omp_spin']})"]
    if r["verify_curve"]:
        rel = r["verify_curve"]["relative"]
        lines.append("verify curve t(n)/t(1): " + ", ".join(f"n={n}: {x:.2f}" for n, x in rel.items())
                     + f" (t(1) = {1000 * r['verify_curve']['seconds'][1]:.1f} ms)")
    for name, p in (r["draft_predictions"] or {}).items():
        lines.append(f"predicted {name} k={p['k']}: {p['predicted_speedup']:.2f}x (draft {1000 * p['draft_seconds_per_token']:.2f} "
                     f"ms per token = {p['draft_cost_ratio']:.3f} x t(1), {p['draft_model']}; acceptance "
                     f"{p['assumed_acceptance_per_position']} assumed from the shipped pair)")
    return lines
