"""The Python API: load a model with its tokenizer, generate text, read the stats.

    from specdec.api import load, generate
    target = load()                                   # the shipped default target
    result = generate(target, ["def fib(n):"], max_new_tokens=64)
    print(result.texts[0], result.stats)

Prompts are preceded by the document separator <|endoftext|>, as every training document was.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .checkpoint import load_model
from .decode import plain_generate
from .errors import SpecdecError
from .model import LlamaForCausalLM
from .sampling import SamplingConfig
from .stopping import StopRule
from .tokenizer import EOS_ID, Tokenizer

MODELS = Path(__file__).resolve().parent.parent / "models"
DEFAULT_TARGET = MODELS / "target"
DEFAULT_DRAFT = MODELS / "draft"


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


def encode_prompts(target: Loaded, prompts: list[str], max_new_tokens: int) -> list[list[int]]:
    context = target.model.config.max_position_embeddings
    encoded = []
    for i, prompt in enumerate(prompts):
        if not prompt:
            raise SpecdecError(f"prompt {i} is empty; give some text to continue")
        ids = [EOS_ID] + target.tokenizer.encode(prompt)
        if len(ids) + max_new_tokens > context:
            raise SpecdecError(f"prompt {i} has {len(ids)} tokens; with max_new_tokens={max_new_tokens} that "
                               f"exceeds the model's context of {context} tokens. Shorten the prompt or "
                               "lower max_new_tokens")
        encoded.append(ids)
    return encoded


def generate(target: Loaded, prompts: str | list[str], max_new_tokens: int = 128, temperature: float = 0.0,
             top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
             stop: tuple[str, ...] = ()) -> Result:
    prompts = [prompts] if isinstance(prompts, str) else list(prompts)
    sampling = SamplingConfig(temperature, top_k, top_p, seed)
    rule = StopRule(max_new_tokens, EOS_ID, tuple(stop), target.tokenizer.decode)
    ids = encode_prompts(target, prompts, max_new_tokens)
    t0 = time.perf_counter()
    rows, timing = plain_generate(target.model, ids, rule, sampling, sampling.generator())
    seconds = time.perf_counter() - t0
    new_tokens = sum(len(r.tokens) for r in rows)
    stats = {
        "method": "plain",
        "batch_size": len(prompts),
        "prompt_tokens": [len(i) for i in ids],
        "new_tokens": new_tokens,
        "seconds": seconds,
        "time_to_first_token": timing.prefill_seconds,
        "tokens_per_s": new_tokens / seconds if seconds > 0 else None,
        "threads": torch.get_num_threads(),
        "dtype": str(target.model.lm_head.weight.dtype).removeprefix("torch."),
    }
    return Result([r.text() for r in rows], [r.tokens for r in rows], [r.finish_reason for r in rows], stats)
