"""The Python API: load a model with its tokenizer, generate text, read the stats.

    from specdec.api import load, generate, DEFAULT_DRAFT
    from specdec.proposers import build_proposer
    target = load()                                   # the shipped default target
    result = generate(target, ["def fib(n):"], max_new_tokens=64)
    draft = build_proposer("draft-model", model=load(DEFAULT_DRAFT).model)
    result = generate(target, ["def fib(n):"], max_new_tokens=64, proposer=draft, k=4)
    print(result.texts[0], result.stats["mean_acceptance_length"])
    mtp = build_proposer("mtp", heads=load_mtp_heads(target), target=target.model)   # the shipped heads
    result = generate(target, ["def fib(n):"], max_new_tokens=64, proposer=mtp, k=3)

Prompts are preceded by the document separator <|endoftext|>, as every training document was,
and their trailing whitespace is left for the model to generate (see `encode_prompts`): the
completion of a prompt P is P.rstrip() + result.texts[i].
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .checkpoint import load_model
from .decode import plain_generate
from .engine import speculative_generate
from .errors import SpecdecError
from .heads import MTPHeads, load_heads
from .model import LlamaForCausalLM, compute_dtype
from .proposers import Proposer
from .sampling import SamplingConfig
from .stopping import StopRule
from .tokenizer import EOS_ID, Tokenizer

MODELS = Path(__file__).resolve().parent.parent / "models"
DEFAULT_TARGET = MODELS / "target"
DEFAULT_DRAFT = MODELS / "draft"
DEFAULT_HEADS = MODELS / "target-mtp"


@dataclass
class Loaded:
    model: LlamaForCausalLM
    tokenizer: Tokenizer
    path: Path


@dataclass
class Result:
    texts: list[str]
    tokens: list[list[int]]          # generated ids per prompt (EOS included when generated)
    finish_reasons: list[str]        # "eos" | "stop" | "length"
    stats: dict = field(default_factory=dict)


def load(path: str | Path | None = None, dtype: torch.dtype | None = None) -> Loaded:
    path = Path(path) if path is not None else DEFAULT_TARGET
    if path == DEFAULT_TARGET and not path.exists():
        raise SpecdecError(f"the shipped target is missing at {path}: run from a full clone of specdec "
                           "or pass a checkpoint folder")
    model = load_model(path, dtype=dtype)
    tokenizer = Tokenizer.load(path)
    if tokenizer.vocab_size > model.config.vocab_size:
        raise SpecdecError(f"{path}: the tokenizer has {tokenizer.vocab_size} tokens but the model only "
                           f"{model.config.vocab_size}; they do not belong together")
    return Loaded(model, tokenizer, path)


def load_draft_model(target: Loaded, path: str | Path | None = None) -> Loaded:
    """A separate draft model for `target`: it must use the very same tokenizer."""
    draft = load(path if path is not None else DEFAULT_DRAFT, dtype=compute_dtype(target.model))
    if draft.tokenizer.tok.get_vocab() != target.tokenizer.tok.get_vocab():
        raise SpecdecError(f"the draft model {draft.path} uses another tokenizer than the target {target.path}; "
                           "a draft must share the target's tokenizer (train it with --tokenizer "
                           f"{target.path}/tokenizer.json)")
    return draft


def load_mtp_heads(target: Loaded, path: str | Path | None = None) -> MTPHeads:
    """MTP heads for `target` (default: the shipped heads of the shipped target), in the target's
    dtype; heads trained for another target are refused (checkpoint hash, see heads.load_heads)."""
    path = Path(path) if path is not None else DEFAULT_HEADS
    if path == DEFAULT_HEADS and not path.exists():
        raise SpecdecError(f"the shipped MTP heads are missing at {path}: run from a full clone of specdec "
                           "or pass a heads folder")
    return load_heads(path, target.path, dtype=compute_dtype(target.model))


def encode_prompts(target: Loaded, prompts: list[str], max_new_tokens: int) -> list[list[int]]:
    context = target.model.config.max_position_embeddings
    encoded = []
    for i, prompt in enumerate(prompts):
        if not prompt.strip():
            raise SpecdecError(f"prompt {i} is empty; give some text to continue")
        # trailing whitespace is left for the model to generate: byte-level BPE merges a newline
        # with the indentation after it, so a prompt ending in a bare "\n" token asks for text the
        # model rarely saw (a line at column 0) instead of the indented body that should follow
        ids = [EOS_ID] + target.tokenizer.encode(prompt.rstrip())
        if len(ids) + max_new_tokens > context:
            raise SpecdecError(f"prompt {i} has {len(ids)} tokens; with max_new_tokens={max_new_tokens} that "
                               f"exceeds the model's context of {context} tokens. Shorten the prompt or "
                               "lower max_new_tokens")
        encoded.append(ids)
    return encoded


def generate(target: Loaded, prompts: str | list[str], max_new_tokens: int = 128, temperature: float = 0.0,
             top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
             stop: tuple[str, ...] = (), proposer: Proposer | None = None, k: int = 4) -> Result:
    """Plain decoding, or speculative decoding when a proposer is given (see `build_proposer`)."""
    prompts = [prompts] if isinstance(prompts, str) else list(prompts)
    sampling = SamplingConfig(temperature, top_k, top_p, seed)
    rule = StopRule(max_new_tokens, EOS_ID, tuple(stop), target.tokenizer.decode)
    ids = encode_prompts(target, prompts, max_new_tokens)
    t0 = time.perf_counter()
    if proposer is None:
        rows, timing = plain_generate(target.model, ids, rule, sampling, sampling.generator())
        spec = {"method": "plain", "time_to_first_token": timing.prefill_seconds}
    else:
        rows, metrics = speculative_generate(target.model, proposer, ids, rule, sampling, k, sampling.generator())
        spec = {"method": proposer.name, **metrics.to_dict(), "time_to_first_token": metrics.first_token_seconds}
    seconds = time.perf_counter() - t0
    new_tokens = sum(len(r.tokens) for r in rows)
    stats = {
        **spec,
        "batch_size": len(prompts),
        "prompt_tokens": [len(i) for i in ids],
        "new_tokens": new_tokens,
        "seconds": seconds,
        "tokens_per_s": new_tokens / seconds if seconds > 0 else None,
        "threads": torch.get_num_threads(),
        "dtype": str(compute_dtype(target.model)).removeprefix("torch."),
    }
    return Result([r.text() for r in rows], [r.tokens for r in rows], [r.finish_reason for r in rows], stats)
