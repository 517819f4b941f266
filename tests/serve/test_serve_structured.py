"""Structured output through the server: OpenAI's response_format (json_schema, json_object) on
completions and chat, whole and streamed, answers what api.generate(constraint=...) answers; a bad
schema is a 400 naming the problem (param "response_format") and the server keeps serving.
The in-process server drafts with n-gram lookup (k = 4), so the grammar's forced tokens are drafted
too. A real `specdec serve` process, drafting with a draft model under the mask, answers a sample of
the structured workload (bench/structured.py) with valid JSON, greedy and T=1, eight requests at once."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from specdec import api
from specdec.bench.structured import tasks, validate
from specdec.decoding.constraint import Constraint

from ..serve_helpers import HANG, Server
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


def test_a_real_server_answers_the_structured_workload_with_valid_json(chat_checkpoint, draft_checkpoint,  # noqa: F811
                                                                       tmp_path):
    """`specdec serve` with a draft model (k = 3) drafting under the mask: a sample of the workload
    (4 tasks of each kind; no unbounded numbers, which a random model may write until max_tokens),
    greedy and T=1 (seeded), 8 requests at once: every answer ends ("stop") and validates against
    its schema (bench/structured.py's validator)."""
    sample = [t for kind in ("extraction", "tool-call", "classification")
              for t in [t for t in tasks() if t.kind == kind and "number" not in json.dumps(t.schema)][:4]]
    server = Server("--model", str(chat_checkpoint), "--draft", "draft-model", "--draft-model", str(draft_checkpoint),
                    "-k", "3", "--max-batch", "8", log=tmp_path / "serve.log")

    def ask(task, temperature: float) -> dict:
        body = {"messages": [{"role": "user", "content": task.prompt}], "max_tokens": 120, "seed": 5,
                "temperature": temperature, "response_format": {"type": "json_schema", "json_schema": {
                    "name": task.kind, "schema": task.schema}}}
        r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=HANG)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]

    try:
        with ThreadPoolExecutor(8) as pool:
            answers = {t: list(pool.map(ask, sample, [t] * len(sample))) for t in (0.0, 1.0)}
    finally:
        assert server.stop(), server.log.read_text()
    for temperature, choices in answers.items():
        for task, choice in zip(sample, choices):
            text = choice["message"]["content"]
            assert choice["finish_reason"] == "stop" and validate(json.loads(text), task.schema), (temperature, text)
