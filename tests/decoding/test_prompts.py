"""One prompt encoding for every entry point (decoding/pipeline.py), by the checkpoint's own rules:
checked through a real `specdec serve` with a Qwen2-style checkpoint built here whose EOS is not 2
and whose tokenizer adds no BOS; its completions and chats equal transformers' greedy decoding of
the ids the checkpoint's rules give, stopping at its EOS. Text is text unless special tokens are
asked for, at every entry point; token healing can be turned off."""
from __future__ import annotations

import json

import httpx
import pytest
import torch
from transformers import PreTrainedTokenizerFast

from specdec import api
from specdec.cli import build_parser, main
from specdec.decoding.pipeline import encode

from ..gguf_helpers import CHATML, byte_level_tokenizer, hf_model
from ..serve_helpers import Server

EOS = "<|im_end|>"
TEXT = "def f(x):\n    return"


@torch.no_grad()
def greedy(model, ids: list[int], n: int) -> list[int]:
    """transformers' greedy decoding of `ids`, `n` tokens, no EOS."""
    model.generation_config.eos_token_id = None
    return model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=0)[0, len(ids):].tolist()


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    """(folder, transformers model, tokenizer, EOS id): a random Qwen2 whose lm_head row of <|im_end|> is
    made a little larger than that of a token it greedily writes after TEXT, not first, so that it
    ends there; its EOS is <|im_end|> (id 319, not 2) and its tokenizer adds no BOS, as Qwen's."""
    tok = byte_level_tokenizer()
    eos = tok.token_to_id(EOS)
    model = hf_model("qwen2", seed=1, tie_word_embeddings=False, bos_token_id=tok.token_to_id("<|endoftext|>"),
                     eos_token_id=eos)
    plain = greedy(model, tok.encode(TEXT).ids, 8)
    new = next(t for i, t in enumerate(plain) if i > 0 and t not in plain[:i])  # a token it writes later first
    with torch.no_grad():
        model.lm_head.weight[eos] = model.lm_head.weight[new] * 1.02
    folder = tmp_path_factory.mktemp("qwen") / "qwen-style"
    model.save_pretrained(folder)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, chat_template=CHATML).save_pretrained(folder)
    return folder, model, tok, eos


def test_the_checkpoints_rules_give_no_bos_and_its_eos(qwen):
    folder, _, tok, eos = qwen
    target = api.load(folder)
    assert target.tokenizer.prefix == [] and target.tokenizer.eos_ids == (eos,) and eos != 2
    assert encode(target.tokenizer, TEXT).ids == tok.encode(TEXT).ids


def test_special_token_text_is_text_unless_asked_for(qwen, tiny_checkpoint):
    for folder in (qwen[0], tiny_checkpoint):
        tokenizer = api.load(folder).tokenizer
        special = tokenizer.tok.token_to_id("<|endoftext|>")
        typed = "a<|endoftext|>b"
        assert special not in encode(tokenizer, typed).ids[len(tokenizer.prefix):]
        assert special in encode(tokenizer, typed, special_tokens=True).ids[len(tokenizer.prefix):]


def test_healing_backs_off_a_trailing_space_unless_turned_off(qwen):
    tokenizer = api.load(qwen[0]).tokenizer
    healed, kept = encode(tokenizer, TEXT + " "), encode(tokenizer, TEXT + " ", heal=False)
    assert healed.healed == " " and healed.length == kept.length and kept.healed == ""
    assert kept.ids == tokenizer.encode(TEXT + " ")


@pytest.fixture(scope="module")
def server(qwen, tmp_path_factory):
    s = Server("--model", str(qwen[0]), log=tmp_path_factory.mktemp("log") / "serve.log")
    yield s
    assert s.stop()


def test_a_served_completion_starts_with_no_bos_and_stops_at_the_checkpoints_eos(qwen, server):
    _, model, tok, eos = qwen
    ids = tok.encode(TEXT).ids
    want = greedy(model, ids, 8)
    end = want.index(eos)
    assert 0 < end < 8 and 2 not in want[:end]
    got = httpx.post(server.url + "/v1/completions", json={"prompt": TEXT, "max_tokens": 8, "temperature": 0},
                     timeout=60).json()
    assert got["specdec"]["token_ids"] == want[:end + 1]
    assert got["choices"][0]["finish_reason"] == "stop" and got["usage"]["prompt_tokens"] == len(ids)


def test_a_served_prompt_is_not_healed_when_asked_and_special_text_stays_text(qwen, server):
    _, model, tok, eos = qwen
    for body, ids in (({"prompt": TEXT + " ", "heal": False}, tok.encode(TEXT + " ").ids),
                      ({"prompt": "<|im_start|>" + TEXT}, byte_level_ids(tok, "<|im_start|>" + TEXT))):
        want = greedy(model, ids, 6)
        want = want[:want.index(eos) + 1] if eos in want else want
        got = httpx.post(server.url + "/v1/completions", json={**body, "max_tokens": 6, "temperature": 0},
                         timeout=60).json()
        assert got["specdec"]["token_ids"] == want and got["usage"]["prompt_tokens"] == len(ids), body


def byte_level_ids(tok, text: str) -> list[int]:
    """The ids of `text` with its special-token text encoded as text."""
    tok = type(tok).from_str(tok.to_str())
    tok.encode_special_tokens = True
    return tok.encode(text).ids


def test_a_served_chat_is_its_template_and_ends_at_the_end_of_turn(qwen, server):
    folder, model, _, eos = qwen
    messages = [{"role": "user", "content": "hi"}]
    ids = PreTrainedTokenizerFast.from_pretrained(folder).apply_chat_template(
        messages, tokenize=True, add_generation_prompt=True, return_dict=False)
    want = greedy(model, ids, 8)
    want = want[:want.index(eos) + 1] if eos in want else want
    got = httpx.post(server.url + "/v1/chat/completions", json={"messages": messages, "max_tokens": 8,
                                                                 "temperature": 0}, timeout=60).json()
    assert got["specdec"]["token_ids"] == want and got["usage"]["prompt_tokens"] == len(ids)


def test_generate_encodes_as_the_server_does(qwen, capsys):
    folder, model, tok, eos = qwen
    assert main(["generate", "--model", str(folder), "--prompt", "<|im_start|>" + TEXT, "--max-new-tokens", "6",
                 "--json"]) == 0
    ids = byte_level_ids(tok, "<|im_start|>" + TEXT)
    want = greedy(model, ids, 6)
    assert json.loads(capsys.readouterr().out)["tokens"] == (want[:want.index(eos) + 1] if eos in want else want)


def test_the_prompt_options_are_in_generates_help():
    sub = next(a for a in build_parser()._actions if a.choices and isinstance(a.choices, dict)).choices["generate"]
    text = sub.format_help()
    assert "--special-tokens" in text and "--no-heal" in text
