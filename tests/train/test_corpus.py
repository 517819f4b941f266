"""The corpus: deterministic split, held-out standard-library tests, user files, provenance."""
from __future__ import annotations

import json

import pytest

from specdec.errors import SpecdecError
from specdec.train.corpus import HELD_OUT_DIRS, Corpus


def test_standard_library_split_is_deterministic_and_holds_out_test_folders():
    a, b = Corpus(), Corpus()
    assert a.provenance()["sha256"] == b.provenance()["sha256"]
    names = {split: {d.name for d in docs} for split, docs in a.splits.items()}
    assert names["train"] and names["valid"] and names["test"]
    assert not names["train"] & names["valid"]
    for split in ("train", "valid"):
        assert not any(HELD_OUT_DIRS & set(n.split("/")[1:-1]) for n in names[split])
    assert all(HELD_OUT_DIRS & set(n.split("/")[1:-1]) for n in names["test"])


def test_user_files_folders_and_jsonl(tmp_path):
    (tmp_path / "d").mkdir()
    for i in range(60):
        (tmp_path / "d" / f"f{i}.py").write_text(f"x = {i}\n")
    (tmp_path / "d" / "skip.bin").write_bytes(b"\x00\x01")
    rows = [json.dumps({"text": f"row {i}"}) for i in range(40)] + [json.dumps("plain string")]
    (tmp_path / "data.jsonl").write_text("\n".join(rows) + "\n\n")
    c = Corpus([str(tmp_path / "d"), str(tmp_path / "data.jsonl")])
    docs = c.splits["train"] + c.splits["valid"]
    assert len(docs) == 60 + 41 and not c.splits["test"]
    assert {"data.jsonl:41"} <= {d.name for d in docs}
    prov = c.provenance()
    assert prov["sources"] == [str(tmp_path / "d"), str(tmp_path / "data.jsonl")]
    (tmp_path / "d" / "f0.py").write_text("changed\n")
    assert Corpus([str(tmp_path / "d"), str(tmp_path / "data.jsonl")]).provenance()["sha256"] != prov["sha256"]


@pytest.mark.parametrize("setup, message", [
    (lambda p: p / "missing", "does not exist"),
    (lambda p: (p / "bad.jsonl").write_text('{"text": 1}\n') and p / "bad.jsonl", 'no "text" string'),
    (lambda p: (p / "broken.jsonl").write_text("{oops\n") and p / "broken.jsonl", "not valid JSON"),
    (lambda p: (p / "latin.txt").write_bytes(b"caf\xe9") and p / "latin.txt", "cannot read corpus file"),
    (lambda p: (p / "empty").mkdir() or p / "empty", "no training text"),
])
def test_unusable_corpus_paths_are_clear_errors(tmp_path, setup, message):
    with pytest.raises(SpecdecError, match=message):
        Corpus([str(setup(tmp_path))])
