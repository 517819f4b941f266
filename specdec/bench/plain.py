"""Plain decoding speed: specdec's decoder vs transformers' `generate` on the same weights, the
same prompts, in the same run, interleaved repeat by repeat — transformers both in specdec's
arithmetic dtype (like for like) and in bf16 (its faster setting on a CPU without native bf16).
Also the memory bandwidth reached: the weight bytes one decoding step reads (every matrix except
the embedding table, of which a step reads one row) times tokens/s, as a fraction of the 47 GB/s
of DESIGN.md's build machine and of the read bandwidth measured on this machine now.
"""
from __future__ import annotations

import time
from pathlib import Path

import torch
from tqdm import tqdm

from ..api import encode_prompts, load
from ..decode import plain_generate
from ..model import compute_dtype
from ..sampling import SamplingConfig
from ..stopping import StopRule
from .conditions import hardware, model_info, software, spread
from .workloads import humaneval_prompts

MACHINE_READ_BANDWIDTH = 47e9  # bytes/s, measured on the build machine (DESIGN.md section 8)


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
    embed = model.model.embed_tokens.weight
    tied = model.lm_head.weight is embed
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    return total - (0 if tied else embed.numel() * embed.element_size())


@torch.inference_mode()
def bench_plain(target_path: str | Path | None = None, n_prompts: int = 20, repeats: int = 5,
                max_new_tokens: int = 128, dtype: torch.dtype | None = None) -> dict:
    import transformers

    target = load(target_path, dtype=dtype)
    same = compute_dtype(target.model)
    peers = {f"transformers.generate {short(d)}": d for d in dict.fromkeys([same, torch.bfloat16])}
    hfs = {}
    for name, d in peers.items():
        hfs[name] = transformers.AutoModelForCausalLM.from_pretrained(target.path, dtype=d).eval()
        hfs[name].generation_config.eos_token_id = None   # every decoder produces exactly max_new_tokens
        hfs[name].generation_config.pad_token_id = 0
    prompts = encode_prompts(target, humaneval_prompts(n_prompts), max_new_tokens)
    rule, greedy = StopRule(max_new_tokens), SamplingConfig()

    def ours(ids):
        rows, _ = plain_generate(target.model, [ids], rule, greedy)
        return rows[0].tokens

    def theirs(hf):
        def run(ids):
            out = hf.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False)
            return out[0, len(ids):].tolist()
        return run

    methods = {"specdec": ours, **{name: theirs(hf) for name, hf in hfs.items()}}
    tokens_per_s = {m: [] for m in methods}
    outputs = {}
    for fn in methods.values():
        fn(prompts[0])  # warm-up, not timed
    with tqdm(total=repeats * len(methods) * len(prompts), desc="plain decoding", unit="gen") as bar:
        for _ in range(repeats):
            for name, fn in methods.items():  # interleaved: every repeat runs both
                t0, produced = time.perf_counter(), 0
                for i, ids in enumerate(prompts):
                    out = fn(ids)
                    outputs[name, i] = out
                    produced += len(out)
                    bar.update(1)
                tokens_per_s[name].append(produced / (time.perf_counter() - t0))
    speeds = {name: spread(v) for name, v in tokens_per_s.items()}
    ours_s, like = speeds["specdec"], f"transformers.generate {short(same)}"
    fastest = max(peers, key=lambda name: speeds[name]["median"])
    bytes_per_token = weight_bytes_per_token(target.model)
    measured = measured_read_bandwidth()
    identical = {name: f"{sum(outputs['specdec', i] == outputs[name, i] for i in range(len(prompts)))}/{len(prompts)}"
                 for name in peers}
    return {
        "tokens_per_s": speeds,
        "speedup_vs_transformers": ours_s["median"] / speeds[like]["median"],
        "speedup_vs_fastest_transformers": {"peer": fastest, "speedup": ours_s["median"] / speeds[fastest]["median"]},
        "weight_bytes_per_token": bytes_per_token,
        "bandwidth_GBps": bytes_per_token * ours_s["median"] / 1e9,
        "bandwidth_fraction": bytes_per_token * ours_s["median"] / MACHINE_READ_BANDWIDTH,
        "measured_read_bandwidth_GBps": measured / 1e9,
        "bandwidth_fraction_of_measured": bytes_per_token * ours_s["median"] / measured,
        "identical_outputs": identical,
        "conditions": {
            "target": model_info(target.model, target.path),
            "method": "plain autoregressive decoding",
            "workload": {"dataset": "HumanEval", "prompts": len(prompts),
                         "prompt_tokens": [len(p) for p in prompts], "max_new_tokens": max_new_tokens,
                         "eos": "ignored (exactly max_new_tokens per prompt)"},
            "sampling": {"temperature": 0},
            "batch_size": 1,
            "repeats": repeats,
            "tokens_per_s_includes": "prefill and decoding, one prompt after another",
            "hardware": {**hardware(), "read_bandwidth_assumed_GBps": MACHINE_READ_BANDWIDTH / 1e9},
            "software": software(),
            "baseline": f"transformers generate (greedy, KV cache) on the same weights, in {short(same)} "
                        "(specdec's arithmetic) and in bfloat16",
        },
    }


def short(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def format_plain(r: dict) -> str:
    c = r["conditions"]
    rows = [f"| {'specdec plain' if name == 'specdec' else name} | {s['median']:.1f} ({s['min']:.1f}-{s['max']:.1f}) |"
            for name, s in r["tokens_per_s"].items()]
    fastest = r["speedup_vs_fastest_transformers"]
    return "\n".join([
        "| decoder | tokens/s median (min-max) |",
        "|---|---|",
        *rows,
        "",
        f"speedup vs transformers in the same dtype: {r['speedup_vs_transformers']:.2f}x; vs its fastest "
        f"({fastest['peer']}): {fastest['speedup']:.2f}x",
        f"memory bandwidth {r['bandwidth_GBps']:.1f} GB/s ({r['weight_bytes_per_token'] / 1e6:.1f} MB of weights "
        f"per token) = {100 * r['bandwidth_fraction']:.0f}% of {c['hardware']['read_bandwidth_assumed_GBps']:.0f} "
        f"GB/s, {100 * r['bandwidth_fraction_of_measured']:.0f}% of the {r['measured_read_bandwidth_GBps']:.1f} "
        f"GB/s measured on this machine now; identical outputs {r['identical_outputs']}",
        f"conditions: target {c['target']['name']} ({c['target']['parameters'] / 1e6:.1f}M params, "
        f"{c['target']['dtype']}, sha256 {c['target']['checkpoint_sha256'][:12]}), HumanEval "
        f"{c['workload']['prompts']} prompts, {c['workload']['max_new_tokens']} new tokens, greedy, batch 1, "
        f"{c['repeats']} interleaved repeats, {c['hardware']['cpu']}, {c['hardware']['threads']} threads, "
        f"torch {c['software']['torch']}, transformers {c['software']['transformers']}",
    ])
