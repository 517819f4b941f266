"""Structured output: a constraint (JSON Schema, any JSON object, a regex or a context-free grammar)
compiled against the target's tokenizer, and a per-row matcher that says which tokens may come next.

The grammars are compiled by llguidance (Microsoft's Rust library, on PyPI without dependencies):
its token masks cost a small part of a decoding step on SmolLM2's vocabulary, and it
takes JSON Schema, regexes, Lark grammars and llama.cpp's GBNF (docs/structured.md says how it was
chosen over xgrammar and what it measured).

- `Constraint` is what a request asks for (`Constraint.json_schema(schema)`, `.json_object()`,
  `.regex(pattern)`, `.grammar(text)`); `compile_constraint(constraint, tokenizer, vocab)` turns it
  into a `Compiled` grammar or stops with a SpecdecError naming the problem: invalid JSON, an
  invalid or unsupported schema (the keyword), an invalid regex or grammar, or a constraint that
  allows nothing at the start.
- `Matcher` follows one row: `mask_into` writes the allowed-token bitmask at the next position,
  `advance` consumes tokens, `rollback` forgets the last ones (rejected drafts), `forced` is the run
  of tokens the grammar forces from here (keys, punctuation, the rest of an enum value).
- `FirstToken` restricts only a row's first token to a set (token healing: the tokens whose bytes
  start with a prompt's backed-off text, decoding/pipeline.py); its `FirstTokenMatcher` answers as a
  `Matcher` does and is `free` once that token is consumed (the guide then lets the row go).
- `allowed(bitmasks, vocab)` unpacks bitmasks (..., W) int32 into booleans (..., V); `masked(logits,
  bitmasks)` sets the refused tokens' logits to -inf (in NumPy on the CPU: one pass, no thread pool,
  whose wake-ups cost milliseconds for 49k elements on a busy machine).

JSON is generated compact (no optional whitespace between tokens), so more of it is forced.

This module knows nothing about models, verification or the engine (guided.py applies the masks).
"""
from __future__ import annotations

import json
import weakref
from dataclasses import dataclass

import llguidance
import llguidance.gbnf_to_lark
import numpy as np
import torch

from ..errors import SpecdecError

KINDS = ("json_schema", "json_object", "regex", "grammar")
JSON_OPTIONS = {"whitespace_flexible": False}  # compact JSON: separators "," and ":" exactly, so they are forced


