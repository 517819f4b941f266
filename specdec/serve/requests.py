"""A request body -> validated settings, or an APIError in OpenAI's format (status 400 unless
said otherwise); nothing here raises anything else, whatever JSON arrives.

Rules: the body is a JSON object (nested no deeper than Python's json reads, numbers of at most a
few thousand digits); every field may be null, which means its default; a field OpenAI defines but
specdec cannot honour exactly (penalties, logit_bias, logprobs, n > 1, tools, ...) is refused by
name unless it holds its neutral value; a field nobody defines is refused by name, as OpenAI
does. `stop` is a string or a list of strings; text must be valid Unicode (no lone surrogates).
Special-token text in a prompt (e.g. "<|endoftext|>") is text unless "special_tokens": true; a
prompt ending in whitespace is token-healed unless "heal": false; special tokens the model writes are
left out of the text unless "skip_special_tokens": false (vLLM's name) (decoding/pipeline.py).

This module knows nothing about models or the engine.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from .. import inputs
from ..decoding.constraint import Constraint
from ..decoding.pipeline import Options
from ..decoding.sampling import SamplingConfig
from ..errors import SpecdecError
from ..lm.tokenizer import check_messages

MAX_STOPS = 16
MAX_STOP_CHARS = 512

SAMPLING = ("temperature", "top_p", "top_k", "seed")
COMMON = {"model", "max_tokens", "stop", "stream", "stream_options", "user", "response_format", "skip_special_tokens",
          *SAMPLING}
COMPLETION = COMMON | {"prompt", "special_tokens", "heal"}
CHAT = COMMON | {"messages", "max_completion_tokens"}
# defined by OpenAI (or vLLM), not honoured by specdec: allowed only at a neutral value
NEUTRAL = {"frequency_penalty": (0, 0.0), "presence_penalty": (0, 0.0), "repetition_penalty": (1, 1.0),
           "logit_bias": ({},), "logprobs": (False,), "top_logprobs": (0,), "echo": (False,), "suffix": ("",),
           "best_of": (1,), "n": (1,), "min_p": (0, 0.0), "tools": ([],), "tool_choice": ("none",),
           "parallel_tool_calls": (False, True), "min_tokens": (0,)}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", headers: dict | None = None):
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers or {}

    def body(self) -> dict:
        """OpenAI's error object; the message and param may echo the client's text, lone surrogates
        included, which no UTF-8 body can hold: they are written as escapes."""
        return {"error": {"message": utf8(self.message), "type": self.kind, "param": utf8(self.param),
                          "code": self.code}}


def utf8(text: str | None) -> str | None:
    """text with what UTF-8 cannot encode (lone surrogates) written as backslash escapes."""
    return None if text is None else text.encode("utf-8", "backslashreplace").decode("utf-8")


@dataclass(frozen=True)
class Params:
    """A completion request's settings, validated: a prompt (text) or chat messages."""
    prompt: str | None
    messages: tuple[dict, ...] | None
    max_tokens: int
    sampling: SamplingConfig
    stop: tuple[str, ...]
    special_tokens: bool = False  # the prompt's special-token text stands for the special tokens
    heal: bool = True             # a prompt ending in whitespace is token-healed
    constraint: Constraint | None = None  # response_format json_object / json_schema (structured output)
    skip_special_tokens: bool = True  # special tokens the model writes are left out of the text

    @property
    def options(self) -> Options:
        """The request's settings as the pipeline carries them to the engine (decoding/pipeline.py)."""
        return Options(self.max_tokens, self.sampling, self.stop, self.special_tokens, self.heal, self.constraint,
                       self.skip_special_tokens)


@dataclass(frozen=True)
class Parsed:
    params: Params
    stream: bool
    include_usage: bool


