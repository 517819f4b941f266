"""Text or chat messages -> a prompt's token ids and its stop rule, by the checkpoint's own rules:
the one encoding of every entry point (`specdec generate`, the API, `specdec serve`, bench, check).

- Text is text: special-token text typed in a prompt ("<|im_start|>") is encoded as the characters
  it is, never as the control token, unless the caller opts in (special_tokens=True; the command
  line's --special-tokens, a request's "special_tokens": true), as OpenAI's API does.
- The prompt starts with the checkpoint's prefix (tokenizer.py: its BOS where its tokenizer adds
  one; specdec's own models' <|endoftext|>). A chat is rendered by the checkpoint's chat template
  (chat.py), which decides the whole prompt, and ends its turn with the template's end-of-turn text.
- A text ending in whitespace is token-healed (healing.py) unless heal=False: its last token is
  backed off and the first generated token must extend the text.
- Generation ends at any of the checkpoint's EOS ids (its end-of-turn ids among them), at a stop
  string, or after max_new_tokens.

This module knows nothing about models, drafting or serving.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import SpecdecError
from ..lm.chat import template
from ..lm.tokenizer import Tokenizer
from .healing import Healed, back_off
from .stopping import StopRule


@dataclass(frozen=True)
class Prompt:
    ids: list[int]               # the prefix and the prompt's ids (the last one backed off when healed)
    healed: str = ""             # the backed-off text the first generated token must start with ("": none)
    stop: tuple[str, ...] = ()   # stop strings the prompt brings: a chat template's end of turn

    @property
    def length(self) -> int:
        """Tokens of the whole prompt (a healed prompt's backed-off token counted)."""
        return len(self.ids) + bool(self.healed)


def encode(tokenizer: Tokenizer, text: str | None = None, messages: list[dict] | None = None,
           special_tokens: bool = False, heal: bool = True) -> Prompt:
    """The prompt of `text` (to continue) or of chat `messages` (rendered by the template of the
    checkpoint folder the tokenizer was loaded from)."""
    if messages is not None:
        if tokenizer.folder is None:
            raise SpecdecError("a chat needs the checkpoint folder's chat template; load the tokenizer from its folder")
        chat = template(tokenizer.folder)
        return Prompt(chat.ids(messages), "", chat.stops)
    healed = back_off(tokenizer, text, special_tokens) if heal else Healed(tokenizer.encode(text, special_tokens), "")
    return Prompt(tokenizer.prefix + healed.ids, healed.text)


def stop_rule(tokenizer: Tokenizer, max_new_tokens: int, stop: tuple[str, ...] = (), skip: int = 0) -> StopRule:
    """When a generation ends: the checkpoint's EOS ids, the stop strings, max_new_tokens. skip:
    characters at the start of the generated text the stop strings do not see (a healed prompt's
    backed-off text, which the first token repeats)."""
    decode = tokenizer.decode if not skip else (lambda tokens: tokenizer.decode(tokens)[skip:])
    return StopRule(max_new_tokens, tokenizer.eos_ids, stop, decode)
