"""Structured output through the server: OpenAI's response_format (json_schema, json_object) on
completions and chat, whole and streamed, answers what api.generate(constraint=...) answers; a bad
schema is a 400 naming the problem (param "response_format") and the server keeps serving.
The server drafts with n-gram lookup (k = 4), so the grammar's forced tokens are drafted too."""
from __future__ import annotations

import json

import pytest

from specdec import api
from specdec.decoding.constraint import Constraint

from .test_serve_chat import MESSAGES, chat_checkpoint  # noqa: F401 (a fixture)
from .test_serve_fuzz import InProcess, error_of

SCHEMA = {"type": "object", "properties": {"label": {"enum": ["positive", "negative", "neutral"]},
                                           "score": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["label", "score"], "additionalProperties": False}
FORMAT = {"type": "json_schema", "json_schema": {"name": "review", "schema": SCHEMA, "strict": True}}
GREEDY = {"temperature": 0, "max_tokens": 40}


@pytest.fixture(scope="module")
def app(chat_checkpoint):  # noqa: F811 (the fixture imported above)
    server = InProcess(chat_checkpoint, method="ngram", k=4)
    yield server
    server.close()


def post(app, path: str, body: dict):
    return app.post(path, json.dumps(body).encode())


def streamed(app, path: str, body: dict) -> tuple[str, str]:
    """The text of a streamed response and its finish reason."""
    r = post(app, path, {**body, "stream": True})
    assert r.status_code == 200, r.text
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    text = "".join(c["delta"].get("content") or "" if "delta" in c else c["text"] for c in choices)
    return text, next(c["finish_reason"] for c in choices if c["finish_reason"])


def test_completions_with_a_json_schema_answer_what_generate_answers(app, chat_checkpoint):  # noqa: F811
    r = post(app, "/v1/completions", {"prompt": "The review was great. As JSON: ", "response_format": FORMAT, **GREEDY})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    value = json.loads(choice["text"])
    assert value["label"] in ("positive", "negative", "neutral") and 0 <= value["score"] <= 9
    assert choice["finish_reason"] == "stop"
    offline = api.generate(api.load(chat_checkpoint), "The review was great. As JSON: ", max_new_tokens=40,
                           constraint=Constraint.json_schema(SCHEMA))
    assert choice["text"] == offline.texts[0]
    assert streamed(app, "/v1/completions", {"prompt": "The review was great. As JSON: ", "response_format": FORMAT,
                                             **GREEDY}) == (choice["text"], "stop")


def test_chat_with_json_object_whole_and_streamed(app):
    body = {"messages": MESSAGES, "response_format": {"type": "json_object"}, **GREEDY, "max_tokens": 60}
    r = post(app, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    text = choice["message"]["content"]
    if choice["finish_reason"] == "stop":
        assert isinstance(json.loads(text), dict)
    else:  # max_tokens reached inside the object
        assert choice["finish_reason"] == "length" and text.startswith("{")
    assert streamed(app, "/v1/chat/completions", body) == (text, choice["finish_reason"])


@pytest.mark.parametrize("response_format,message", [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "unevaluatedItems": False}}},
     "unevaluatedItems"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strng"}}}, "Invalid type: strng"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "needs \"json_schema\""),
    ({"type": "xml"}, "response_format must be"),
])
def test_a_bad_response_format_is_a_400_naming_it_and_others_are_served(app, response_format, message):
    r = post(app, "/v1/completions", {"prompt": "x", "response_format": response_format, **GREEDY})
    assert message in error_of(r, 400, "response_format")["message"]
    good = post(app, "/v1/completions", {"prompt": "x", "response_format": FORMAT, **GREEDY})
    assert good.status_code == 200 and json.loads(good.json()["choices"][0]["text"])["label"]