def decode_json(raw: bytes):
    """The body as JSON, or APIError: not UTF-8, not JSON, too deep, numbers too long."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(400, f"the request body is not UTF-8 ({e.reason} at byte {e.start}); send UTF-8 JSON") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise APIError(400, f"the request body is not valid JSON ({e.msg} at line {e.lineno} column {e.colno}); "
                            "send a JSON object") from None
    except RecursionError:
        raise APIError(400, "the request body nests too deeply; a request is a flat object") from None
    except ValueError as e:  # an integer of more digits than Python converts
        raise APIError(400, f"the request body holds a value specdec cannot read ({str(e)[:120]})") from None


def value(body: dict, name: str, default=None):
    """The field, or its default when absent or null."""
    v = body.get(name)
    return default if v is None else v


def refuse_unsupported(body: dict, known: set[str]) -> None:
    for name, v in body.items():
        if name in NEUTRAL:
            if v is not None and not any(v == n and type(v) is type(n) for n in NEUTRAL[name]):
                raise APIError(400, f"{name} is not supported by specdec serve (its output would not be the "
                                    f"target's); leave it out or send {json.dumps(NEUTRAL[name][0])}", name,
                               "unsupported_parameter")
        elif name not in known:
            raise APIError(400, f"unrecognized request argument supplied: {name[:100]}", name[:100],
                           "unknown_parameter")


def text(name: str, v) -> str:
    if not isinstance(v, str):
        raise APIError(400, f"{name} must be a string, got {type(v).__name__}", name)
    try:
        v.encode("utf-8")
    except UnicodeEncodeError as e:
        raise APIError(400, f"{name} is not valid Unicode text (a lone surrogate at character {e.start}); "
                            "send UTF-8 encoded text", name) from None
    return v


def stops(v) -> tuple[str, ...]:
    if v is None:
        return ()
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise APIError(400, "stop must be a string or a list of strings", "stop")
    if len(v) > MAX_STOPS:
        raise APIError(400, f"stop holds {len(v)} strings; at most {MAX_STOPS}", "stop")
    for s in v:
        text("stop", s)
        if not s or len(s) > MAX_STOP_CHARS:
            raise APIError(400, f"stop strings must hold 1 to {MAX_STOP_CHARS} characters", "stop")
    return tuple(v)


def settings(body: dict, model: str, known: set[str], max_tokens_names: tuple[str, ...]) -> tuple:
    """The fields every kind of request shares: (max_tokens, sampling, stop, stream, include_usage)."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    refuse_unsupported(body, known)
    name = body.get("model")
    if name is not None and not isinstance(name, str):
        raise APIError(400, "model must be a string (GET /v1/models lists them)", "model")
    if name is not None and name != model:
        shown = repr(name)[:100]
        raise APIError(404, f"model {shown} is not served here; this server serves {model!r} (GET /v1/models)",
                       "model", "model_not_found")
    stream = value(body, "stream", False)
    if not isinstance(stream, bool):
        raise APIError(400, "stream must be true or false", "stream")
    options = value(body, "stream_options", {})
    if not isinstance(options, dict) or not isinstance(value(options, "include_usage", False), bool):
        raise APIError(400, "stream_options must be an object such as {\"include_usage\": true}", "stream_options")
    if not isinstance(value(body, "user", ""), str):
        raise APIError(400, "user must be a string", "user")
    given = [n for n in max_tokens_names if body.get(n) is not None]
    max_name = given[0] if given else max_tokens_names[0]
    fields = {"max_tokens": value(body, max_name, 16), "temperature": value(body, "temperature", 1.0),
              "top_p": body.get("top_p"), "top_k": body.get("top_k"), "seed": body.get("seed")}
    try:
        inputs.sampling(fields["temperature"], fields["top_k"], fields["top_p"], fields["seed"])
        inputs.integer("max_tokens", fields["max_tokens"], low=0)
    except SpecdecError as e:
        param = next((n for n in fields if str(e).startswith(n)), None)
        raise APIError(400, str(e).replace("max_tokens", max_name)[:300], max_name if param == "max_tokens" else param
                       ) from None
    top_p = fields["top_p"] if fields["top_p"] is None or fields["top_p"] < 1 else None
    sampling = SamplingConfig(float(fields["temperature"]), fields["top_k"], top_p, fields["seed"])
    return fields["max_tokens"], sampling, stops(body.get("stop")), stream, bool(value(options, "include_usage", False))


def completion(body, model: str) -> Parsed:
    """POST /v1/completions."""
    max_tokens, sampling, stop, stream, usage = settings(body, model, COMPLETION, ("max_tokens",))
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise APIError(400, "prompt must be one non-empty string", "prompt")
    text("prompt", prompt)
    special = value(body, "special_tokens", False)
    if not isinstance(special, bool):
        raise APIError(400, "special_tokens must be true (special-token text in the prompt is the special token) "
                            "or false (it is text, the default)", "special_tokens")
    heal = value(body, "heal", True)
    if not isinstance(heal, bool):
        raise APIError(400, "heal must be true (a prompt ending in whitespace is token-healed, the default) or "
                            "false (its tokens are kept as they are)", "heal")
    constraint = response_format(body.get("response_format"))
    return Parsed(Params(prompt, None, max_tokens, sampling, stop, special, heal, constraint, skip_special(body)),
                  stream, usage)


def chat(body, model: str) -> Parsed:
    """POST /v1/chat/completions."""
    max_tokens, sampling, stop, stream, usage = settings(body, model, CHAT, ("max_completion_tokens", "max_tokens"))
    try:
        messages = check_messages(body.get("messages"))
    except SpecdecError as e:
        raise APIError(400, str(e), "messages") from None
    return Parsed(Params(None, tuple(messages), max_tokens, sampling, stop,
                         constraint=response_format(body.get("response_format")),
                         skip_special_tokens=skip_special(body)), stream, usage)


def skip_special(body: dict) -> bool:
    """skip_special_tokens: true (the default: special tokens the model writes are left out of the text)
    or false."""
    skip = value(body, "skip_special_tokens", True)
    if not isinstance(skip, bool):
        raise APIError(400, "skip_special_tokens must be true (special tokens the model writes are left out of the "
                            "text, the default) or false (they are written)", "skip_special_tokens")
    return skip


def response_format(v) -> Constraint | None:
    """OpenAI's response_format: {"type": "text"} (or absent) -> None; {"type": "json_object"}; or
    {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}. Whether
    the schema compiles is checked with the tokenizer (service.py)."""
    if v is None:
        return None
    kind = v.get("type") if isinstance(v, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint.json_object()
    if kind == "json_schema":
        spec = v.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise APIError(400, 'response_format {"type": "json_schema"} needs "json_schema": {"name": ..., '
                                '"schema": {a JSON Schema object}}', "response_format")
        return Constraint.json_schema(schema)
    raise APIError(400, 'response_format must be {"type": "text"}, {"type": "json_object"} or {"type": "json_schema", '
                        '"json_schema": {"name": ..., "schema": {...}}}', "response_format")
