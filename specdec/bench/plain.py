"""Plain decoding speed: specdec's decoder vs transformers' `generate` on the same weights, the
same prompts, in the same run, interleaved repeat by repeat. Also the memory bandwidth reached:
the weight bytes one decoding step reads (every matrix except the embedding table, of which a
step reads one row) times tokens/s, as a fraction of the machine's read bandwidth.
"""
from __future__ import annotations

import time
from pathlib import Path

import torch
from tqdm import tqdm

from ..api import encode_prompts, load
from ..decode import plain_generate
from ..sampling import SamplingConfig
from ..stopping import StopRule
from .conditions import hardware, model_info, software, spread
from .workloads import humaneval_prompts

MACHINE_READ_BANDWIDTH = 47e9  # bytes/s, measured on the build machine (DESIGN.md section 8)


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
    hf = transformers.AutoModelForCausalLM.from_pretrained(target.path, dtype=target.model.lm_head.weight.dtype).eval()
    hf.generation_config.eos_token_id = None   # both decoders produce exactly max_new_tokens
    hf.generation_config.pad_token_id = 0
    prompts = encode_prompts(target, humaneval_prompts(n_prompts), max_new_tokens)
    rule, greedy = StopRule(max_new_tokens), SamplingConfig()

    def ours(ids):
        rows, _ = plain_generate(target.model, [ids], rule, greedy)
        return rows[0].tokens

    def theirs(ids):
        out = hf.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False)
        return out[0, len(ids):].tolist()

    methods = {"specdec": ours, "transformers.generate": theirs}
    tokens_per_s = {m: [] for m in methods}
    outputs = {}
    ours(prompts[0]), theirs(prompts[0])  # warm-up, not timed
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
    ours_s = spread(tokens_per_s["specdec"])
    hf_s = spread(tokens_per_s["transformers.generate"])
    bytes_per_token = weight_bytes_per_token(target.model)
    same = sum(outputs["specdec", i] == outputs["transformers.generate", i] for i in range(len(prompts)))
    return {
        "tokens_per_s": {"specdec": ours_s, "transformers.generate": hf_s},
        "speedup_vs_transformers": ours_s["median"] / hf_s["median"],
        "weight_bytes_per_token": bytes_per_token,
        "bandwidth_GBps": bytes_per_token * ours_s["median"] / 1e9,
        "bandwidth_fraction": bytes_per_token * ours_s["median"] / MACHINE_READ_BANDWIDTH,
        "identical_outputs": f"{same}/{len(prompts)}",
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
            "baseline": "transformers generate (greedy, KV cache) on the same weights and dtype",
        },
    }


def format_plain(r: dict) -> str:
    c = r["conditions"]
    o, h = r["tokens_per_s"]["specdec"], r["tokens_per_s"]["transformers.generate"]
    return "\n".join([
        "| decoder | tokens/s median (min-max) |",
        "|---|---|",
        f"| specdec plain | {o['median']:.1f} ({o['min']:.1f}-{o['max']:.1f}) |",
        f"| transformers generate | {h['median']:.1f} ({h['min']:.1f}-{h['max']:.1f}) |",
        "",
        f"speedup vs transformers: {r['speedup_vs_transformers']:.2f}x; memory bandwidth "
        f"{r['bandwidth_GBps']:.1f} GB/s = {100 * r['bandwidth_fraction']:.0f}% of "
        f"{c['hardware']['read_bandwidth_assumed_GBps']:.0f} GB/s ({r['weight_bytes_per_token'] / 1e6:.1f} MB "
        f"of weights per token); identical outputs {r['identical_outputs']}",
        f"conditions: target {c['target']['name']} ({c['target']['parameters'] / 1e6:.1f}M params, "
        f"{c['target']['dtype']}, sha256 {c['target']['checkpoint_sha256'][:12]}), HumanEval "
        f"{c['workload']['prompts']} prompts, {c['workload']['max_new_tokens']} new tokens, greedy, batch 1, "
        f"{c['repeats']} interleaved repeats, {c['hardware']['cpu']}, {c['hardware']['threads']} threads, "
        f"torch {c['software']['torch']}, transformers {c['software']['transformers']}",
    ])
