"""Measured verify-cost curves: the seconds of one target forward over n new tokens per row after
a cached context, the curve the cost model (costmodel.py) needs; and the same curve for a small
mixture-of-experts target against a dense model of the same active size, next to the
expert-activation estimate of docs/design.md, "The cost model".

The MoE and dense models are built from transformers configs with random weights (untrained is
fine: only their cost curves matter) and run through the same code path (hf_adapter).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from ..decoding.calibration import measure_verify_curve
from ..decoding.costmodel import moe_distinct_experts, moe_verify_ratio
from ..lm.interface import admit

EXPERTS_IMPLEMENTATION = "eager"


@dataclass(frozen=True)
class MoESpec:
    """A small Mixtral-style target and the dense Llama with the same active parameters (its MLP
    is top_k experts wide)."""
    hidden_size: int = 384
    expert_intermediate_size: int = 1024
    num_experts: int = 8
    top_k: int = 2
    num_layers: int = 6
    num_heads: int = 6
    num_kv_heads: int = 2
    vocab_size: int = 16384


def build_moe_and_dense(spec: MoESpec, dtype: torch.dtype = torch.float32):
    from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

    common = dict(vocab_size=spec.vocab_size, hidden_size=spec.hidden_size, num_hidden_layers=spec.num_layers,
                  num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads,
                  max_position_embeddings=1024, tie_word_embeddings=False)
    with torch.random.fork_rng(devices=[]):  # seeded weights; the caller's random stream is left as it was
        torch.manual_seed(0)
        moe = MixtralForCausalLM(MixtralConfig(intermediate_size=spec.expert_intermediate_size,
                                               num_local_experts=spec.num_experts,
                                               num_experts_per_tok=spec.top_k, **common))
        dense = LlamaForCausalLM(LlamaConfig(intermediate_size=spec.top_k * spec.expert_intermediate_size, **common))
    # a loop over the experts the tokens were routed to: its cost follows the distinct experts touched
    # (transformers' default here, "grouped_mm", took over a second for 2 tokens on the 2-core CPU)
    moe.set_experts_implementation(EXPERTS_IMPLEMENTATION)
    return moe.to(dtype).eval(), dense.to(dtype).eval()


def parameter_counts(moe, spec: MoESpec) -> dict:
    """Total, active (per token) and expert parameters of the MoE, and the share of the bytes a
    1-token forward reads that are expert weights (the embedding table is read one row at a time)."""
    total = sum(p.numel() for p in moe.parameters())
    per_expert = 3 * spec.hidden_size * spec.expert_intermediate_size
    experts = per_expert * spec.num_experts * spec.num_layers
    active = total - per_expert * (spec.num_experts - spec.top_k) * spec.num_layers
    read = active - moe.model.embed_tokens.weight.numel()
    return {"total": total, "active": active, "experts": experts,
            "expert_fraction_of_bytes_read": per_expert * spec.top_k * spec.num_layers / read}


def moe_vs_dense(spec: MoESpec, tokens_per_row: list[int], repeats: int = 7,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> dict:
    """Verify-cost curves of the MoE and the dense model of the same active size on `device`, and the
    bandwidth-bound estimate of the MoE's t(n)/t(1) from the distinct experts n tokens touch."""
    moe, dense = (model.to(device) for model in build_moe_and_dense(spec, dtype))
    counts = parameter_counts(moe, spec)
    moe_curve = measure_verify_curve(admit(moe), tokens_per_row, repeats=repeats)
    dense_curve = measure_verify_curve(admit(dense), tokens_per_row, repeats=repeats)
    f = counts["expert_fraction_of_bytes_read"]
    return {
        "spec": asdict(spec), "dtype": str(dtype).removeprefix("torch."), "device": str(device),
        "experts_implementation": getattr(moe.config, "_experts_implementation", None) or "unknown",
        "moe_parameters": counts,
        "dense_parameters": sum(p.numel() for p in dense.parameters()),
        "tokens": tokens_per_row,
        "moe_seconds": [moe_curve.seconds[n] for n in tokens_per_row],
        "dense_seconds": [dense_curve.seconds[n] for n in tokens_per_row],
        "moe_relative": [moe_curve.relative()[n] for n in tokens_per_row],
        "dense_relative": [dense_curve.relative()[n] for n in tokens_per_row],
        "distinct_experts_estimate": [moe_distinct_experts(spec.num_experts, spec.top_k, n) for n in tokens_per_row],
        "moe_relative_estimate": [moe_verify_ratio(n, spec.num_experts, spec.top_k, f) for n in tokens_per_row],
        "weights": "random (untrained): only the cost curve matters; routing is close to uniform",
    }
