"""Shared fixtures: tiny real models and a real tokenizer, built in seconds, never downloaded."""
from __future__ import annotations

import socket
import sysconfig
from pathlib import Path

import pytest
import torch

from specdec.lm.arch import Arch
from specdec.lm.checkpoint import save_model
from specdec.lm.model import LlamaForCausalLM
from specdec.lm.tokenizer import Tokenizer
from specdec.train.objectives import init_weights

# tiny models run fastest on one thread, and one thread keeps timings of other jobs undisturbed
torch.set_num_threads(1)

TINY = Arch(vocab_size=384, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256)


def tiny_model(seed: int = 0, cfg: Arch = TINY) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    init_weights(model, std=0.1)  # larger than training init so that logits are far from ties
    return model.eval()


@pytest.fixture(scope="session")
def tokenizer_file(tmp_path_factory) -> Path:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = [(stdlib / name).read_text() for name in ("json/encoder.py", "json/decoder.py", "textwrap.py")]
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    Tokenizer.train(texts, TINY.vocab_size).save(path)
    return path


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory, tokenizer_file) -> Path:
    path = tmp_path_factory.mktemp("ckpt") / "tiny"
    save_model(tiny_model(), path, tokenizer_file=tokenizer_file, dtype=torch.float32)
    return path


@pytest.fixture(scope="session")
def draft_checkpoint(tmp_path_factory, tokenizer_file, tiny_checkpoint) -> Path:
    """A draft for tiny_checkpoint: a noisy copy of it, so it agrees often, not always."""
    from .spec_helpers import noisy_copy
    path = tmp_path_factory.mktemp("draft") / "tiny-draft"
    save_model(noisy_copy(tiny_model(), 0.01, seed=3), path, tokenizer_file=tokenizer_file, dtype=torch.float32)
    return path


def free_port() -> int:
    """A TCP port no process listens on now (for torchrun's rendezvous), so that tests running
    side by side never collide on a fixed port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def gguf_cache(tmp_path_factory):
    """The GGUF conversions' cache (lm/gguf.py), private to the test module that uses it; it keeps every
    file's conversion (no eviction: a module's tests read the folders its fixtures converted)."""
    from specdec.lm import gguf

    root = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "cache_root", lambda: root)
        mp.setattr(gguf, "KEEP", 1000)
        yield root
