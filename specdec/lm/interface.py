"""What the engine and the proposers need from a causal LM, and how a model is admitted as one.

The interface is the one of specdec's own `LlamaForCausalLM`: `abilities` (model.Abilities: trees,
layer outputs, draft vocabularies, batching, fixed when the model is loaded or wrapped), `config.vocab_size`,
`config.max_position_embeddings`, `new_cache(batch, max_len, dtype=None)` returning a cache with per-row
`lengths` (B,) on the model's device, the same on the host as `held` (list) with `longest`, and
`rollback(lengths)`, and `model(tokens, positions=, cache=, logits_index=)`
returning `.logits` and `.hidden` (final hidden states). transformers causal LMs are admitted
through `hf_adapter.HFCausalLM`; anything else is refused with a clear error. A model is admitted
once, when it is loaded (`admit`): the `Admitted` handle carries it with its device, dtype, context
and abilities to the engine and the request path.

This module knows nothing about drafting, verification or stopping.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import SpecdecError
from .device import placement
from .model import Abilities


def pad_right(prompts: list[list[int]], pad: int = 0, device: torch.device | str = "cpu"
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompts right-padded (B, T) and their lengths (B,), on `device` (one copy from the host)."""
    width = max(map(len, prompts))
    both = torch.tensor([[len(p)] + p + [pad] * (width - len(p)) for p in prompts], dtype=torch.long).to(device)
    return both[:, 1:], both[:, 0]  # (B, T), (B,)


def causal_lm(model, role: str = "model"):
    """Return `model` ready for the engine (transformers models wrapped), or raise SpecdecError.

    `role` ("target", "draft model") only names the model in the error message.
    """
    if isinstance(getattr(model, "abilities", None), Abilities):  # admitted already
        return model
    transformers = sys.modules.get("transformers")  # a transformers model implies it is imported
    if transformers is not None:
        from .hf_adapter import HFCausalLM
        if (isinstance(model, transformers.PreTrainedModel) and model.can_generate()
                and not model.config.is_encoder_decoder):
            return HFCausalLM(model)
    raise SpecdecError(
        f"the {role} ({type(model).__name__}) is not a causal language model: pass specdec's "
        "LlamaForCausalLM or a transformers decoder-only *ForCausalLM / *LMHeadModel")


@dataclass(frozen=True)
class Admitted:
    """A causal LM admitted once (`admit`, at load): the model as the engine calls it and the facts
    the request path needs, fixed then, so that nobody asks the model again. Three words, each for one
    thing: `model` the module, `admitted` an Admitted, a `Loaded` (api.py) the model with its tokenizer."""
    model: Any              # specdec's LlamaForCausalLM, or a transformers model behind HFCausalLM
    device: torch.device    # where it computes and what the engine creates goes
    dtype: torch.dtype      # its compute dtype
    context: int            # the longest sequence it can hold (config.max_position_embeddings)
    abilities: Abilities    # trees, layers, draft vocabularies, batching, and its backend (kernels or not)


def admit(model, role: str = "model") -> Admitted:
    """`model` admitted as a causal LM (`causal_lm`) with its placement, context and abilities, once;
    an Admitted is returned as it is."""
    if isinstance(model, Admitted):
        return model
    model = causal_lm(model, role)
    device, dtype = placement(model)
    return Admitted(model, device, dtype, context_length(model), model.abilities)


NO_ABILITIES = Abilities(trees=False, layers=False, draft_vocab=False, batch=False, backend="none")


def abilities(model) -> Abilities:
    """What a model can do as specdec's causal LM: its own `abilities`, none for anything else (a
    transformers model not yet wrapped by `causal_lm` offers only what the adapter gives it)."""
    found = getattr(model, "abilities", None)
    return found if isinstance(found, Abilities) else NO_ABILITIES


def no_features(model, rows: int, features: tuple[int, ...]) -> torch.Tensor:
    """(rows, 0, ...) features (`declared_features`) of no tokens, on the model's device and in its dtype."""
    return torch.zeros(rows, 0, model.config.hidden_size * max(len(features), 1), dtype=placement(model).dtype,
                       device=placement(model).device)


