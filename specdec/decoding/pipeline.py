"""One request path, the same for every entry point (the API's `generate`, the server's `Service`,
`check` and `bench`):

    encode   prompts.encode: chat template or text, the special-token rule, the checkpoint's prefix;
             the one context rule (engine.check_fits) refuses what cannot fit
    heal     healing.first_tokens: the first token of a prompt that ended in whitespace, one target
             forward for every healed prompt of a batch
    stop     prompts.stop_rule, per row: EOS ids, the request's stop strings and the prompt's
             (a chat's end of turn), max_new_tokens; a healed row's stop strings skip the backed-off text
    stream   text.TextStream: pieces that are never taken back
    engine   an `engine.Request`, to `Engine.submit` (or `Engine.run` for a closed batch); an
             engine without a proposer decodes plainly

What a request asks for besides its prompt travels in `Options`, from the entry point to the
engine's `Request`: a new per-request option is a field there and a line in `requests`.

A benchmark decodes fixed token ids (`fixed_prompts`: not healed, trailing whitespace stripped),
through the same encoding and context rule.

This module knows nothing about proposers, HTTP or the command line.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..lm.interface import Admitted
from ..lm.tokenizer import Tokenizer
from .constraint import Compiled
from .engine import Request, check_fits
from .healing import first_tokens
from .prompts import Prompt, encode, stop_rule
from .sampling import RowGenerators, SamplingConfig
from .text import TextStream

# on_text(request, pieces, tokens): a step's tokens of the request and their text, (piece, "draft" | "target")
OnText = Callable[[Request, list[tuple[str, str]], list[int]], None]


@dataclass(frozen=True)
class Options:
    """What a request asks for besides its prompt."""
    max_new_tokens: int = 128
    sampling: SamplingConfig = SamplingConfig()
    stop: tuple[str, ...] = ()     # stop strings (the prompt may bring more: a chat's end of turn)
    special_tokens: bool = False   # special-token text in the prompt is the control token, not text
    heal: bool = True              # token-heal a prompt that ends in whitespace
    constraint: Compiled | None = None  # structured output: the grammar its tokens must match (constraint.py)


def prepare(tokenizer: Tokenizer, context: int, options: Options, text: str | None = None,
            messages: list[dict] | None = None, name: str = "the prompt", budget: str = "max_new_tokens") -> Prompt:
    """The prompt of `text` (to continue) or of chat `messages` by the checkpoint's rules, refused
    when it and options.max_new_tokens do not fit the context (name, budget: as the caller calls them)."""
    prompt = encode(tokenizer, text, messages, special_tokens=options.special_tokens, heal=options.heal)
    check_fits(prompt.length, options.max_new_tokens, context, name, budget)
    return prompt


def fixed_prompts(tokenizer: Tokenizer, context: int, texts: list[str], max_new_tokens: int,
                  chat: bool = False) -> list[list[int]]:
    """Benchmark prompts as fixed token ids: each text without its trailing whitespace, not healed (a
    benchmark decodes given ids), or with chat=True each one user message through the chat template."""
    options = Options(max_new_tokens, heal=False)
    return [prepare(tokenizer, context, options, messages=[{"role": "user", "content": t}], name=f"prompt {i}").ids
            if chat else prepare(tokenizer, context, options, t.rstrip(), name=f"prompt {i}").ids
            for i, t in enumerate(texts)]


@torch.inference_mode()
def requests(target: Admitted, tokenizer: Tokenizer, prompts: list[Prompt], options: list[Options],
             generators: list[torch.Generator | None], on_text: list[OnText | None]) -> list[Request]:
    """The engine's requests for encoded prompts: healed prompts get their first token (one forward
    of the admitted target for all of them, emitted at once), every row its stop rule and, where
    on_text is given, its text stream. generators: each row's (rows may share one)."""
    healing = [i for i, (p, o) in enumerate(zip(prompts, options)) if p.healed and o.max_new_tokens > 0]
    firsts = dict.fromkeys(healing)
    if healing:
        shared = all(generators[i] is generators[healing[0]] for i in healing)
        generator = generators[healing[0]] if shared else RowGenerators([generators[i] for i in healing])
        chosen = first_tokens(target, tokenizer, [prompts[i].ids for i in healing],
                              [prompts[i].healed for i in healing],
                              [options[i].sampling for i in healing], generator)
        firsts = dict(zip(healing, chosen))
    return [request(tokenizer, p, o, g, firsts.get(i), t)
            for i, (p, o, g, t) in enumerate(zip(prompts, options, generators, on_text))]


def request(tokenizer: Tokenizer, prompt: Prompt, options: Options, generator: torch.Generator | None,
            first: int | None, on_text: OnText | None) -> Request:
    """One row: its stop rule (a healed row's stop strings see the text after the backed-off
    text, which its first token repeats), its stream, and its healed first token already emitted."""
    skip = len(prompt.healed)
    stop = options.stop + prompt.stop
    rule = stop_rule(tokenizer, options.max_new_tokens, stop, skip)
    on_tokens = None
    if on_text is not None:
        text = TextStream(tokenizer.decode, stop, skip)

        def on_tokens(request: Request, tokens: list[int], drafted: int) -> None:
            final = request.row.text() if request.row.done else None
            on_text(request, text.add(tokens, drafted, final), tokens)
    ids = prompt.ids if first is None else prompt.ids + [first]
    row = Request(ids, rule, options.sampling, generator, on_tokens, options.constraint)
    if first is not None:
        row.row.append(first)  # healing chose it: the row's first token, from the target
        if on_tokens is not None:
            on_tokens(row, [first], 0)
    return row
