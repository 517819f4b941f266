"""A checkpoint's tokenizer (the `tokenizers` library, tokenizer.json) and its prompt rules.

specdec's own tokenizers are byte-level BPE: every UTF-8 string encodes and decodes back to
itself exactly; no text is normalised. Special tokens: <|pad|> = 0, <|bos|> = 1, <|endoftext|> = 2
(the EOS). Every training document ended with <|endoftext|>, so a prompt to specdec's own models
starts with it.

Another checkpoint's prompts follow its own rules, as transformers applies them: the BOS from
tokenizer_config.json (`bos_token`) or config.json, put first where `add_bos_token` says so (or,
without that key, where tokenizer.json's post-processor adds it); generation ends at any id of its
end-of-generation set (`end_of_generation`): generation_config.json's eos_token_id (a list for
Llama-3), else config.json's, else tokenizer_config.json's eos_token. A GGUF file's tokenizer is held
in memory (`Tokenizer.held`, built by lm/gguf.py from the file's metadata) under the same rules, its
config (llama.cpp's end-of-generation set: gguf.end_ids) and its tokenizer settings given as dicts.

Special tokens stand for no text: `decode` leaves them out unless asked (skip_special_tokens=False).

A chat (`template`: used by `specdec serve`'s /v1/chat/completions, `specdec generate --chat` and
`api.generate(messages=...)`) becomes the prompt's ids by the checkpoint's own chat template,
rendered by transformers exactly as `tokenizer.apply_chat_template(messages,
add_generation_prompt=True)` renders it. The template comes from the checkpoint folder
(tokenizer_config.json's "chat_template" or a chat_template.jinja file, as transformers reads them),
or from the transformers tokenizer a GGUF file's metadata built in memory;
a model without one is refused with a clear SpecdecError. Special-token text inside a message (e.g.
a user typing "<|endoftext|>") is encoded as text, not as the control token (transformers'
sanitize_control_tokens); the template's own control tokens are encoded as tokens. The template's
end-of-turn token (its eos_token, when it is not the target's <|endoftext|>) is a stop string of
every chat request (a stop string that is a special token's text ends the row at that token:
decoding/pipeline.py).

This module knows nothing about models, sampling or serving.
"""
from __future__ import annotations

import copy
import json
import threading
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Iterable

from tokenizers import Tokenizer as _HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from ..errors import SpecdecError

SPECIAL = ["<|pad|>", "<|bos|>", "<|endoftext|>"]
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2


