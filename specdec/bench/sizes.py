"""Real model sizes for the benchmarks: Llama-shaped checkpoints built from a named config with
random weights, so that plain decoding, the verify curve and llama.cpp can be measured at the sizes
users run (~0.2B, ~1B) without downloading anything.

The weights are drawn once from a seeded generator (normal, std 0.02; norms 1) straight in bf16
and written in transformers' `LlamaForCausalLM` layout with the shipped tokenizer (its ids are a
prefix of the larger vocabulary; the rows beyond it are never produced by a prompt but are read by
every unembedding, as a real checkpoint's are). They go to the user's cache
(~/.cache/specdec/sizes/<name>-v<version>), never into the repository; speed does not depend on
the values, only on the shapes.

SIZES is the table of named shapes: a new family whose shape is a Llama config difference (e.g.
Qwen2's attention biases, once model.py reads them) is one more entry with its `model_type`.
This module knows nothing about timing (plain.py measures).
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..errors import SpecdecError
from ..lm.arch import Arch
from ..lm.atomic import atomic_dir
from ..lm.checkpoint import CONFIG, TOKENIZER, WEIGHTS, hf_config

BUILDER_VERSION = 1  # part of the folder's name: a change of the recipe builds anew
SHIPPED_TOKENIZER = Path(__file__).resolve().parents[2] / "models" / "target" / TOKENIZER


@dataclass(frozen=True)
class Size:
    """A named model shape: the config, which family's layout it mirrors, and its origin."""
    config: Arch
    like: str                      # the public model whose shape this is
    extra: dict = field(default_factory=dict)  # config.json keys beyond Llama's (another family's)


SIZES: dict[str, Size] = {
    # TinyLlama-style depth at a quarter of the width: ~0.22B parameters, 32k vocabulary
    "0.2b": Size(Arch(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=16,
                      num_attention_heads=16, num_key_value_heads=8, head_dim=64,
                      max_position_embeddings=2048, tie_word_embeddings=True),
                 like="a 16-layer Llama-2-style model, 1024 wide (~0.22B)"),
    # Llama-3.2-1B's shape (16 layers, 2048 wide, GQA 32/8, 8192 MLP, 128k vocabulary, tied),
    # with plain RoPE at theta 500000 (its llama3 rope scaling changes no cost)
    "1b": Size(Arch(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                    num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                    max_position_embeddings=2048, rope_theta=500000.0, tie_word_embeddings=True),
               like="Llama-3.2-1B's shape (~1.24B)"),
}


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "specdec" / "sizes"


def parameters(cfg: Arch) -> int:
    C, D, F = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    layer = C * (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * D + cfg.num_attention_heads * D * C
    layer += 3 * C * F + 2 * C
    embed = cfg.vocab_size * C
    return cfg.num_hidden_layers * layer + embed * (1 if cfg.tie_word_embeddings else 2) + C


def random_state(cfg: Arch, seed: int = 0) -> dict[str, torch.Tensor]:
    """bf16 weights under transformers' Llama names, drawn layer by layer (never a full fp32 copy)."""
    g = torch.Generator().manual_seed(seed)
    C, D, F = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size

    def normal(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    state = {"model.embed_tokens.weight": normal(cfg.vocab_size, C), "model.norm.weight": torch.ones(C, dtype=torch.bfloat16)}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        state[p + "self_attn.q_proj.weight"] = normal(cfg.num_attention_heads * D, C)
        state[p + "self_attn.k_proj.weight"] = normal(cfg.num_key_value_heads * D, C)
        state[p + "self_attn.v_proj.weight"] = normal(cfg.num_key_value_heads * D, C)
        state[p + "self_attn.o_proj.weight"] = normal(C, cfg.num_attention_heads * D)
        state[p + "mlp.gate_proj.weight"] = normal(F, C)
        state[p + "mlp.up_proj.weight"] = normal(F, C)
        state[p + "mlp.down_proj.weight"] = normal(C, F)
        state[p + "input_layernorm.weight"] = torch.ones(C, dtype=torch.bfloat16)
        state[p + "post_attention_layernorm.weight"] = torch.ones(C, dtype=torch.bfloat16)
    if not cfg.tie_word_embeddings:
        state["lm_head.weight"] = normal(cfg.vocab_size, C)
    return state


def build(name: str, cache: Path | None = None) -> Path:
    """The checkpoint folder of size `name`, built once into the cache (a minute or two at ~1B)."""
    if name not in SIZES:
        raise SpecdecError(f"unknown size {name!r}: choose one of {', '.join(SIZES)}")
    return build_config(name, SIZES[name], cache)


def build_config(name: str, size: Size, cache: Path | None = None) -> Path:
    path = (cache or cache_root()) / f"{name}-v{BUILDER_VERSION}"
    if (path / WEIGHTS).exists():
        return path
    if not SHIPPED_TOKENIZER.exists():
        raise SpecdecError(f"the shipped tokenizer is missing at {SHIPPED_TOKENIZER}: run from a full clone of specdec")
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_dir(path) as tmp:
        save_file(random_state(size.config), tmp / WEIGHTS, metadata={"format": "pt"})
        config = {**hf_config(size.config, torch.bfloat16), **size.extra}
        (tmp / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        (tmp / TOKENIZER).write_bytes(SHIPPED_TOKENIZER.read_bytes())
        (tmp / "specdec-size.json").write_text(json.dumps(
            {"size": name, "like": size.like, "parameters": parameters(size.config), "weights": "random, "
             "normal(0, 0.02) from seed 0, norms 1, bf16", "builder_version": BUILDER_VERSION}, indent=2) + "\n")
    return path


SHIPPED_DRAFT = Path(__file__).resolve().parents[2] / "models" / "draft" / CONFIG
EAGLE_DRAFT_VOCAB = 4096  # the shipped EAGLE heads' draft vocabulary (train --draft-vocab default)


def draft_designs(name: str) -> dict[str, Size]:
    """What one drafted token of each shipped draft design costs at size `name`, as a model whose
    1-token forward does that work: the shipped draft model's depth and width with the target's
    vocabulary (its unembedding), an MTP head (one decoder layer of the target's shape and the
    target's unembedding), an EAGLE head (one such layer and a 4096-token draft vocabulary; its
    3C -> C feature projection is left out: a lower bound)."""
    target = SIZES[name].config
    shipped = Arch.from_dict(json.loads(SHIPPED_DRAFT.read_text()))
    draft = dataclasses.replace(shipped, vocab_size=target.vocab_size, tie_word_embeddings=True,
                                max_position_embeddings=target.max_position_embeddings)
    one_layer = dataclasses.replace(target, num_hidden_layers=1)
    return {"draft-model": Size(draft, f"the shipped draft's shape ({shipped.num_hidden_layers} layers, "
                                       f"{shipped.hidden_size} wide) with the {target.vocab_size}-token vocabulary"),
            "mtp": Size(one_layer, "one decoder layer of the target's shape and its unembedding"),
            "eagle": Size(dataclasses.replace(one_layer, vocab_size=EAGLE_DRAFT_VOCAB, tie_word_embeddings=False),
                          f"one decoder layer of the target's shape and a {EAGLE_DRAFT_VOCAB}-token unembedding")}