@dataclass(frozen=True)
class Constraint:
    """What the output must match. source: the JSON Schema as JSON text, the regex, or the grammar
    (Lark, or GBNF as llama.cpp writes it: rules with "::="); empty for json_object."""
    kind: str
    source: str = ""

    def __post_init__(self):
        if self.kind not in KINDS:
            raise SpecdecError(f"unknown constraint kind {self.kind!r}: use one of {', '.join(KINDS)}")

    @classmethod
    def json_schema(cls, schema: dict | str) -> "Constraint":
        """A JSON Schema (a dict, or its JSON text)."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise SpecdecError(f"the JSON schema is not valid JSON ({e}); give a JSON object") from None
        if not isinstance(schema, dict):
            raise SpecdecError(f"a JSON schema must be a JSON object, got {type(schema).__name__}")
        return cls("json_schema", json.dumps(schema))

    @classmethod
    def json_object(cls) -> "Constraint":
        """Any JSON object (OpenAI's response_format {"type": "json_object"})."""
        return cls("json_object")

    @classmethod
    def regex(cls, pattern: str) -> "Constraint":
        return cls("regex", pattern)

    @classmethod
    def grammar(cls, text: str) -> "Constraint":
        """A context-free grammar: Lark (start rule `start`) or GBNF (start rule `root`)."""
        return cls("grammar", text)

    def describe(self) -> str:
        return self.kind if not self.source else f"{self.kind} {self.source[:60]!r}"

    def grammar_text(self) -> str:
        """The llguidance grammar (its JSON form) of this constraint; not yet checked."""
        if self.kind == "json_schema":
            return llguidance.LLMatcher.grammar_from_json_schema(self.source, defaults=JSON_OPTIONS)
        if self.kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        if self.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(self.source)
        return llguidance.LLMatcher.grammar_from_lark(grammar_to_lark(self.source))


def grammar_to_lark(text: str) -> str:
    """A Lark grammar as it is, a GBNF one translated (llguidance's translator)."""
    try:
        return llguidance.gbnf_to_lark.any_to_lark(text)
    except Exception as e:  # the translator raises bare Exceptions and ValueErrors for a bad GBNF grammar
        raise SpecdecError(f"the grammar is neither valid Lark nor valid GBNF: {e}") from None


_TOKENIZERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # Tokenizer -> {vocab: LLTokenizer}


def grammar_tokenizer(tokenizer, vocab: int) -> llguidance.LLTokenizer:
    """llguidance's view of a specdec Tokenizer (lm/tokenizer.py) over the target's `vocab` ids, its
    EOS ids those that end a generation; built once per tokenizer (~0.3 s for 49k tokens)."""
    per_vocab = _TOKENIZERS.setdefault(tokenizer, {})
    if vocab not in per_vocab:
        if not tokenizer.eos_ids:
            raise SpecdecError("structured output needs a tokenizer with an EOS token: the constraint ends the "
                               "generation with it")
        per_vocab[vocab] = llguidance.LLTokenizer(tokenizer.tok.to_str(), n_vocab=vocab,
                                                  eos_token=list(tokenizer.eos_ids))
    return per_vocab[vocab]


@dataclass(frozen=True)
class Compiled:
    """A constraint checked against one tokenizer: make a `Matcher` per row."""
    constraint: Constraint
    grammar: str
    tokens: llguidance.LLTokenizer
    vocab: int

    def matcher(self) -> "Matcher":
        return Matcher(self)


@dataclass(frozen=True, eq=False)
class FirstToken:
    """The first token one of a set, anything after it: bits (W,) int32, the allowed first tokens;
    eos: the ids that end a row (refused first unless in the set)."""
    bits: np.ndarray
    eos: frozenset[int]

    def matcher(self) -> "FirstTokenMatcher":
        return FirstTokenMatcher(self)


def compile_constraint(constraint: Constraint, tokenizer, vocab: int) -> Compiled:
    """Check the constraint against the target's tokenizer (vocab: the target's vocabulary size);
    a SpecdecError says what is wrong with it."""
    what = constraint.describe()
    try:
        grammar = constraint.grammar_text()
    except ValueError as e:
        raise SpecdecError(f"invalid {what}: {e}") from None
    tokens = grammar_tokenizer(tokenizer, vocab)
    error = llguidance.LLMatcher.validate_grammar(grammar, tokens)
    if error:
        hint = (" (this keyword is not supported: remove it from the schema)" if "Unimplemented keys" in error
                else "")
        raise SpecdecError(f"invalid {what}: {error.strip()}{hint}")
    compiled = Compiled(constraint, grammar, tokens, vocab)
    probe = compiled.matcher()
    bits = np.zeros(probe.words, dtype=np.int32)
    probe.mask_into(bits)
    if probe.failed or not bits.any():
        raise SpecdecError(f"the {what} allows nothing at the start (no token, not even the end): "
                           f"it can never be satisfied{probe.reason()}")
    return compiled


class Matcher:
    """One row's position in the grammar."""

    def __init__(self, compiled: Compiled):
        self.vocab = compiled.vocab
        self.words = (compiled.vocab + 31) // 32  # int32 words of a bitmask
        self.m = llguidance.LLMatcher(compiled.tokens, compiled.grammar, log_level=0)
        self.eos = frozenset(compiled.tokens.eos_tokens)

    @property
    def failed(self) -> bool:
        return self.m.is_error()

    def reason(self) -> str:
        error = self.m.get_error().split("\n")[0]
        return f" ({error})" if error else ""

    def mask_into(self, bits: np.ndarray) -> None:
        """Write the allowed tokens at the next position into bits (W,) int32, contiguous; a row that
        may only end gets its EOS ids alone."""
        self.m.unsafe_compute_mask_ptr(bits.ctypes.data, bits.nbytes)

    def forced(self) -> list[int]:
        """The tokens the grammar forces from here (empty when the next token is free)."""
        return self.m.compute_ff_tokens()

    def forced_bytes(self) -> bytes:
        """The bytes the grammar forces from here, also where no token is forced (several tokenizations
        of them are allowed: `":"` as one token or as `":` and `"`)."""
        return bytes(self.m.compute_ff_bytes())

    @property
    def stopped(self) -> bool:
        """Whether only the end may come next (the output is complete and cannot go on)."""
        return self.m.is_stopped()

    def accepts(self, token: int) -> bool:
        """Whether `token` may come next and is not the end; when it may, it is consumed."""
        return token not in self.eos and self.m.try_consume_tokens([token]) == 1

    def ends(self, token: int) -> bool:
        """Whether `token` is an EOS the grammar allows here (the output is complete)."""
        return token in self.eos and self.m.is_accepting()

    def advance(self, tokens: list[int]) -> None:
        """Consume tokens the grammar allows (the engine emits only such); an EOS ends the row, so
        it and anything after it are not consumed."""
        tokens = before_eos(tokens, self.eos)
        if tokens and not self.m.consume_tokens(tokens):
            raise SpecdecError(f"the constraint refused tokens {tokens} that its own mask allowed{self.reason()}; "
                               "this is a bug in specdec: please report it with the request")

    def rollback(self, n: int) -> None:
        if n and not self.m.rollback(n):
            raise SpecdecError(f"the constraint could not roll back {n} tokens{self.reason()}")

    free = False  # a grammar holds to the end


class FirstTokenMatcher:
    """One row under a FirstToken rule: the set before any token is consumed, every token after."""

    def __init__(self, rule: FirstToken):
        self.first, self.eos, self.consumed = rule.bits, rule.eos, 0
        self.ok = flags(rule.bits, 32 * len(rule.bits))  # (32 W,) bool

    stopped = False  # never only the end

    def mask_into(self, bits: np.ndarray) -> None:
        bits[:] = self.first if not self.consumed else -1

    def forced(self) -> list[int]:
        return []

    def forced_bytes(self) -> bytes:
        return b""

    def accepts(self, token: int) -> bool:
        ok = token not in self.eos and (self.consumed > 0 or bool(self.ok[token]))
        self.consumed += ok
        return ok

    def ends(self, token: int) -> bool:
        return token in self.eos and (self.consumed > 0 or bool(self.ok[token]))

    def advance(self, tokens: list[int]) -> None:
        self.consumed += len(before_eos(tokens, self.eos))

    def rollback(self, n: int) -> None:
        self.consumed -= n

    @property
    def free(self) -> bool:
        """Whether the rule restricts nothing more: its first token consumed."""
        return self.consumed > 0


def before_eos(tokens: list[int], eos: frozenset[int]) -> list[int]:
    """The tokens before the first EOS (all of them without one): what a matcher consumes."""
    return next((tokens[:i] for i, t in enumerate(tokens) if t in eos), tokens)


def flags(bits: np.ndarray, vocab: int) -> np.ndarray:
    """(..., W) int32 bitmasks (bit j of word w: token 32 w + j) -> (..., V) NumPy bool."""
    unpacked = np.unpackbits(np.ascontiguousarray(bits).view(np.uint8), axis=-1, bitorder="little")
    return unpacked.view(bool)[..., :vocab]


def allowed(bits: np.ndarray, vocab: int) -> torch.Tensor:
    """(..., W) int32 bitmasks -> (..., V) bool tensor."""
    return torch.from_numpy(np.ascontiguousarray(flags(bits, vocab)))


def masked(logits: torch.Tensor, bits: np.ndarray, ids: np.ndarray | None = None) -> torch.Tensor:
    """logits (..., V) with -inf where the bitmasks bits (..., W) refuse the token; ids (N,): the
    logits are those of these token ids only, (..., N) (a draft vocabulary)."""
    ok = flags(bits, logits.shape[-1]) if ids is None else flags(bits, 32 * bits.shape[-1])[..., ids]
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return torch.from_numpy(np.where(ok, logits.numpy(), np.float32(-np.inf)))
    return torch.where(torch.from_numpy(np.ascontiguousarray(ok)).to(logits.device), logits, float("-inf"))
