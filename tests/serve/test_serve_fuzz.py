"""Bad input through the server: property tests (hypothesis) over request bodies — random JSON,
wrong types, nulls, deep nesting, lone surrogates, huge values — each answered with a status in
{200, 400, 401, 404, 413, 429, 503} and OpenAI's error object, never a 500 or a traceback; after
them the server is healthy and another client's greedy output is unchanged.

The bulk (2,400 cases) runs in-process: the real app (guard, routes, service, engine on its own
thread) through httpx's ASGI transport, milliseconds a case; `test_fuzz_through_a_real_server`
sends 200 more to a real `specdec serve` process over TCP while a greedy stream runs beside them.
Plus the rules one by one: null means the default, `stop` is a string or list of strings,
unsupported sampling parameters are refused by name, special-token text is text, and the body
limit, content type and API key.
"""
from __future__ import annotations

import asyncio
import json
import threading

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specdec import api
from specdec.proposers import NgramProposer
from specdec.serve.app import create_app
from specdec.serve.guard import Limits
from specdec.serve.service import Service

from ..serve_helpers import Server

ALLOWED = {200, 400, 401, 404, 413, 429, 503}
FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
          "seed", "stop", "stream", "stream_options", "n", "user", "echo", "logprobs", "best_of", "suffix",
          "frequency_penalty", "presence_penalty", "logit_bias", "special_tokens", "tools"]
GREEDY = {"prompt": "def f(x):", "max_tokens": 12, "temperature": 0}

# any Unicode code point, lone surrogates included (JSON can carry them as \ud800 escapes)
TEXT = st.text(st.characters(codec=None, categories=None), max_size=12)
NUMBERS = st.one_of(st.integers(), st.integers(min_value=-10 ** 4000, max_value=10 ** 4000),
                    st.floats(allow_nan=True, allow_infinity=True))
SCALARS = st.one_of(st.none(), st.booleans(), NUMBERS, TEXT)
JSON = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                     st.dictionaries(TEXT, inner, max_size=4)), max_leaves=12)


BODIES = st.one_of(
    JSON,                                                                    # anything at all
    st.dictionaries(st.sampled_from(FIELDS), JSON, max_size=6),              # known fields, random values
    st.builds(lambda name, v: {**GREEDY, "max_tokens": 3, name: v}, st.sampled_from(FIELDS), JSON),  # one bad field
    st.builds(lambda name, v: {**GREEDY, "max_tokens": 3, name: v}, st.sampled_from(FIELDS), SCALARS),
    st.builds(lambda name: {**GREEDY, "max_tokens": 3, name: None}, st.sampled_from(FIELDS)),  # null: the default
    st.builds(lambda m: {"messages": m, "max_tokens": 2}, JSON),
)


def raw(body) -> bytes:
    """JSON as Python writes it (NaN, Infinity and lone surrogates as \\ud800 escapes included)."""
    return json.dumps(body).encode()


def nested(depth: int) -> bytes:
    return b'{"prompt": "x", "stop": ' + b"[" * depth + b"]" * depth + b"}"


class InProcess:
    """The app of `specdec serve` without the network: its engine loop on a thread, an event loop on
    another, requests through httpx's ASGI transport."""

    def __init__(self, checkpoint, limits: Limits = Limits(), method: str = "plain", k: int = 0):
        """method: "plain" (k = 0) or "ngram" (k drafts per step)."""
        target = api.load(checkpoint)
        self.service = Service(target, NgramProposer(), k, method, 4, 8)
        self.engine = threading.Thread(target=self.service.run, daemon=True)
        self.engine.start()
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.client = httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(self.service, limits)),
                                        base_url="http://specdec.test", timeout=60)

    def loop_call(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(60)

    def post(self, path: str, content: bytes, headers: dict | None = None) -> httpx.Response:
        headers = {"Content-Type": "application/json", **(headers or {})}
        return self.loop_call(self.client.post(path, content=content, headers=headers))

    def get(self, path: str, headers: dict | None = None) -> httpx.Response:
        return self.loop_call(self.client.get(path, headers=headers))

    def close(self) -> None:
        self.service.begin_close(0)
        self.engine.join(30)
        self.loop.call_soon_threadsafe(self.loop.stop)


@pytest.fixture(scope="module")
def app(tiny_checkpoint):
    server = InProcess(tiny_checkpoint)
    yield server
    server.close()


def check(r: httpx.Response) -> None:
    assert r.status_code in ALLOWED, (r.status_code, r.text[:300])
    if r.headers["content-type"].startswith("text/event-stream"):  # a stream: complete events to [DONE]
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and all(json.loads(e)["choices"] is not None for e in events[:-1]), r.text
        return
    body = r.json()
    if r.status_code == 200:
        assert body["choices"], body
        return
    error = body["error"]
    assert isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str), body
    assert error["param"] is None or isinstance(error["param"], str), body


