"""When a row's generation ends: EOS, a stop string, or max_new_tokens — honoured exactly.

Every decoder (reference, plain, speculative) emits tokens one at a time through `Row.emit`,
so a stop that falls inside an accepted run of draft tokens cuts the run there and nothing after
it is emitted.

- EOS (any id of the checkpoint's end-of-generation set): the EOS token is kept in `tokens` (it was
  generated) and left out of the text.
- stop string: `tokens` ends with the token that completed the first occurrence; the text ends
  just before the stop string.
- stop token (a stop string that is a special token's text, which the text does not hold): as an
  EOS, but finishes as a stop string does.
- max_new_tokens: exactly that many tokens at most; a prompt with it must fit the model's context
  (engine.check_fits, the one context rule).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from ..errors import SpecdecError


@dataclass(frozen=True)
class StopRule:
    max_new_tokens: int
    eos_id: int | tuple[int, ...] | None = None  # one id, or several (Llama-3 ends at any of its EOS ids)
    stop_strings: tuple[str, ...] = ()
    decode: Callable[[list[int]], str] | None = None  # needed for stop strings
    stop_tokens: tuple[int, ...] = ()  # ids that end the row as a stop string does

    def __post_init__(self):
        if self.max_new_tokens < 0:
            raise SpecdecError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if any(not s for s in self.stop_strings):
            raise SpecdecError("stop strings must be non-empty")
        if self.stop_strings and self.decode is None:
            raise SpecdecError("stop strings need a tokenizer to decode the generated text")
        eos = self.eos_id
        object.__setattr__(self, "eos_ids", frozenset(() if eos is None else (eos,) if isinstance(eos, int) else eos))


@dataclass
class Row:
    rule: StopRule
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None   # "eos" | "stop" | "length"
    text_end: int | None = None        # where the text ends when a stop string was found

    def __post_init__(self):
        if self.rule.max_new_tokens == 0:
            self.finish_reason = "length"

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def budget(self) -> int:
        """How many more tokens this row may emit."""
        return 0 if self.done else self.rule.max_new_tokens - len(self.tokens)

    def emit(self, token: int) -> bool:
        """Emit one token; return True when the row has finished (then nothing more is taken)."""
        if self.done:
            raise RuntimeError("emit to a finished row")
        self.tokens.append(token)
        if token in self.rule.eos_ids:
            self.finish_reason = "eos"
        elif token in self.rule.stop_tokens:
            self.finish_reason = "stop"
        elif self.rule.stop_strings and self._find_stop():
            self.finish_reason = "stop"
        elif len(self.tokens) >= self.rule.max_new_tokens:
            self.finish_reason = "length"
        return self.done

    def _find_stop(self) -> bool:
        text = self.rule.decode(self.tokens)
        hits = [i for i in (text.find(s) for s in self.rule.stop_strings) if i >= 0]
        if hits:
            self.text_end = min(hits)
        return bool(hits)

    def text(self) -> str:
        by_token = self.finish_reason == "eos" or (self.finish_reason == "stop" and self.text_end is None)
        body = self.tokens[:-1] if by_token else self.tokens
        return self.rule.decode(body)[:self.text_end]


def emit_runs(rows: list[Row], drafts: list[list[int]], paths: list, next_tokens: list[int]
              ) -> tuple[list[list[int]], list[int]]:
    """Emit each row's accepted drafts (the nodes of its path) and then its recovered/bonus token
    through Row.emit, one at a time, so a stop inside the run cuts it. Returns each row's run
    (the path's drafts, the recovered or bonus token, zeros up to 1+m) and the counts emitted:
    accepted + 1, fewer where the row finished, 0 for rows already finished."""
    runs = [[row_drafts[i] for i in path] + [token] + [0] * (len(row_drafts) - len(path))
            for row_drafts, path, token in zip(drafts, paths, next_tokens)]
    return runs, [emit(row, run, len(path) + 1) for row, run, path in zip(rows, runs, paths)]


def emit(row: Row, run: list[int], n: int) -> int:
    """Append run[:n] one token at a time until the row finishes; return how many it took."""
    for i in range(n):
        if row.done:
            return i
        row.emit(run[i])
    return n
