"""Byte-level BPE: any UTF-8 text round-trips exactly."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec.errors import SpecdecError
from specdec.tokenizer import EOS_ID, Tokenizer


@pytest.fixture(scope="module")
def tok(tokenizer_file):
    return Tokenizer.load(tokenizer_file)


@settings(max_examples=300, deadline=None)
@given(text=st.text(st.characters(codec="utf-8"), max_size=200))
def test_any_utf8_text_round_trips(tok, text):
    assert tok.decode(tok.encode(text)) == text


def test_code_round_trips_and_compresses(tok):
    code = 'def f(x):\n    """Doc — ünïcode ✓ 🐍"""\n\treturn x  ** 2\r\n\n'
    ids = tok.encode(code)
    assert tok.decode(ids) == code
    assert len(ids) < len(code.encode())
    assert EOS_ID not in ids


def test_missing_tokenizer_is_a_clear_error(tmp_path):
    with pytest.raises(SpecdecError, match="cannot load tokenizer"):
        Tokenizer.load(tmp_path)