def greedy_tokens(post) -> list[int]:
    r = post("/v1/completions", raw(GREEDY))
    assert r.status_code == 200, r.text
    return r.json()["specdec"]["token_ids"]


@settings(max_examples=1200, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(body=BODIES)
def fuzz_completions(app, body):
    check(app.post("/v1/completions", raw(body)))


@settings(max_examples=900, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(body=BODIES)
def fuzz_chat(app, body):
    check(app.post("/v1/chat/completions", raw(body)))


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(data=st.one_of(st.binary(max_size=64), st.integers(1, 100_000).map(nested),
                      st.builds(lambda n: b'{"prompt": "x", "max_tokens": 1' + b"0" * n + b"}", st.integers(1, 6000))))
def fuzz_bytes(app, data):
    check(app.post("/v1/completions", data))


def test_2400_random_bodies_get_openai_errors_and_change_nobody_elses_output(app):
    before = greedy_tokens(app.post)
    fuzz_completions(app)
    fuzz_chat(app)
    fuzz_bytes(app)
    assert app.get("/health").json()["status"] == "ok"
    assert greedy_tokens(app.post) == before
    assert not app.service.jobs  # every admitted job was finished


def test_fuzz_through_a_real_server(tiny_checkpoint, tmp_path):
    """200 random bodies over TCP to `specdec serve` while a greedy stream runs beside them: every
    answer in the allowed set, the stream's tokens the same as alone, no traceback in the log."""
    server = Server("--model", str(tiny_checkpoint), "--max-batch", "4", log=tmp_path / "log")
    try:
        def post(path, content, headers=None):
            return httpx.post(server.url + path, content=content, timeout=60,
                              headers={"Content-Type": "application/json", **(headers or {})})

        alone = greedy_tokens(post)
        long = {**GREEDY, "max_tokens": 120, "stream": True}
        beside: list[int] = []

        def stream():
            with httpx.stream("POST", server.url + "/v1/completions", json=long, timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        beside.extend(json.loads(line[6:])["specdec"]["token_ids"])

        streamer = threading.Thread(target=stream)
        streamer.start()

        @settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
        @given(body=BODIES, chat=st.booleans())
        def fuzz(body, chat):
            check(post("/v1/chat/completions" if chat else "/v1/completions", raw(body)))

        fuzz()
        check(post("/v1/completions", nested(100_000)))
        streamer.join(120)
        want = httpx.post(server.url + "/v1/completions", json={**long, "stream": False}, timeout=60).json()
        assert beside == want["specdec"]["token_ids"]
        assert greedy_tokens(post) == alone
        assert httpx.get(server.url + "/health").json()["status"] == "ok"
    finally:
        assert server.stop(), server.log.read_text()


# ---- the rules one by one ----

def error_of(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    return error


def test_null_means_the_default(app):
    base = app.post("/v1/completions", raw(GREEDY)).json()
    nulls = {"n": None, "max_tokens": None, "stream": None, "stop": None, "top_p": None, "top_k": None,
             "seed": None, "stream_options": None, "user": None, "logit_bias": None, "frequency_penalty": None}
    default = app.post("/v1/completions", raw({**GREEDY, **nulls, "max_tokens": None})).json()
    assert default["usage"]["completion_tokens"] == 16  # OpenAI's default max_tokens
    assert default["specdec"]["token_ids"][:12] == base["specdec"]["token_ids"]
    sampled = app.post("/v1/completions", raw({"prompt": "def f(x):", "max_tokens": 4, "temperature": None,
                                               "seed": 3})).json()
    assert sampled["usage"]["completion_tokens"] == 4  # temperature null: 1, sampled


@pytest.mark.parametrize("stop,status", [("x", 200), (["x", "yz"], 200), ({"a": 1}, 400), ([1], 400), ([""], 400),
                                         ([["x"]], 400), (["\ud800"], 400), (["s"] * 17, 400)])
def test_stop_is_a_string_or_a_list_of_strings(app, stop, status):
    r = app.post("/v1/completions", raw({**GREEDY, "stop": stop}))
    if status == 200:
        assert r.status_code == 200, r.text
    else:
        error_of(r, 400, "stop")


@pytest.mark.parametrize("name,value", [("frequency_penalty", 0.5), ("presence_penalty", -1), ("logit_bias", {"5": 3}),
                                        ("logprobs", 2), ("n", 2), ("best_of", 3), ("echo", True),
                                        ("repetition_penalty", 1.1), ("min_p", 0.1)])
def test_unsupported_sampling_parameters_are_refused_by_name(app, name, value):
    error = error_of(app.post("/v1/completions", raw({**GREEDY, name: value})), 400, name)
    assert name in error["message"] and error["code"] == "unsupported_parameter"
    neutral = {"frequency_penalty": 0, "presence_penalty": 0, "logit_bias": {}, "n": 1}
    if name in neutral:  # the neutral value changes nothing: accepted
        assert app.post("/v1/completions", raw({**GREEDY, name: neutral[name]})).status_code == 200


def test_an_unknown_field_is_refused_by_name(app):
    error = error_of(app.post("/v1/completions", raw({**GREEDY, "junk": "x" * 1000})), 400, "junk")
    assert error["code"] == "unknown_parameter"


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_an_unknown_field_named_with_a_lone_surrogate_is_refused_with_it_escaped(app, path):
    """Found by the fuzz: the refusal echoes the field's name, which no UTF-8 body holds as it is."""
    response = app.post(path, b'{"\\ud800": null}')  # a JSON escape: the key is a lone surrogate
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "\\ud800"


def test_special_token_text_in_a_prompt_is_text_unless_asked(app):
    text = app.post("/v1/completions", raw({**GREEDY, "prompt": "a<|endoftext|>b", "max_tokens": 1})).json()
    special = app.post("/v1/completions", raw({**GREEDY, "prompt": "a<|endoftext|>b", "max_tokens": 1,
                                               "special_tokens": True})).json()
    tokenizer = app.service.target.tokenizer
    as_text = len(tokenizer.encode("a<|endoftext|>b", special_tokens=False))
    assert as_text > len(tokenizer.encode("a<|endoftext|>b")) == 3  # a, <|endoftext|>, b
    assert text["usage"]["prompt_tokens"] == 1 + as_text and special["usage"]["prompt_tokens"] == 1 + 3


def test_a_lone_surrogate_is_a_400_here_and_a_specdec_error_in_python(app):
    error = error_of(app.post("/v1/completions", b'{"prompt": "a\\ud800b"}'), 400, "prompt")
    assert "surrogate" in error["message"]
    from specdec.errors import SpecdecError
    with pytest.raises(SpecdecError, match="not valid UTF-8"):
        api.generate(app.service.target, "a\ud800b", max_new_tokens=1)
    with pytest.raises(SpecdecError, match="stop"):
        api.generate(app.service.target, "ab", max_new_tokens=1, stop=("\udc80",))


def test_body_limit_content_type_and_api_key(tiny_checkpoint):
    guarded = InProcess(tiny_checkpoint, Limits(max_body=4096, api_key="sekrit"))
    try:
        key = {"Authorization": "Bearer sekrit"}
        error = error_of(guarded.post("/v1/completions", raw(GREEDY)), 401)
        assert error["type"] == "authentication_error"
        assert guarded.post("/v1/completions", raw(GREEDY), {"Authorization": "Bearer wrong"}).status_code == 401
        assert guarded.post("/v1/completions", raw(GREEDY), key).status_code == 200
        assert guarded.get("/health").status_code == 200  # open by default (key_for_all=False)
        big = raw({**GREEDY, "prompt": "x" * 10_000})
        assert error_of(guarded.post("/v1/completions", big, key), 413)["code"] == "request_too_large"
        assert guarded.post("/v1/completions", raw(GREEDY), {**key, "Content-Type": "text/plain"}).status_code == 415
        assert guarded.get("/v1/models/tiny", key).json()["id"] == "tiny"
        assert error_of(guarded.get("/v1/models/other", key), 404, "model")["code"] == "model_not_found"
    finally:
        guarded.close()
