"""One request path, the same for every entry point (the API's `generate`, the server's `Service`,
`check` and `bench`):

    encode   `prepare`: the prompt's ids and stop strings by the checkpoint's own rules, one step on
             the tokenizer's side (below); the one context rule (engine.check_fits) refuses what
             cannot fit; a constraint (structured output) compiled against the tokenizer
    heal     a prompt that ended in whitespace gets a rule for its first token (`healing`, token
             healing below), which the engine applies at that token as a grammar's mask (guided.py)
    stop     `stop_rule`, per row: the checkpoint's end-of-generation ids, the request's stop strings
             and the prompt's (a chat's end of turn), max_new_tokens; a healed row's stop strings
             skip the backed-off text
    stream   `TextStream`: pieces that are never taken back
    engine   an `engine.Request`, to `Engine.submit` (the server) or, for a closed batch, `generate`:
             the whole path and one `Engine.run`; an engine without a proposer decodes plainly

The checkpoint's rules (`encode`):
- Text is text: special-token text typed in a prompt ("<|im_start|>") is encoded as the characters
  it is, never as the control token, unless the caller opts in (special_tokens=True; the command
  line's --special-tokens, a request's "special_tokens": true), as OpenAI's API does.
- The prompt starts with the checkpoint's prefix (tokenizer.py: its BOS where its tokenizer adds
  one; specdec's own models' <|endoftext|>). A chat is rendered by the checkpoint's chat template
  (tokenizer.py), which decides the whole prompt, and ends its turn with the template's end-of-turn text.
- A text ending in whitespace is token-healed unless heal=False or the request is constrained (a
  healed prompt's first token would be chosen outside the grammar): its last token is backed off
  (`back_off`) and the first generated token must extend the text.
- Generation ends at any id of the checkpoint's end-of-generation set (tokenizer.py: a GGUF file's
  is llama.cpp's, its end-of-turn and FIM end tokens among them), at a stop string, or after
  max_new_tokens.
- Special tokens stand for no text: the text (and its stream) leaves them out unless the caller
  asks for them (skip_special_tokens=False; the command line's --keep-special-tokens, a request's
  "skip_special_tokens": false, vLLM's name). Stop strings are found in that text; a stop string
  that is a special token's text (a chat template's "<|im_end|>") ends the row at that token.

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
healing never leaves the model without a choice. The restriction is a constraint on the first token
alone (constraint.FirstToken): the engine picks that token in its first step, from the logits of
the forward that decodes every row, masked as a constrained row's are (a draft outside the set is
refused), and the row leaves the guide once the token is emitted. The prompt is thus prefilled once,
as any other.

What a request asks for besides its prompt travels in `Options`, from the entry point to the
engine's `Request`: a new per-request option is a field there and a line in `requests` (a
constraint is compiled by `prepare` and travels with the `Prompt`, since it is compiled against the
tokenizer, as the prompt is encoded by it).

A benchmark decodes fixed token ids (`fixed_prompts`: not healed, trailing whitespace stripped),
through the same encoding and context rule.

A stream of text (`TextStream`) turns a request's tokens, as they arrive step by step, into pieces
that are safe to send: a piece is never taken back. The text is decoded from all tokens so far
(byte-level BPE decodes by concatenation, except a character split across tokens, held back until
complete; special tokens left out as in the final text), and a tail that could be the start of a
stop string is held back until it is known not to be one. The final text (the engine's Row.text:
stop string and EOS cut) closes the stream. Each
piece is labelled with who chose its tokens: "draft" (accepted draft tokens) or "target" (the
recovered or bonus token, or every token of plain decoding).

This module knows no drafter (proposers/; only the grammar's own, guided.GrammarDrafts), nor HTTP or the
command line.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from ..errors import SpecdecError
import numpy as np

from ..lm.interface import Admitted
from ..lm.tokenizer import Tokenizer
from .constraint import Compiled, Constraint, FirstToken, compile_constraint
from .engine import Engine, Request, check_fits
from .guided import GrammarDrafts
from .metrics import SpecMetrics
from .protocol import Proposer
from .sampling import SamplingConfig
from .stopping import StopRule

# on_text(request, pieces, tokens): a step's tokens of the request and their text, (piece, "draft" | "target")
OnText = Callable[[Request, list[tuple[str, str]], list[int]], None]


class BadConstraint(SpecdecError):
    """A constraint that does not compile against the target's tokenizer: an invalid or unsupported
    schema, regex or grammar."""


@dataclass(frozen=True)
class Prompt:
    ids: list[int]               # the prefix and the prompt's ids (the last one backed off when healed)
    healed: str = ""             # the backed-off text the first generated token must start with ("": none)
    stop: tuple[str, ...] = ()   # stop strings the prompt brings: a chat template's end of turn
    constraint: Compiled | FirstToken | None = None  # the request's constraint compiled against the
    # tokenizer, or a healed prompt's rule for its first token

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
    heal: bool = True              # token-heal a prompt that ends in whitespace (never under a constraint)
    constraint: Constraint | None = None  # structured output: what its tokens must match (constraint.py)
    skip_special_tokens: bool = True  # special tokens the model writes are left out of the text


def prepare(tokenizer: Tokenizer, context: int, options: Options, text: str | None = None,
            messages: list[dict] | None = None, name: str = "the prompt", budget: str = "max_new_tokens",
            vocab: int | None = None) -> Prompt:
    """The prompt of `text` (to continue) or of chat `messages` by the checkpoint's rules, refused
    when it and options.max_new_tokens do not fit the context (name, budget: as the caller calls them);
    options.constraint compiled over the target's `vocab` ids (BadConstraint where it does not
    compile), or a healed prompt's rule for its first token over them (`encode`)."""
    constrained = options.constraint is not None
    prompt = encode(tokenizer, text, messages, options.special_tokens, options.heal and not constrained, vocab)
    check_fits(prompt.length, options.max_new_tokens, context, name, budget)
    if not constrained:
        return prompt
    try:
        return Prompt(prompt.ids, prompt.healed, prompt.stop, compile_constraint(options.constraint, tokenizer, vocab))
    except SpecdecError as e:
        raise BadConstraint(str(e)) from None


