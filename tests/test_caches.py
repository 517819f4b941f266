"""`specdec cache` (specdec/caches.py): each cache's folder under $XDG_CACHE_HOME, its size and what it
holds; clearing the ones named, an unknown name refused before anything is removed."""
from __future__ import annotations

import pytest

from specdec import caches
from specdec.cli import main
from specdec.errors import SpecdecError
from specdec.lm import gguf


def test_specdec_cache_lists_and_clears(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    entry = gguf.cache_root() / "0123456789abcdef-v2" / "m"
    entry.mkdir(parents=True)
    (entry / "model.safetensors").write_bytes(bytes(2000))
    rows = {row["name"]: row for row in caches.listing()}
    assert rows["from-gguf"]["bytes"] == 2000 and rows["from-gguf"]["path"] == tmp_path / "specdec" / "from-gguf"
    assert rows["packaged"]["bytes"] == 0 and set(rows) == set(caches.CACHES)
    assert main(["cache", "list"]) == 0 and "2.0 KB" in capsys.readouterr().out
    with pytest.raises(SpecdecError, match="no cache 'nothing'"):
        caches.clear(["nothing"])
    assert main(["cache", "clear", "from-gguf"]) == 0 and "cleared from-gguf: 2.0 KB" in capsys.readouterr().out
    assert not gguf.cache_root().exists()
