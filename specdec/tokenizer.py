"""Byte-level BPE tokenizer (the `tokenizers` library), stored as tokenizer.json.

Byte-level means every UTF-8 string encodes and decodes back to itself exactly; no text is
normalised. Special tokens: <|pad|> = 0, <|bos|> = 1, <|endoftext|> = 2 (the EOS).
"""
from __future__ import annotations

from functools import cached_property
from pathlib import Path
from typing import Iterable

from tokenizers import Tokenizer as _HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from .errors import SpecdecError

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
    def __init__(self, tok: _HFTokenizer):
        self.tok = tok
        self.eos_id = EOS_ID

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
        path = Path(path)
        file = path / "tokenizer.json" if path.is_dir() else path
        try:
            return cls(_HFTokenizer.from_file(str(file)))
        except Exception as e:  # the Rust library raises a bare Exception for every failure
            raise SpecdecError(f"cannot load tokenizer {file} ({e}); a checkpoint folder must hold the "
                               "tokenizer.json it was trained with") from None

    def save(self, path: str | Path) -> None:
        self.tok.save(str(path))

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tok.encode_batch(texts, add_special_tokens=False)]

    @cached_property
    def token_bytes(self) -> list[bytes | None]:
        """The bytes each token id stands for (None: a special token, which stands for no text)."""
        alphabet = byte_level_alphabet()
        special = {t.content for t in self.tok.get_added_tokens_decoder().values()}
        table: list[bytes | None] = [None] * self.vocab_size
        for token, i in self.tok.get_vocab().items():
            if token not in special:
                table[i] = bytes(alphabet[c] for c in token)
        return table

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=False)