def encode(tokenizer: Tokenizer, text: str | None = None, messages: list[dict] | None = None,
           special_tokens: bool = False, heal: bool = True, vocab: int | None = None) -> Prompt:
    """The prompt of `text` (to continue) or of chat `messages` (rendered by the checkpoint's chat
    template, Tokenizer.chat_template), by the rules of the module docstring; a healed
    one with the rule for its first token over the target's `vocab` ids (default: the tokenizer's)."""
    if messages is not None:
        chat = tokenizer.chat_template()
        return Prompt(chat.ids(messages), "", chat.stops)
    ids = tokenizer.encode(text, special_tokens)
    healed = back_off(tokenizer, text, ids) if heal else ""
    if not healed:
        return Prompt(tokenizer.prefix + ids)
    rule = healing(tokenizer, healed, len(tokenizer.token_bytes) if vocab is None else vocab)
    return Prompt(tokenizer.prefix + ids[:-1], healed, (), rule)


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


def healing(tokenizer: Tokenizer, text: str, vocab: int) -> FirstToken:
    """A healed prompt's first token: one of the ids below `vocab` whose bytes start with `text`."""
    prefix = text.encode("utf-8")
    ok = np.zeros(32 * ((vocab + 31) // 32), dtype=bool)
    ok[[i for i, b in enumerate(tokenizer.token_bytes[:vocab]) if b is not None and b.startswith(prefix)]] = True
    return FirstToken(np.packbits(ok, bitorder="little").view(np.int32), frozenset(tokenizer.eos_ids))


def stop_rule(tokenizer: Tokenizer, max_new_tokens: int, stop: tuple[str, ...] = (), skip: int = 0,
              skip_special_tokens: bool = True) -> StopRule:
    """When a generation ends: the checkpoint's end-of-generation ids, the stop strings (one that is
    a special token's text: that token), max_new_tokens. skip: characters at the start of the
    generated text the stop strings do not see (a healed prompt's backed-off text, which the first
    token repeats); skip_special_tokens: the text leaves special tokens out."""
    render = partial(tokenizer.decode, skip_special_tokens=skip_special_tokens)
    decode = render if not skip else (lambda tokens: render(tokens)[skip:])
    special = tokenizer.special_ids
    return StopRule(max_new_tokens, tokenizer.eos_ids, tuple(s for s in stop if s not in special), decode,
                    tuple(special[s] for s in stop if s in special))


def fixed_prompts(tokenizer: Tokenizer, context: int, texts: list[str], max_new_tokens: int,
                  chat: bool = False) -> list[list[int]]:
    """Benchmark prompts as fixed token ids: each text without its trailing whitespace, not healed (a
    benchmark decodes given ids), or with chat=True each one user message through the chat template."""
    options = Options(max_new_tokens, heal=False)
    return [prepare(tokenizer, context, options, messages=[{"role": "user", "content": t}], name=f"prompt {i}").ids
            if chat else prepare(tokenizer, context, options, t.rstrip(), name=f"prompt {i}").ids
            for i, t in enumerate(texts)]


def request(tokenizer: Tokenizer, prompt: Prompt, options: Options, generator: torch.Generator | None,
            on_text: OnText | None) -> Request:
    """The engine's request for an encoded prompt: its stop rule (a healed row's stop strings see the
    text after the backed-off text, which its first token repeats), its constraint or first-token
    rule and, where on_text is given, its text stream. generator: the row's (rows may share one)."""
    skip = len(prompt.healed)
    stop = options.stop + prompt.stop
    rule = stop_rule(tokenizer, options.max_new_tokens, stop, skip, options.skip_special_tokens)
    if on_text is None:
        return Request(prompt.ids, rule, options.sampling, generator, None, prompt.constraint)
    text = TextStream(partial(tokenizer.decode, skip_special_tokens=options.skip_special_tokens),
                      rule.stop_strings, skip)

    def on_tokens(request: Request, tokens: list[int], drafted: int) -> None:
        final = request.row.text() if request.row.done else None
        on_text(request, text.add(tokens, drafted, final), tokens)
    return Request(prompt.ids, rule, options.sampling, generator, on_tokens, prompt.constraint)


@dataclass
class Batch:
    """A closed batch through the whole path (`generate`)."""
    prompts: list[Prompt]
    requests: list[Request]      # each row's tokens, finish reason and text (`Request.row`)
    proposer: Proposer | None    # the proposer that drafted (None: plain decoding)
    metrics: SpecMetrics         # the engine's
    seconds: float               # decoding
    verify_curve_seconds: float  # measuring this machine's verify cost first (k="auto"; outside `seconds`)

    @property
    def texts(self) -> list[str]:
        return [r.row.text() for r in self.requests]


def generate(admitted: Admitted, tokenizer: Tokenizer, options: Options, texts: list[str] | None = None,
             messages: list[dict] | None = None, proposer: Proposer | None = None, k: int | str = 0,
             widths: tuple[int, ...] | None = None, name: str = "",
             on_text: Callable[[int, str], None] | None = None) -> Batch:
    """`texts` (each continued) or one chat's `messages` under one set of options, the whole path:
    encoded, healed, decoded in one closed batch by one engine (proposer None: plain decoding, k = 0;
    under a constraint the "grammar" proposer, which drafts its forced tokens where k >= 1).
    name: the model's, under which k="auto" keeps this machine's verify cost (calibration.py),
    measured first where missing. on_text(i, piece): prompt i's text as its tokens are committed."""
    asks = [(None, messages, "the prompt")] if messages is not None else [(t, None, f"prompt {i}")
                                                                           for i, t in enumerate(texts)]
    prompts = [prepare(tokenizer, admitted.context, options, text, chat, name, vocab=admitted.model.config.vocab_size)
               for text, chat, name in asks]
    if options.constraint is not None and proposer is None:
        proposer = GrammarDrafts()
    longest = max(len(p.ids) for p in prompts) + options.max_new_tokens  # a healed prompt's first token is generated
    engine = Engine(admitted, proposer, k, len(prompts), longest, widths=widths, name=name)  # k="auto": the verify
    # curves, measured here where missing, before the timed region
    t0 = time.perf_counter()
    generator = options.sampling.generator(admitted.device)
    rows = [request(tokenizer, p, options, generator, partial(send_text, on_text, i) if on_text else None)
            for i, p in enumerate(prompts)]
    metrics = engine.run(rows)
    return Batch(prompts, rows, proposer, metrics, time.perf_counter() - t0, engine.verify_curve_seconds)


def send_text(on_text: Callable[[int, str], None], i: int, request: Request, pieces: list[tuple[str, str]],
              tokens: list[int]) -> None:
    """Prompt i's text stream, handed to `generate`'s on_text piece by piece."""
    for piece, _ in pieces:
        on_text(i, piece)


class TextStream:
    """A request's text, piece by piece (the module docstring)."""

    def __init__(self, decode: Callable[[list[int]], str], stops: tuple[str, ...], skip_chars: int = 0):
        """skip_chars: characters of the decoded text that belong to the prompt (token healing)."""
        self.decode, self.stops, self.skip = decode, stops, skip_chars
        self.tokens: list[int] = []
        self.sent = 0  # characters sent

    def add(self, tokens: list[int], drafted: int, final: str | None = None) -> list[tuple[str, str]]:
        """One step's tokens (the first `drafted` accepted drafts) -> [(text, kind)]; `final`: the
        request's whole text when this step finished it."""
        pieces = []
        for chunk, kind in ((tokens[:drafted], "draft"), (tokens[drafted:], "target")):
            if chunk:
                self.tokens += chunk
                text = self.decode(self.tokens)[self.skip:]
                if final is None:
                    end = self.safe_end(text)
                else:  # the final text is a prefix of the decoded one (stop string and EOS cut)
                    end, text = min(len(text.rstrip("\ufffd")), len(final)), final
                if end > self.sent:
                    pieces.append((text[self.sent:end], kind))
                    self.sent = end
        if final is not None and len(final) > self.sent:
            pieces.append((final[self.sent:], "target"))
            self.sent = len(final)
        return pieces

    def safe_end(self, text: str) -> int:
        """Where the text can be cut without sending half a character or half a stop string."""
        end = len(text.rstrip("\ufffd"))  # an incomplete UTF-8 sequence decodes to U+FFFD
        held = max((i for s in self.stops for i in range(1, len(s)) if text[:end].endswith(s[:i])), default=0)
        return end - held
