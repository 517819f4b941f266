"""lm/local_counts: the counts a GGUF draft's vocabulary is chosen from, made from local text."""
from __future__ import annotations

import json

import torch

from specdec.lm import local_counts

from ..gguf_helpers import VOCAB, byte_level_tokenizer

CODE = ["def add(a, b):\n    return a + b\n\n" * 200]
CHAT = ["Sure! Here are three tips for a calm evening."]


def test_each_part_weighs_alike_whatever_its_size(monkeypatch):
    """200 lines of code beside one sentence of chat: the sentence's ids weigh as much in all as the
    code's, so the most frequent ids hold them as well as the code's."""
    tok = byte_level_tokenizer()
    monkeypatch.setattr(local_counts, "corpus", lambda: {"code": CODE, "chat": CHAT})
    counts = local_counts.token_counts(tok, VOCAB)
    added = list(tok.get_added_tokens_decoder())
    counts[added] = 0
    code_ids = set(tok.encode(CODE[0]).ids)
    chat_ids = set(tok.encode(CHAT[0]).ids) - code_ids
    code_sum = sum(int(counts[i]) for i in code_ids)
    chat_sum = sum(int(counts[i]) for i in chat_ids)
    assert abs(code_sum + chat_sum - 2 * local_counts.SCALE) <= 2 * VOCAB  # each part sums to SCALE
    assert chat_sum >= 0.5 * local_counts.SCALE  # the sentence's own ids: most of its part
    top = set(counts.argsort(descending=True)[:len(code_ids) + len(chat_ids)].tolist())
    assert chat_ids <= top


def test_the_shipped_chat_text_is_there_and_apart_from_the_benchmarks_prompts():
    from specdec.bench.workloads import CHAT_PROMPTS

    chat = json.loads(local_counts.CHAT.read_text(encoding="utf-8"))
    assert len(chat["prompts"]) == len(chat["answers"]) >= 30 and all(chat["answers"])
    assert not set(chat["prompts"]) & set(CHAT_PROMPTS)
    assert set(local_counts.corpus()) == {"code", "prose", "chat"}


def test_counts_are_made_once_per_folder_and_corpus_version(tmp_path, monkeypatch):
    """Saved under the corpus's VERSION: read back after; counts saved by another version are not."""
    tok = byte_level_tokenizer()
    (tmp_path / f"local_token_counts-v{local_counts.VERSION - 1}.safetensors").write_bytes(b"an older corpus's")
    monkeypatch.setattr(local_counts, "corpus", lambda: {"code": CODE})
    made = local_counts.counted_once(tmp_path, tok, VOCAB)
    assert made.sum() > 0

    def failing():
        raise AssertionError("the saved counts are read, not counted again")
    monkeypatch.setattr(local_counts, "corpus", failing)
    assert torch.equal(local_counts.counted_once(tmp_path, tok, VOCAB), made)
