"""A request's tokens, as they arrive step by step, turned into text pieces that are safe to send:
a piece is never taken back. The text is decoded from all tokens so far (byte-level BPE decodes by
concatenation, except a character split across tokens, held back until complete), and a tail that
could be the start of a stop string is held back until it is known not to be one. The final text
(the engine's Row.text: stop string and EOS cut) closes the stream.

Each piece is labelled with who chose its tokens: "draft" (accepted draft tokens) or "target"
(the recovered or bonus token, or every token of plain decoding).
"""
from __future__ import annotations

from typing import Callable


class TextStream:
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
