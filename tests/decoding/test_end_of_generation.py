"""The model's own stop set at every entry point: a checkpoint ends a generation at any id of its
end-of-generation set (a GGUF file's as llama.cpp derives it, a folder's generation_config.json list),
not only at its first EOS, and no text holds a special token unless asked for.

The checkpoint is built here as a Qwen2.5-Coder GGUF behaves on HumanEval: its metadata names
<|im_end|> the EOS, and the model writes <|endoftext|> at the end of its code, after a
<|fim_prefix|> early in it (a special token that ends nothing). A random Qwen2 is made to do so by
its lm_head rows: <|fim_prefix|>'s is a little larger than that of the token it greedily writes
second, <|endoftext|>'s than that of a token it writes later, first. Before the set, the GGUF wrote
on past <|endoftext|> and both texts showed the special tokens."""
from __future__ import annotations

import json

import httpx
import pytest
import torch
from transformers import PreTrainedTokenizerFast

from specdec import api
from specdec.cli import main
from specdec.lm import gguf

from ..gguf_helpers import CHATML, Q, byte_level_tokenizer, hf_model, write_gguf
from ..serve_helpers import Server

TEXT = "def f(x):\n    return"
N = 12  # new tokens asked for: more than the model writes before <|endoftext|>


@torch.no_grad()
def greedy(model, ids: list[int], n: int = N) -> list[int]:
    """transformers' greedy decoding of `ids`, `n` tokens, no EOS."""
    model.generation_config.eos_token_id = None
    return model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=0)[0, len(ids):].tolist()


@torch.no_grad()
def larger_row(model, token: int, than: int, by: float) -> None:
    """lm_head's row of `token` := `by` times that of `than`, bf16-rounded (as the files store it)."""
    model.lm_head.weight[token] = (model.lm_head.weight[than] * by).bfloat16().float()


@pytest.fixture(scope="module")
def coder(tmp_path_factory, gguf_cache):
    """(the .gguf file, a folder of the same model whose generation_config.json lists <|im_end|> and
    <|endoftext|>, the tokenizer, transformers' greedy tokens up to and with <|endoftext|>)."""
    tok = byte_level_tokenizer()
    tok.add_special_tokens(["<|fim_prefix|>", "<|fim_pad|>"])
    ids = {t: tok.token_to_id(t) for t in ("<|endoftext|>", "<|im_end|>", "<|fim_prefix|>")}
    model = hf_model("qwen2", seed=1, vocab_size=tok.get_vocab_size(), tie_word_embeddings=False)
    prompt = tok.encode(TEXT).ids
    larger_row(model, ids["<|fim_prefix|>"], greedy(model, prompt)[1], 1.05)
    plain = greedy(model, prompt)
    later = next(t for i, t in enumerate(plain) if i > 3 and t not in plain[:i])
    larger_row(model, ids["<|endoftext|>"], later, 1.02)
    want = greedy(model, prompt)
    want = want[:want.index(ids["<|endoftext|>"]) + 1]
    assert want[1] == ids["<|fim_prefix|>"] and len(want) > 3 and ids["<|im_end|>"] not in want
    root = tmp_path_factory.mktemp("coder")
    path = write_gguf(root / "coder.gguf", model, tok, "qwen2", types=(Q.F32,), eos="<|im_end|>")
    folder = root / "coder"
    model.save_pretrained(folder)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", chat_template=CHATML).save_pretrained(folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [ids["<|im_end|>"],
                                                                                ids["<|endoftext|>"]]}))
    return path, folder, tok, want


@pytest.mark.parametrize("form", ["gguf", "folder"])
def test_a_generation_ends_at_an_end_token_that_is_not_the_first_eos_and_shows_no_special_token(coder, form):
    path, folder, tok, want = coder
    target = api.load(path if form == "gguf" else folder)
    assert target.tokenizer.eos_ids[0] == tok.token_to_id("<|im_end|>")
    pieces = []
    result = api.generate(target, TEXT, max_new_tokens=N, on_text=lambda i, piece: pieces.append(piece))
    assert result.tokens[0] == want and result.finish_reasons[0] == "eos"
    assert result.texts[0] == tok.decode(want[:-1], skip_special_tokens=True) == "".join(pieces)
    assert "<|" not in result.texts[0]
    kept = api.generate(target, TEXT, max_new_tokens=N, skip_special_tokens=False)
    assert kept.tokens[0] == want and kept.texts[0] == tok.decode(want[:-1], skip_special_tokens=False)
    assert "<|fim_prefix|>" in kept.texts[0] and "<|endoftext|>" not in kept.texts[0]


def test_a_stop_string_that_is_a_special_tokens_text_ends_at_that_token(coder):
    path, _, tok, want = coder
    result = api.generate(api.load(path), TEXT, max_new_tokens=N, stop=("<|fim_prefix|>",))
    assert result.tokens[0] == want[:2] and result.finish_reasons[0] == "stop"
    assert result.texts[0] == tok.decode(want[:1])


def test_generate_on_the_command_line_ends_there(coder, capsys):
    path, _, tok, want = coder
    assert main(["generate", "--model", str(path), "--prompt", TEXT, "--max-new-tokens", str(N), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["tokens"], out["finish_reason"]) == (want, "eos") and "<|" not in out["text"]
    assert main(["generate", "--model", str(path), "--prompt", TEXT, "--max-new-tokens", str(N), "--json",
                 "--keep-special-tokens"]) == 0
    assert json.loads(capsys.readouterr().out)["text"] == tok.decode(want[:-1], skip_special_tokens=False)


def test_the_server_ends_there_streamed_or_not(coder, tmp_path):
    path, _, tok, want = coder
    server = Server("--model", str(path), log=tmp_path / "serve.log", env={"XDG_CACHE_HOME": str(tmp_path / "cache")})
    try:
        body = {"prompt": TEXT, "max_tokens": N, "temperature": 0}
        got = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
        assert got["specdec"]["token_ids"] == want and got["choices"][0]["finish_reason"] == "stop"
        assert got["choices"][0]["text"] == tok.decode(want[:-1], skip_special_tokens=True)
        streamed = []
        with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    streamed += [c["text"] for c in json.loads(line[6:])["choices"]]
        assert "".join(streamed) == got["choices"][0]["text"]
        kept = httpx.post(server.url + "/v1/completions", json={**body, "skip_special_tokens": False}, timeout=60).json()
        assert kept["choices"][0]["text"] == tok.decode(want[:-1], skip_special_tokens=False)
        bad = httpx.post(server.url + "/v1/completions", json={**body, "skip_special_tokens": "no"}, timeout=60)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "skip_special_tokens"
    finally:
        assert server.stop(), server.log.read_text()


def test_the_converted_folder_holds_the_set(coder):
    path, _, tok, _ = coder
    config = json.loads((gguf.folder(path) / "config.json").read_text())
    assert config["eos_token_id"] == [tok.token_to_id(t) for t in ("<|im_end|>", "<|endoftext|>", "<|fim_pad|>")]
