"""bench/sizes.py: named shapes become loadable random-weight checkpoints (in a cache folder, never
the repository) with the parameter count the table states; the draft designs keep the target's
vocabulary (or EAGLE's draft vocabulary) and width."""
from __future__ import annotations

import json

from specdec.api import load
from specdec.bench import sizes
from specdec.lm.arch import Arch


def test_a_size_builds_once_into_the_cache_and_loads(tmp_path):
    cfg = Arch(vocab_size=16384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True)
    path = sizes.build_config("tiny", sizes.Size(cfg, like="a test shape"), cache=tmp_path)
    assert path.parent == tmp_path and json.loads((path / "specdec-size.json").read_text())["size"] == "tiny"
    target = load(path)
    assert target.model.num_parameters() == sizes.parameters(cfg)
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert sizes.build_config("tiny", sizes.Size(cfg, like="a test shape"), cache=tmp_path) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp  # built once


def test_the_named_sizes_and_their_draft_designs():
    assert 0.18e9 < sizes.parameters(sizes.SIZES["0.2b"].config) < 0.26e9
    assert 1.1e9 < sizes.parameters(sizes.SIZES["1b"].config) < 1.3e9
    for name, size in sizes.SIZES.items():
        designs = sizes.draft_designs(name)
        assert designs["mtp"].config.num_hidden_layers == 1 and designs["mtp"].config.vocab_size == size.config.vocab_size
        assert designs["eagle"].config.vocab_size == sizes.EAGLE_DRAFT_VOCAB
        assert designs["draft-model"].config.vocab_size == size.config.vocab_size
