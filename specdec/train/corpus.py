"""Training text: the running interpreter's standard library by default, or files the user names.

Documents are split deterministically by a hash of their name, so the same corpus always gives
the same train/validation split; every `test/`, `tests/` and `idle_test/` folder of the standard
library is held out entirely as the evaluation set. `Corpus.provenance()` lists the files and one
hash over their contents; it is stored with every trained model.

This module knows nothing about tokens or models.
"""
from __future__ import annotations

import hashlib
import json
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from ..errors import SpecdecError

HELD_OUT_DIRS = {"test", "tests", "idle_test"}
TEXT_SUFFIXES = {".py", ".txt", ".md", ".rst", ".jsonl"}
STDLIB = "stdlib"


@dataclass(frozen=True)
class Document:
    name: str   # stable identifier (path relative to its root, plus a line number for jsonl)
    text: str


def _split(name: str, valid_percent: float) -> str:
    bucket = int(hashlib.sha256(name.encode()).hexdigest()[:8], 16) % 10_000
    return "valid" if bucket < valid_percent * 100 else "train"


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise SpecdecError(f"cannot read corpus file {path} ({e}); pass readable UTF-8 text, .jsonl "
                           "files or folders") from None


def _jsonl(path: Path, name: str):
    for i, line in enumerate(_read(path).splitlines()):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise SpecdecError(f"{path}:{i + 1} is not valid JSON ({e}); each line must be a JSON "
                               'string or an object with a "text" field') from None
        text = row if isinstance(row, str) else row.get("text") if isinstance(row, dict) else None
        if not isinstance(text, str):
            raise SpecdecError(f'{path}:{i + 1} has no "text" string field')
        yield Document(f"{name}:{i + 1}", text)


def _documents(source: Path, root: Path):
    name = source.relative_to(root).as_posix() if source != root else source.name
    if source.suffix == ".jsonl":
        yield from _jsonl(source, name)
    else:
        yield Document(name, _read(source))


class Corpus:
    """Documents split into 'train', 'valid' and (standard library only) 'test'."""

    def __init__(self, sources: list[str] | None = None, valid_percent: float = 2.0):
        self.sources = sources or [STDLIB]
        self.splits: dict[str, list[Document]] = {"train": [], "valid": [], "test": []}
        for source in self.sources:
            if source == STDLIB:
                self._add_stdlib(valid_percent)
            else:
                self._add_path(Path(source), valid_percent)
        if not self.splits["train"]:
            raise SpecdecError(f"the corpus {self.sources} has no training text; name files or folders "
                               f"with one of the suffixes {sorted(TEXT_SUFFIXES)}")

    def _add_stdlib(self, valid_percent: float):
        root, files = source_files(STDLIB)
        for f in files:
            rel = f.relative_to(root)
            doc = Document(f"{STDLIB}/{rel.as_posix()}", _read_lenient(f))
            held_out = HELD_OUT_DIRS & set(rel.parts[:-1])
            self.splits["test" if held_out else _split(doc.name, valid_percent)].append(doc)

    def _add_path(self, path: Path, valid_percent: float):
        root, files = source_files(str(path))
        for f in files:
            for doc in _documents(f, root):
                self.splits[_split(doc.name, valid_percent)].append(doc)

    def provenance(self) -> dict:
        h = hashlib.sha256()
        for split in ("train", "valid", "test"):
            for doc in self.splits[split]:
                h.update(f"{split}\0{doc.name}\0".encode())
                h.update(hashlib.sha256(doc.text.encode()).digest())
        return {"sources": self.sources, "sha256": h.hexdigest(),
                "files": {s: [d.name for d in docs] for s, docs in self.splits.items()}}


def source_files(source: str) -> tuple[Path, list[Path]]:
    """The root and the sorted files one corpus source reads (STDLIB, a folder or a file)."""
    if source == STDLIB:
        root = Path(sysconfig.get_paths()["stdlib"])
        return root, [f for f in sorted(root.rglob("*.py")) if "site-packages" not in f.relative_to(root).parts]
    path = Path(source)
    if not path.exists():
        raise SpecdecError(f"corpus path {path} does not exist; name text/.jsonl files or folders")
    if not path.is_dir():
        return path, [path]
    return path, sorted(f for f in path.rglob("*") if f.is_file() and f.suffix in TEXT_SUFFIXES)


def fingerprint(sources: list[str] | None) -> str:
    """A hash of every file the corpus would read, by path, size and modification time: it
    changes when a file is added, removed or edited, without reading any text."""
    h = hashlib.sha256()
    for source in sources or [STDLIB]:
        root, files = source_files(source)
        h.update(f"{source}\0{root.resolve()}\0".encode())
        for f in files:
            st = f.stat()
            h.update(f"{f.relative_to(root) if f != root else f.name}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
    return h.hexdigest()


def _read_lenient(path: Path) -> str:
    # a handful of standard-library files are deliberately not UTF-8 (encoding tests); keep them
    # byte-exact by decoding as latin-1 rather than dropping them silently
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        return path.read_text(encoding="latin-1")