def body_size(model) -> int:
    """Multiply-adds a token costs in a model's matrices but its unembedding (whose rows only the
    positions read out need): what reading a token through it costs, as against another model; 0
    where its matrices are not nn.Linear (GPT-2's Conv1D)."""
    vocab = model.config.vocab_size
    module = model if isinstance(model, torch.nn.Module) else model.model  # hf_adapter.HFCausalLM wraps one
    return sum(m.in_features * m.out_features for m in module.modules()
               if isinstance(m, torch.nn.Linear) and m.out_features != vocab)


def context_length(model) -> int:
    length = getattr(model.config, "max_position_embeddings", None)
    if length is None:
        raise SpecdecError(f"{type(model).__name__}'s config has no max_position_embeddings: "
                           "cannot tell how long its context is")
    return int(length)


def next_positions(cache, width: int, context: int) -> torch.Tensor | None:
    """Positions (B, width) of the next `width` tokens of each row, or None where they are the
    model's default (each row's cache length + 0..width-1: no row reaches the context's end).

    In a batch, rows that draft fewer tokens than the widest row are padded, and that padding may
    run past the model's context near the end of a row; its positions are clamped to stay valid
    (outputs at padding are never read, and its cache entries lie past the row's length).
    """
    if cache.longest + width <= context:
        return None
    steps = torch.arange(width, device=cache.lengths.device)[None]
    return (cache.lengths[:, None] + steps).clamp(max=context - 1)


def prefill_all_but_last(model, cache, prompts: list[list[int]], features: tuple[int, ...] = ()) -> torch.Tensor:
    """Write every prompt except its last token into the cache, after what each row already holds
    (the last one opens the first window); return the features of the positions written
    (`declared_features`), right-padded."""
    held = list(cache.held)
    heads, lengths = pad_right([p[n:-1] for p, n in zip(prompts, held)], device=cache.lengths.device)  # (B, W), (B,)
    if heads.shape[1] == 0:
        return no_features(model, len(prompts), features)
    out = model(heads, cache=cache, logits_index=lengths.clamp(min=1)[:, None] - 1, **layer_request(features))
    cache.rollback([len(p) - 1 for p in prompts])
    return declared_features(out, features)


def layer_request(features: tuple[int, ...]) -> dict:
    """The forward's keyword that returns the outputs of the decoder layers `features` (none for ())."""
    return {"output_layers": features} if features else {}


def declared_features(out, features: tuple[int, ...]) -> torch.Tensor:
    """What a proposer declared (proposers/base.py): the final hidden states (B, T, C) for (), else
    the outputs of those decoder layers concatenated (B, T, len(features) * C)."""
    return out.hidden if not features else torch.cat([out.layers[i] for i in features], -1)


def prefill_joining(model, cache, prompts: list[list[int]], features: tuple[int, ...] = (),
                    promises: list[int] | None = None, share: bool = False) -> torch.Tensor:
    """Append each prompt as a new row after the cache's rows, prefilled without its last token in a
    staging cache (its rows promised `promises` blocks, lm/kv_cache.py); return the features there
    (`declared_features`, (n, P-1, ...)), right-padded. share: each row first maps the cached blocks
    of its leading tokens and prefills only after them, then registers its own full blocks (the
    features are then those of the positions prefilled: for proposers that read none). Rows left
    with different numbers of tokens to prefill go one at a time in a cache of blocks, so that
    none writes (and holds) padding."""
    staging = cache.staging(len(prompts), promises)
    heads = [p[:-1] for p in prompts]
    starts = [staging.share(b, head) for b, head in enumerate(heads)] if share else [0] * len(heads)
    if staging.pool is None or len({(len(h), s) for h, s in zip(heads, starts)}) == 1:
        hidden = prefill_all_but_last(model, staging, prompts, features)
    else:
        rows = []
        for b in range(len(prompts)):
            alone = staging.row(b)
            rows.append(prefill_all_but_last(model, alone, [prompts[b]], features)[0])
            staging.put_row(b, alone)
        width = max(len(r) for r in rows)
        hidden = torch.stack([torch.cat([r, r.new_zeros(width - len(r), *r.shape[1:])]) for r in rows])
    if share:
        for b, head in enumerate(heads):
            staging.register(b, head)
    cache.regroup(list(range(len(cache.held))), staging)
    return hidden