def byte_level_alphabet() -> dict[str, int]:
    """The characters byte-level BPE writes its tokens with, and the byte each stands for: the
    188 printable bytes stand for themselves, the other 68 for the characters 256.. in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + i): b for i, b in enumerate(others)}}


class Tokenizer:
    def __init__(self, tok: _HFTokenizer, prefix: tuple[int, ...] = (EOS_ID,), eos_ids: tuple[int, ...] = (EOS_ID,),
                 folder: Path | None = None, chat=None):
        """prefix: the ids every prompt starts with; eos_ids: the ids that end a generation; folder:
        the checkpoint folder it was loaded from (its chat template is there), if any; chat: the
        HeldChat that renders the chat template instead (a GGUF file's)."""
        self.tok = tok
        self.prefix, self.eos_ids = list(prefix), tuple(eos_ids)
        self.eos_id = eos_ids[0] if eos_ids else None
        self.folder = folder
        self.chat = chat

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int) -> "Tokenizer":
        tok = _HFTokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                      show_progress=False)
        tok.train_from_iterator(texts, trainer=trainer)
        return cls(tok)

    @classmethod
    def load(cls, path: str | Path) -> "Tokenizer":
        """tokenizer.json of a checkpoint folder, or the file itself, with the rules of the folder
        it is in (specdec's own, or a foreign checkpoint's: see the module docstring)."""
        path = Path(path)
        file = path / "tokenizer.json" if path.is_dir() else path
        try:
            tok = _HFTokenizer.from_file(str(file))
        except Exception as e:  # the Rust library raises a bare Exception for every failure
            raise SpecdecError(f"cannot load tokenizer {file} ({e}); a checkpoint folder must hold the "
                               "tokenizer.json it was trained with") from None
        folder = file.parent
        if is_specdecs(tok, folder):
            return cls(tok, folder=folder)
        return cls(tok, *prompt_rules(tok, folder), folder=folder)

    @classmethod
    def held(cls, tok: _HFTokenizer, chat, settings: dict, config: dict, where: str) -> "Tokenizer":
        """A foreign checkpoint's tokenizer held in memory (a GGUF file's, lm/gguf.py): `tok` its
        tokenizer, `chat` the transformers tokenizer whose copy renders its chat template (`HeldChat`: `tok`
        may be its backend), `settings` what a tokenizer_config.json would say (bos_token, eos_token,
        add_bos_token), `config` its config.json's keys; the prompt rules are a folder's (`rules`).
        `where` names it in errors."""
        return cls(tok, *rules(tok, settings, config, {}, where), chat=HeldChat(chat))

    @property
    def has_chat_template(self) -> bool:
        """Whether the checkpoint has a chat template, without loading transformers for a folder (seconds)."""
        if self.chat is not None:
            return bool(self.chat.chat_template)
        return self.folder is not None and has_template(self.folder)

    def chat_template(self) -> "ChatTemplate":
        """The checkpoint's chat template (ChatTemplate), or SpecdecError where it has none."""
        if self.chat is not None:
            return held_template(self.chat.tokenizer())
        if self.folder is None:
            raise SpecdecError("a chat needs the checkpoint's chat template: load the tokenizer from its folder "
                               "or its GGUF file")
        return template(self.folder)

    def save(self, path: str | Path) -> None:
        self.tok.save(str(path))

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size()

    def encode(self, text: str, special_tokens: bool = True) -> list[int]:
        """The ids of `text`; special_tokens=False encodes special-token text in it ("<|im_start|>")
        as the characters it is, not as the control token."""
        tok = self.tok if special_tokens or not self.holds_special_text(text) else self.text_only
        return tok.encode(text, add_special_tokens=False).ids

    def holds_special_text(self, text: str) -> bool:
        """Whether `text` holds a special token's text, so that encoding it as text differs from encoding
        it with control tokens (else the two agree, and no copy of the tokenizer is needed)."""
        return self.special_texts is None or any(special in text for special in self.special_texts)

    @cached_property
    def special_texts(self) -> tuple[str, ...] | None:
        """The special tokens' texts as the tokenizer finds them in raw text; None where one is found
        in the normalized text instead (any text may then hold it)."""
        added = [t for t in self.tok.get_added_tokens_decoder().values() if t.special]
        return None if any(t.normalized for t in added) else tuple(t.content for t in added)

    @cached_property
    def text_only(self) -> _HFTokenizer:
        """A copy of the tokenizer that encodes special-token text as text (a copy: the setting is
        the tokenizer's, and threads encode with both at once), made for the first text that holds some
        (a vocabulary's copy is tens of MB)."""
        tok = _HFTokenizer.from_str(self.tok.to_str())
        tok.encode_special_tokens = True
        return tok

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tok.encode_batch(texts, add_special_tokens=False)]

    @cached_property
    def special_ids(self) -> dict[str, int]:
        """The special tokens' ids by their text (the tokens `decode` leaves out)."""
        return {t.content: i for i, t in self.tok.get_added_tokens_decoder().items() if t.special}

    @cached_property
    def token_bytes(self) -> list[bytes | None]:
        """The bytes each token id stands for (None: a special token, which stands for no text);
        a token not written in the byte-level alphabet (a SentencePiece-style vocabulary) by its
        decoded text."""
        alphabet = byte_level_alphabet()
        special = {t.content for t in self.tok.get_added_tokens_decoder().values()}
        table: list[bytes | None] = [None] * self.vocab_size
        for token, i in self.tok.get_vocab().items():
            if token in special:
                continue
            if all(c in alphabet for c in token):
                table[i] = bytes(alphabet[c] for c in token)
            else:
                table[i] = self.tok.decode([i], skip_special_tokens=False).encode("utf-8")
        return table

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """The text of `ids`; special tokens ("<|im_end|>", "<|fim_pad|>") are left out unless
        skip_special_tokens=False."""
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


TOKENIZER_CONFIG, MODEL_CONFIG, GENERATION_CONFIG = "tokenizer_config.json", "config.json", "generation_config.json"


def is_specdecs(tok: _HFTokenizer, folder: Path) -> bool:
    """A tokenizer trained by specdec: its special tokens at their ids, no transformers tokenizer_config."""
    return (not (folder / TOKENIZER_CONFIG).exists()
            and [tok.token_to_id(t) for t in SPECIAL] == [PAD_ID, BOS_ID, EOS_ID])


def _json(path: Path) -> dict:
    try:
        return json.loads(path.read_text()) if path.exists() else {}
    except json.JSONDecodeError as e:
        raise SpecdecError(f"{path} is not valid JSON ({e}); re-download or re-save the checkpoint") from None


def _token_id(tok: _HFTokenizer, token, where: Path) -> int | None:
    """The id of a special token given as text (or transformers' {"content": text})."""
    if token is None:
        return None
    text = token.get("content") if isinstance(token, dict) else token
    i = tok.token_to_id(text)
    if i is None:
        raise SpecdecError(f"{where} names the special token {text!r}, which tokenizer.json does not have")
    return i


