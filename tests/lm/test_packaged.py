"""Packaged models (lm/packaged.py) on small fake parts written here as installed packages: the parts
assemble in their numeric order (part 10 after part 9) once, into the cache, checked against the
recorded hash (a wrong one leaves nothing behind); a short name resolves to the file wherever a model
path is taken, other paths pass unchanged; a missing part names the command that installs it."""
from __future__ import annotations

import hashlib

import pytest

from specdec.cli import main
from specdec.errors import SpecdecError
from specdec.lm import packaged

PARTS = 11


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """A packaged model "fake-model" of 11 parts installed as packages fake_pkg_partN in tmp_path (on
    sys.path), the cache in tmp_path/cache. Returns (the model, the bytes it assembles to)."""
    site = tmp_path / "site"
    chunks = [bytes([i]) * (1000 + 37 * i) for i in range(1, PARTS + 1)]  # each part's bytes differ
    for i, chunk in enumerate(chunks, 1):
        folder = site / f"fake_pkg_part{i}"
        (folder / "data").mkdir(parents=True)
        (folder / "__init__.py").write_text("")
        (folder / "data" / f"part{i:02d}.bin").write_bytes(chunk)
    whole = b"".join(chunks)
    model = packaged.Packaged("fake-model", "Fake.gguf", "fake-pkg-part{i}", PARTS, "1.0",
                              hashlib.sha256(whole).hexdigest(), len(whole), "a fake model")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setitem(packaged.PACKAGED, model.name, model)
    return model, whole


def test_the_parts_assemble_in_order_once_and_the_name_resolves_to_the_file(fake):
    model, whole = fake
    path = packaged.resolve("fake-model")
    assert path.read_bytes() == whole and path.parent == packaged.cache_root()
    assert [p.name for p in path.parent.iterdir()] == ["Fake.gguf"]  # nothing else left beside it
    for part in model.part_paths():  # once assembled, the cache is read: the parts are no longer needed
        part.unlink()
    assert packaged.resolve("fake-model") == path
    assert packaged.resolve("some/folder") == "some/folder"


def test_a_wrong_hash_is_refused_and_leaves_no_file(fake, monkeypatch):
    model, _ = fake
    wrong = packaged.Packaged(**{**model.__dict__, "sha256": "0" * 64})
    monkeypatch.setitem(packaged.PACKAGED, model.name, wrong)
    with pytest.raises(SpecdecError, match="assemble to sha256 .* not the recorded 0000"):
        packaged.resolve("fake-model")
    assert not packaged.cache_root().exists() or not list(packaged.cache_root().iterdir())


def test_a_missing_part_names_the_install_command(fake):
    model, _ = fake
    model.part_paths()[4].unlink()
    with pytest.raises(SpecdecError, match=r"1 of its 11 parts are missing \(part 5: fake-pkg-part5==1.0\).*"
                                           r"specdec pair install fake-model"):
        packaged.resolve("fake-model")


def test_the_model_options_take_the_short_name(fake, monkeypatch):
    """--model and --draft-model go through packaged.resolve (api.load, checkpoint_folder, the drafters)."""
    from specdec import api
    from specdec.proposers import DRAFTERS

    model, _ = fake
    with pytest.raises(SpecdecError, match=r"Fake\.gguf is not a readable GGUF file"):  # our bytes are no GGUF
        api.load("fake-model")
    assert DRAFTERS["draft-model"].folder("fake-model") == packaged.cache_root() / "Fake.gguf"


def test_pair_list_says_where_each_stands(fake, capsys):
    assert main(["pair", "list", "fake-model"]) == 0
    assert "assembled on first use" in capsys.readouterr().out
    assert main(["pair", "install", "fake-model"]) == 0  # installed already: assembles
    assert str(packaged.cache_root() / "Fake.gguf") in capsys.readouterr().out
    assert main(["pair", "list", "fake-model"]) == 0
    assert str(packaged.cache_root() / "Fake.gguf") in capsys.readouterr().out
    assert main(["pair", "list", "nothing"]) == 2
