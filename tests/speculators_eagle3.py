"""Run by tests/test_export.py inside a virtual environment holding the `speculators` package (its
pins conflict with specdec's): python speculators_eagle3.py FOLDER VERIFIER.

FOLDER holds head.json (the head's shape), model.safetensors (weights under speculators' EAGLE-3
names) and inputs.safetensors (features (1, S, 3C), input_ids (1, S)). This writes the EAGLE-3
config.json, loads the folder with speculators' own Eagle3DraftModel.from_pretrained, runs its
forward for 3 training-time-test steps, and prints one JSON line: the logits of each step and of
step 0 computed again by the EAGLE-3 layer as written out below from speculators' source.
"""
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from speculators import SpeculatorsConfig, VerifierConfig
from speculators.models import Eagle3DraftModel, Eagle3SpeculatorConfig
from speculators.proposals import GreedyTokenProposalConfig
from transformers import LlamaConfig

STEPS = 3


def write_config(folder: Path, verifier: str) -> None:
    meta = json.loads((folder / "head.json").read_text())
    c = meta["config"]
    layer = LlamaConfig(vocab_size=c["vocab_size"], hidden_size=c["hidden_size"], intermediate_size=c["intermediate_size"],
                        num_hidden_layers=1, num_attention_heads=c["num_attention_heads"],
                        num_key_value_heads=c["num_key_value_heads"], head_dim=c["head_dim"],
                        max_position_embeddings=c["max_position_embeddings"], rms_norm_eps=c["rms_norm_eps"],
                        rope_parameters={"rope_type": "default", "rope_theta": c["rope_theta"]},
                        tie_word_embeddings=False)
    Eagle3SpeculatorConfig(
        transformer_layer_config=layer, draft_vocab_size=meta["draft_vocab_size"], norm_before_residual=False,
        target_hidden_size=c["hidden_size"], eagle_aux_hidden_state_layer_ids=[i + 1 for i in meta["layer_ids"]],
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=STEPS)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=verifier, architectures=["LlamaForCausalLM"])),
    ).save_pretrained(folder)


def eagle3_step0(w: dict, features: torch.Tensor, ids: torch.Tensor, tl) -> torch.Tensor:
    """speculators' EAGLE-3 draft at its first step, causal: (1, S, 3C), (1, S) -> (1, S, N) logits."""
    H, Hkv, D, eps = tl.num_attention_heads, tl.num_key_value_heads, tl.head_dim, tl.rms_norm_eps
    S = ids.shape[1]

    def rms(t, g):
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + eps) * g

    def heads(x, name, n):  # (1, S, 2C) -> (1, H, S, D), key/value heads repeated for grouped-query attention
        return (x @ w[f"layers.0.self_attn.{name}.weight"].T).view(1, S, n, D).transpose(1, 2).repeat_interleave(H // n, 1)

    g = features @ w["fc.weight"].T                                                    # (1, S, C)
    x = torch.cat([rms(w["embed_tokens.weight"][ids], w["layers.0.input_layernorm.weight"]),
                   rms(g, w["layers.0.hidden_norm.weight"])], -1)                      # (1, S, 2C)
    q, k, v = heads(x, "q_proj", H), heads(x, "k_proj", Hkv), heads(x, "v_proj", Hkv)
    angle = torch.arange(S).float()[:, None] / tl.rope_parameters["rope_theta"] ** (torch.arange(0, D, 2).float() / D)
    cos, sin = torch.cat([angle, angle], -1).cos(), torch.cat([angle, angle], -1).sin()  # (S, D)
    q, k = [t * cos + torch.cat([-t[..., D // 2:], t[..., :D // 2]], -1) * sin for t in (q, k)]
    causal = torch.ones(S, S, dtype=torch.bool).tril()
    a = torch.softmax((q @ k.transpose(-1, -2) / D ** 0.5).masked_fill(~causal, float("-inf")), -1) @ v
    h = g + a.transpose(1, 2).reshape(1, S, H * D) @ w["layers.0.self_attn.o_proj.weight"].T  # residual: g
    m = rms(h, w["layers.0.post_attention_layernorm.weight"])
    gate, up = m @ w["layers.0.mlp.gate_proj.weight"].T, m @ w["layers.0.mlp.up_proj.weight"].T
    h = h + (torch.nn.functional.silu(gate) * up) @ w["layers.0.mlp.down_proj.weight"].T
    return rms(h, w["norm.weight"]) @ w["lm_head.weight"].T


def main(folder: Path, verifier: str) -> None:
    if not (folder / "config.json").exists():  # an export writes its own; a folded head gets one here
        write_config(folder, verifier)
    config = Eagle3SpeculatorConfig.from_pretrained(folder)
    config.transformer_layer_config._attn_implementation = "eager"  # its flex attention needs torch.compile
    model = Eagle3DraftModel.from_pretrained(folder, config=config).float().eval()
    x = load_file(folder / "inputs.safetensors")
    S = x["input_ids"].shape[1]
    logits = []
    model.lm_head.register_forward_hook(lambda module, args, out: logits.append(out.detach()))
    with torch.no_grad():
        model(hidden_states=x["features"], input_ids=x["input_ids"], document_ids=torch.zeros(1, S, dtype=torch.long),
              position_ids=torch.arange(S)[None], ttt_steps=STEPS)
    weights = {k: v.float() for k, v in load_file(folder / "model.safetensors").items()}
    rewritten = eagle3_step0(weights, x["features"], x["input_ids"], config.transformer_layer_config)
    save_file({**{f"step{j}": l.contiguous() for j, l in enumerate(logits)}, "rewritten0": rewritten.contiguous()},
              folder / "speculators_logits.safetensors")
    print(json.dumps({"aux_layer_ids": model.config.eagle_aux_hidden_state_layer_ids, "steps": len(logits)}))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