def _ids(value) -> tuple[int, ...]:
    return () if value is None else (value,) if isinstance(value, int) else tuple(value)


def prompt_rules(tok: _HFTokenizer, folder: Path) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(prefix, eos_ids) of a transformers checkpoint folder (see the module docstring)."""
    tcfg, cfg, gen = (_json(folder / name) for name in (TOKENIZER_CONFIG, MODEL_CONFIG, GENERATION_CONFIG))
    return rules(tok, tcfg, cfg, gen, folder / TOKENIZER_CONFIG)


def rules(tok: _HFTokenizer, tcfg: dict, cfg: dict, gen: dict, where) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(prefix, eos_ids) of a checkpoint whose tokenizer_config.json, config.json and
    generation_config.json say `tcfg`, `cfg` and `gen` (see the module docstring)."""
    bos = _token_id(tok, tcfg.get("bos_token"), where)
    if bos is None:
        bos = cfg.get("bos_token_id", gen.get("bos_token_id"))
    if "add_bos_token" in tcfg:
        prefix = (bos,) if tcfg["add_bos_token"] and bos is not None else ()
    else:  # what tokenizer.json's post-processor puts before a text, as transformers encodes it
        bare, full = tok.encode("a", add_special_tokens=False).ids, tok.encode("a", add_special_tokens=True).ids
        starts = [i for i in range(len(full) - len(bare) + 1) if full[i:i + len(bare)] == bare]
        prefix = tuple(full[:starts[0]]) if starts else ()
    return prefix, end_of_generation(tok, tcfg, cfg, gen, where)


def end_of_generation(tok: _HFTokenizer, tcfg: dict, cfg: dict, gen: dict, where) -> tuple[int, ...]:
    """The ids that end a generation, any one of them: generation_config.json's eos_token_id (one id
    or a list), else config.json's, else tokenizer_config.json's eos_token (a GGUF file's:
    llama.cpp's set, in its config by gguf.end_ids)."""
    eos = _ids(gen.get("eos_token_id")) or _ids(cfg.get("eos_token_id"))
    return eos or _ids(_token_id(tok, tcfg.get("eos_token"), where))


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
    """The chat template of a checkpoint, through its transformers tokenizer (`name` names the model)."""

    def __init__(self, tokenizer, name: str):
        self.tokenizer = tokenizer
        if not self.tokenizer.chat_template:
            raise SpecdecError(f"the model {name} has no chat template (no \"chat_template\" in its "
                               "tokenizer_config.json or its GGUF metadata, no chat_template.jinja): send a plain "
                               "prompt to /v1/completions (command line: generate without --chat)")
        eos = self.tokenizer.eos_token
        self.stops: tuple[str, ...] = (eos,) if eos and eos != "<|endoftext|>" else ()

    def render(self, messages) -> str:
        """The prompt text transformers renders, with the assistant's turn opened."""
        return self.tokenizer.apply_chat_template(check_messages(messages), tokenize=False, add_generation_prompt=True)

    def ids(self, messages) -> list[int]:
        """The rendered prompt's token ids (message text encoded as text, control tokens as tokens)."""
        return list(self.tokenizer.apply_chat_template(check_messages(messages), tokenize=True, return_dict=False,
                                                       add_generation_prompt=True, sanitize_control_tokens=True))


class HeldChat:
    """A transformers tokenizer held in memory for its chat template, used through a copy made when a
    chat first needs it: transformers sets its own options on the backend a tokenizer holds, and the
    source's backend may be the one specdec encodes prompts with (a second copy of a 151k vocabulary,
    tens of MB, that a plain decode never needs)."""

    def __init__(self, source):
        self.source, self.chat_template, self.copy = source, source.chat_template, None

    def tokenizer(self):
        with LOADING:
            if self.copy is None:
                self.copy = copy.deepcopy(self.source)
        return self.copy


# transformers imports its classes lazily, and not thread-safely: the server encodes requests on
# several threads, and concurrent first chat requests saw "cannot import name 'AutoTokenizer'"
LOADING = threading.Lock()


def template(folder: str | Path) -> ChatTemplate:
    """The folder's template, read once, by one thread at a time."""
    with LOADING:
        return read_template(folder)


@lru_cache(maxsize=8)
def read_template(folder: str | Path) -> ChatTemplate:
    from transformers import AutoTokenizer

    folder = Path(folder)
    return ChatTemplate(AutoTokenizer.from_pretrained(str(folder), local_files_only=True), folder.name)


def held_template(tokenizer) -> ChatTemplate:
    """The chat template of a transformers tokenizer held in memory (a GGUF file's)."""
    return ChatTemplate(tokenizer, tokenizer.name_or_path or "loaded from a GGUF file")


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
