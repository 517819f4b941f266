"""Chat messages -> the prompt's token ids, by the checkpoint's own chat template, rendered by
transformers exactly as `tokenizer.apply_chat_template(messages, add_generation_prompt=True)`
renders it (used by `specdec serve`'s /v1/chat/completions, `specdec generate --chat` and
`api.generate(messages=...)`).

The template comes from the checkpoint folder (tokenizer_config.json's "chat_template" or a
chat_template.jinja file, as transformers reads them); a model without one is refused with a
clear SpecdecError. Special-token text inside a message (e.g. a user typing "<|endoftext|>") is
encoded as text, not as the control token (transformers' sanitize_control_tokens); the template's
own control tokens are encoded as tokens. The template's end-of-turn token (its eos_token, when it
is not the target's <|endoftext|>) is a stop string of every chat request.

This module knows nothing about models, sampling or serving.
"""
from __future__ import annotations

import json
import threading
from functools import lru_cache
from pathlib import Path

from ..errors import SpecdecError

ROLES = ("system", "user", "assistant", "developer", "tool")


def check_messages(messages) -> list[dict]:
    """OpenAI-style messages: a non-empty list of {"role", "content"}, content text or a list of
    {"type": "text", "text"} parts (joined); returns plain {"role", "content"} dicts."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise SpecdecError("messages must be a non-empty list of {\"role\": ..., \"content\": ...} objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise SpecdecError(f"message {i} must be an object with role and content, got {type(m).__name__}")
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise SpecdecError(f"message {i}: role must be one of {', '.join(ROLES)}, got {role!r}")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise SpecdecError(f"message {i}: content parts must be {{\"type\": \"text\", \"text\": ...}} "
                                   "(specdec serves text only)")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise SpecdecError(f"message {i}: content must be text, got {type(content).__name__}")
        try:
            content.encode("utf-8")
        except UnicodeEncodeError as e:
            raise SpecdecError(f"message {i}: content is not valid UTF-8 text (a lone surrogate at character "
                               f"{e.start}); send UTF-8 encoded text") from None
        out.append({"role": role, "content": content})
    return out


class ChatTemplate:
    """The chat template of a checkpoint folder, through transformers' tokenizer of that folder."""

    def __init__(self, folder: str | Path):
        from transformers import AutoTokenizer

        self.folder = Path(folder)
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.folder), local_files_only=True)
        if not self.tokenizer.chat_template:
            raise SpecdecError(f"the model {self.folder.name} has no chat template (no \"chat_template\" in its "
                               "tokenizer_config.json, no chat_template.jinja): send a plain prompt to "
                               "/v1/completions (command line: generate without --chat)")
        eos = self.tokenizer.eos_token
        self.stops: tuple[str, ...] = (eos,) if eos and eos != "<|endoftext|>" else ()

    def render(self, messages) -> str:
        """The prompt text transformers renders, with the assistant's turn opened."""
        return self.tokenizer.apply_chat_template(check_messages(messages), tokenize=False, add_generation_prompt=True)

    def ids(self, messages) -> list[int]:
        """The rendered prompt's token ids (message text encoded as text, control tokens as tokens)."""
        return list(self.tokenizer.apply_chat_template(check_messages(messages), tokenize=True, return_dict=False,
                                                       add_generation_prompt=True, sanitize_control_tokens=True))


# transformers imports its classes lazily, and not thread-safely: the server encodes requests on
# several threads, and concurrent first chat requests saw "cannot import name 'AutoTokenizer'"
LOADING = threading.Lock()


def template(folder: str | Path) -> ChatTemplate:
    """The folder's template, read once, by one thread at a time."""
    with LOADING:
        return read_template(folder)


@lru_cache(maxsize=8)
def read_template(folder: str | Path) -> ChatTemplate:
    return ChatTemplate(folder)


def has_template(folder: str | Path) -> bool:
    """Whether the folder holds a chat template, without loading transformers (seconds)."""
    folder = Path(folder)
    if (folder / "chat_template.jinja").exists() or (folder / "chat_template.json").exists():
        return True
    config = folder / "tokenizer_config.json"
    try:
        return bool(json.loads(config.read_text()).get("chat_template")) if config.exists() else False
    except (OSError, ValueError, AttributeError):
        return False
