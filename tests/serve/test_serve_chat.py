"""Chat and the web: tokenizer.py's chat template renders exactly what transformers' apply_chat_template renders (a
template built here, on a tokenizer of a tiny checkpoint), /v1/chat/completions answers what
api.generate(messages=...) answers, whole and streamed, a model without a template is a clear 400
(and a SpecdecError in Python), and CORS is closed by default: a text/plain POST from a foreign
web page runs nothing.
"""
from __future__ import annotations

import json
import shutil

import pytest
from transformers import PreTrainedTokenizerFast

from specdec import api
from specdec.errors import SpecdecError
from specdec.lm.tokenizer import check_messages, template
from specdec.serve.guard import Limits

from .test_serve_fuzz import InProcess, error_of

TEMPLATE = ("{% for m in messages %}<|bos|>{{ m['role'] }}\n{{ m['content'] }}<|endoftext|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|bos|>assistant\n{% endif %}")
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "def f(x):"}]


@pytest.fixture(scope="module")
def chat_checkpoint(tiny_checkpoint, tmp_path_factory):
    path = tmp_path_factory.mktemp("chat") / "tiny-chat"
    shutil.copytree(tiny_checkpoint, path)
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE, "eos_token": "<|endoftext|>",
                                                            "bos_token": "<|bos|>"}))
    return path


@pytest.fixture(scope="module")
def app(chat_checkpoint):
    server = InProcess(chat_checkpoint)
    yield server
    server.close()


def test_rendering_equals_transformers_apply_chat_template(chat_checkpoint):
    reference = PreTrainedTokenizerFast(tokenizer_file=str(chat_checkpoint / "tokenizer.json"), chat_template=TEMPLATE,
                                        bos_token="<|bos|>", eos_token="<|endoftext|>")
    chat = template(chat_checkpoint)
    for messages in (MESSAGES, MESSAGES[1:], [*MESSAGES, {"role": "assistant", "content": "return x"},
                                              {"role": "user", "content": [{"type": "text", "text": "again"}]}]):
        # text parts are joined into one string first (what an OpenAI server does for a string template)
        want = reference.apply_chat_template(check_messages(messages), tokenize=False, add_generation_prompt=True)
        assert chat.render(messages) == want
    ids = chat.ids(MESSAGES)
    assert ids == reference.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert ids.count(1) == 3 and ids.count(2) == 2  # the template's <|bos|> and <|endoftext|> are the tokens
    typed = chat.ids([{"role": "user", "content": "a<|endoftext|>b"}])
    assert typed.count(2) == 1  # the one the template wrote; the user's is text


def test_chat_completions_equal_api_generate_with_messages(app, chat_checkpoint):
    target = api.load(chat_checkpoint)
    want = api.generate(target, messages=MESSAGES, max_new_tokens=20)
    got = app.post("/v1/chat/completions", json.dumps({"messages": MESSAGES, "max_tokens": 20,
                                                        "temperature": 0}).encode()).json()
    assert got["object"] == "chat.completion" and got["choices"][0]["message"]["role"] == "assistant"
    assert got["specdec"]["token_ids"] == want.tokens[0]
    assert got["choices"][0]["message"]["content"] == want.texts[0]
    assert got["usage"]["prompt_tokens"] == want.stats["prompt_tokens"][0]
    streamed = app.post("/v1/chat/completions", json.dumps({"messages": MESSAGES, "max_completion_tokens": 20,
                                                             "temperature": 0, "stream": True,
                                                             "stream_options": {"include_usage": True}}).encode())
    events = [json.loads(line[6:]) for line in streamed.text.splitlines()
              if line.startswith("data: {")]
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"]) == want.texts[0]
    assert events[-1]["usage"]["completion_tokens"] == len(want.tokens[0])
    assert streamed.text.rstrip().endswith("data: [DONE]")


def test_a_model_without_a_chat_template_is_a_clear_400(tiny_checkpoint):
    plain = InProcess(tiny_checkpoint)
    try:
        error = error_of(plain.post("/v1/chat/completions", json.dumps({"messages": MESSAGES}).encode()), 400,
                         "messages")
        assert error["code"] == "no_chat_template" and "no chat template" in error["message"]
        assert plain.get("/v1/models/tiny").json()["chat"] is False
    finally:
        plain.close()
    with pytest.raises(SpecdecError, match="no chat template"):
        api.generate(api.load(tiny_checkpoint), messages=MESSAGES, max_new_tokens=2)


def test_cors_is_closed_by_default_and_opens_for_named_origins(app, chat_checkpoint):
    steps, requests = app.service.engine.metrics.steps, dict(app.service.requests)
    body = json.dumps({"prompt": "x", "max_tokens": 5}).encode()
    foreign = {"Origin": "http://evil.example", "Content-Type": "text/plain"}
    assert error_of(app.post("/v1/completions", body, foreign), 403)["code"] == "origin_not_allowed"
    assert error_of(app.post("/v1/completions", body, {"Origin": "http://evil.example"}), 403)
    assert app.service.engine.metrics.steps == steps and app.service.requests == requests  # nothing ran
    assert app.post("/v1/completions", body, {"Origin": "http://specdec.test"}).status_code == 200  # its own page
    opened = InProcess(chat_checkpoint, Limits(cors_origins=("https://app.example",)))
    try:
        r = opened.post("/v1/completions", body, {"Origin": "https://app.example"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
        pre = opened.loop_call(opened.client.options("/v1/completions", headers={
            "Origin": "https://app.example", "Access-Control-Request-Method": "POST"}))
        assert pre.status_code == 204 and "POST" in pre.headers["access-control-allow-methods"]
        assert opened.post("/v1/completions", body, {"Origin": "http://evil.example"}).status_code == 403
    finally:
        opened.close()
