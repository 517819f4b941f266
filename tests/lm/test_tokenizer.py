"""Byte-level BPE: any UTF-8 text round-trips exactly."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec.errors import SpecdecError
from specdec.lm.tokenizer import EOS_ID, Tokenizer


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


def foreign_checkpoint_tokenizer(folder, bos_first: bool, config: dict, generation: dict | None = None,
                                 tokenizer_config: dict | None = None):
    """A transformers tokenizer folder (byte-level BPE trained here, Llama-3-like when bos_first:
    its post-processor puts <|begin_of_text|> first; Qwen-like otherwise: no BOS), with the
    checkpoint's config.json and generation_config.json beside it."""
    import json
    import sysconfig
    from pathlib import Path

    import transformers
    from tokenizers import Tokenizer as Raw
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers
    raw = Raw(models.BPE())
    raw.pre_tokenizer, raw.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    raw.train_from_iterator([Path(sysconfig.get_paths()["stdlib"], "textwrap.py").read_text()], trainer=trainer)
    if bos_first:
        raw.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                                           special_tokens=[("<|begin_of_text|>", 0)])
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<|begin_of_text|>" if bos_first else None,
                                                eos_token="<|eot_id|>")
    fast.save_pretrained(folder)
    if tokenizer_config:
        path = folder / "tokenizer_config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **tokenizer_config}))
    (folder / "config.json").write_text(json.dumps(config))
    if generation is not None:
        (folder / "generation_config.json").write_text(json.dumps(generation))
    return transformers.AutoTokenizer.from_pretrained(folder)


@pytest.mark.parametrize("bos_first", [True, False], ids=["llama3-like", "qwen-like"])
def test_a_foreign_checkpoints_prompts_follow_its_own_rules_as_transformers_encodes_them(tmp_path, bos_first):
    hf = foreign_checkpoint_tokenizer(tmp_path, bos_first, {"bos_token_id": 0, "eos_token_id": 1},
                                      {"eos_token_id": [1, 2]})
    tok = Tokenizer.load(tmp_path)
    for text in ("def f(x):\n    return x", "a"):
        assert tok.prefix + tok.encode(text) == hf(text).input_ids
    assert tok.prefix == ([0] if bos_first else [])
    assert tok.eos_ids == (1, 2)  # generation_config's list, as transformers' generate stops


def test_add_bos_token_in_tokenizer_config_decides_and_eos_falls_back_to_config(tmp_path):
    foreign_checkpoint_tokenizer(tmp_path, False, {"bos_token_id": 0, "eos_token_id": 2},
                                 tokenizer_config={"add_bos_token": True, "bos_token": "<|begin_of_text|>"})
    tok = Tokenizer.load(tmp_path)
    assert tok.prefix == [0] and tok.eos_ids == (2,)


def test_specdecs_own_models_keep_the_document_separator_first(tiny_checkpoint):
    tok = Tokenizer.load(tiny_checkpoint)
    assert tok.prefix == [EOS_ID] and tok.eos_ids == (EOS_ID,)


@settings(max_examples=200, deadline=None)
@given(pieces=st.lists(st.sampled_from(["a", " ", "<", "|", ">", "end", "of", "text", "\n", "<|endoftext|>"]),
                       max_size=12))
def test_special_token_text_is_encoded_as_text_with_a_copy_made_only_for_text_that_holds_some(tokenizer_file, pieces):
    text = "".join(pieces)
    tokenizer = Tokenizer.load(tokenizer_file)
    copy = type(tokenizer.tok).from_str(tokenizer.tok.to_str())
    copy.encode_special_tokens = True
    assert tokenizer.encode(text, special_tokens=False) == copy.encode(text, add_special_tokens=False).ids
    assert ("text_only" in vars(tokenizer)) == ("<|endoftext|>" in text)  # the copy: tens of MB for a real vocabulary
