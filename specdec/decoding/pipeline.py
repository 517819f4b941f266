"""One request path, the same for every entry point (the API's `generate`, the server's `Service`,
`check` and `bench`):

    encode   `prepare`: the prompt's ids and stop strings by the checkpoint's own rules, one step on
             the tokenizer's side (below); the one context rule (engine.check_fits) refuses what
             cannot fit
    heal     `first_tokens`: the first token of a prompt that ended in whitespace, one target
             forward for every healed prompt of a batch (token healing, below)
    stop     `stop_rule`, per row: EOS ids, the request's stop strings and the prompt's (a chat's end
             of turn), max_new_tokens; a healed row's stop strings skip the backed-off text
    stream   text.TextStream: pieces that are never taken back
    engine   an `engine.Request`, to `Engine.submit` (or `Engine.run` for a closed batch); an
             engine without a proposer decodes plainly

The checkpoint's rules (`encode`):
- Text is text: special-token text typed in a prompt ("<|im_start|>") is encoded as the characters
  it is, never as the control token, unless the caller opts in (special_tokens=True; the command
  line's --special-tokens, a request's "special_tokens": true), as OpenAI's API does.
- The prompt starts with the checkpoint's prefix (tokenizer.py: its BOS where its tokenizer adds
  one; specdec's own models' <|endoftext|>). A chat is rendered by the checkpoint's chat template
  (chat.py), which decides the whole prompt, and ends its turn with the template's end-of-turn text.
- A text ending in whitespace is token-healed unless heal=False: its last token is backed off
  (`back_off`) and the first generated token must extend the text.
- Generation ends at any of the checkpoint's EOS ids (its end-of-turn ids among them), at a stop
  string, or after max_new_tokens.

Token healing. Byte-level BPE merges a line break with the indentation after it ("\n    " is one
token, "\n        " another), so where a prompt's text ends and where the model would have put a
token boundary need not agree. Stripping the whitespace changes the prompt (the model then writes a
line break and indentation of its own, and the completion doubles what the prompt had); keeping it
as its own token asks the model to continue after a token it never saw followed by more
indentation. Healing keeps the prompt exact: the last token is backed off, and the first generated
token must extend the given text, i.e. its bytes must start with the backed-off text. That first
token is chosen from the target's distribution restricted to those tokens (greedy: their argmax;
sampling: the same temperature / top-k / top-p transform on the restricted logits); everything
after it is ordinary decoding of the target. The backed-off token itself is always allowed, so
healing never leaves the model without a choice.

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

from ..errors import SpecdecError
from ..lm.chat import template
from ..lm.interface import Admitted, pad_right
from ..lm.tokenizer import Tokenizer
from .constraint import Compiled
from .engine import Request, check_fits
from .sampling import RowGenerators, SamplingConfig, pick_rows
from .stopping import StopRule
from .text import TextStream

# on_text(request, pieces, tokens): a step's tokens of the request and their text, (piece, "draft" | "target")
OnText = Callable[[Request, list[tuple[str, str]], list[int]], None]


@dataclass(frozen=True)
class Prompt:
    ids: list[int]               # the prefix and the prompt's ids (the last one backed off when healed)
    healed: str = ""             # the backed-off text the first generated token must start with ("": none)
    stop: tuple[str, ...] = ()   # stop strings the prompt brings: a chat template's end of turn

    @property
    def length(self) -> int:
        """Tokens of the whole prompt (a healed prompt's backed-off token counted)."""
        return len(self.ids) + bool(self.healed)


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


def encode(tokenizer: Tokenizer, text: str | None = None, messages: list[dict] | None = None,
           special_tokens: bool = False, heal: bool = True) -> Prompt:
    """The prompt of `text` (to continue) or of chat `messages` (rendered by the template of the
    checkpoint folder the tokenizer was loaded from), by the rules of the module docstring."""
    if messages is not None:
        if tokenizer.folder is None:
            raise SpecdecError("a chat needs the checkpoint folder's chat template; load the tokenizer from its folder")
        chat = template(tokenizer.folder)
        return Prompt(chat.ids(messages), "", chat.stops)
    ids = tokenizer.encode(text, special_tokens)
    healed = back_off(tokenizer, text, ids) if heal else ""
    return Prompt(tokenizer.prefix + ids[:len(ids) - bool(healed)], healed)


def back_off(tokenizer: Tokenizer, text: str, ids: list[int]) -> str:
    """The text of the last token of `text` (encoded as `ids`) to back off for healing: where the
    text ends in whitespace and that token holds whole characters; "" where nothing is backed off."""
    if not ids or not text[-1].isspace():
        return ""
    last = tokenizer.token_bytes[ids[-1]]
    try:
        return last.decode("utf-8") if last is not None else ""
    except UnicodeDecodeError:  # the token starts inside a character: leave the prompt as it is
        return ""


def allowed(tokenizer: Tokenizer, text: str, vocab_size: int) -> torch.Tensor:
    """(V,) bool: the token ids whose bytes start with `text` (ids past the tokenizer's are not)."""
    prefix = text.encode("utf-8")
    mask = torch.zeros(vocab_size, dtype=torch.bool)
    mask[[i for i, b in enumerate(tokenizer.token_bytes) if b is not None and b.startswith(prefix)]] = True
    return mask


@torch.inference_mode()
def first_tokens(target: Admitted, tokenizer: Tokenizer, prompts: list[list[int]], texts: list[str],
                 samplings: list[SamplingConfig], generator: torch.Generator | RowGenerators | None) -> list[int]:
    """The first generated token of each prompt (its ids already backed off), restricted to the
    tokens that start with its backed-off text, under its own sampling settings: one forward of the
    admitted target over all of them."""
    tokens, lengths = pad_right(prompts, device=target.device)                         # (B, T), (B,)
    logits = target.lm(tokens, logits_index=(lengths - 1)[:, None]).logits[:, 0]       # (B, V)
    masks = torch.stack([allowed(tokenizer, t, logits.shape[-1]) for t in texts]).to(target.device)  # (B, V)
    return pick_rows(logits.masked_fill(~masks, float("-inf")), samplings, generator,
                     list(map(len, prompts))).tolist()


def stop_rule(tokenizer: Tokenizer, max_new_tokens: int, stop: tuple[str, ...] = (), skip: int = 0) -> StopRule:
    """When a generation ends: the checkpoint's EOS ids, the stop strings, max_new_tokens. skip:
    characters at the start of the generated text the stop strings do not see (a healed prompt's
    backed-off text, which the first token repeats)."""
    decode = tokenizer.decode if not skip else (lambda tokens: tokenizer.decode(tokens)[skip:])
    return StopRule(max_new_tokens, tokenizer.eos_ids, stop, decode)


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
