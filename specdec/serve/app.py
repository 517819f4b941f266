"""The HTTP side of `specdec serve` (FastAPI on uvicorn): OpenAI's completions API and formats,
/v1/models, /health, /metrics and the live view at /.

Every bad request gets OpenAI's error object ({"error": {"message", "type", "param", "code"}})
with status 400 (malformed JSON, wrong types, values out of range, a prompt that does not fit the
context), 404 (another model), 429 (the queue is full) or 503 (shutting down); the server keeps
serving. A client that goes away mid-request cancels its job: its row leaves at the next step.
Responses carry specdec's figures in an extra field "specdec" (token ids, steps, proposed and
accepted drafts; in a stream, the step's text pieces labelled "draft" or "target").
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, StreamingResponse

from .. import inputs
from ..errors import SpecdecError
from ..sampling import SamplingConfig
from .service import Closing, Event, Job, Params, QueueFull, Service

PAGE = Path(__file__).with_name("static") / "index.html"
FINISH = {"eos": "stop", "stop": "stop", "length": "length", "error": "error"}  # specdec's -> OpenAI's


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind


def error_response(e: APIError) -> JSONResponse:
    return JSONResponse({"error": {"message": e.message, "type": e.kind, "param": e.param, "code": e.code}},
                        status_code=e.status)


def parse(body, model: str) -> tuple[Params, bool, bool]:
    """The completion request's settings, whether to stream, and whether to add usage to a stream."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    if body.get("model") not in (None, model):
        raise APIError(404, f"model {body['model']!r} is not served here; this server serves {model!r} "
                            "(GET /v1/models)", "model", "model_not_found")
    for name in ("echo", "logprobs", "suffix", "best_of"):
        if body.get(name) not in (None, False, 1 if name == "best_of" else None):
            raise APIError(400, f"{name} is not supported by specdec serve; leave it out", name)
    if body.get("n", 1) != 1:
        raise APIError(400, "n must be 1: one completion per request (send several requests)", "n")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise APIError(400, "prompt must be one non-empty string", "prompt")
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else stop
    stream = body.get("stream", False)
    options = body.get("stream_options") or {}
    if not isinstance(stream, bool) or not isinstance(options, dict):
        raise APIError(400, "stream must be true or false and stream_options an object", "stream")
    fields = {name: body.get(name, default) for name, default in
              (("max_tokens", 16), ("temperature", 1.0), ("top_p", None), ("top_k", None), ("seed", None))}
    try:
        inputs.prompts(prompt)
        inputs.sampling(fields["temperature"], fields["top_k"], fields["top_p"], fields["seed"])
        stop = inputs.generation(fields["max_tokens"], stop)
    except SpecdecError as e:
        message = str(e).replace("max_new_tokens", "max_tokens")
        raise APIError(400, message, next((n for n in (*fields, "stop", "prompt") if n in message), None)) from None
    top_p = fields["top_p"] if fields["top_p"] is None or fields["top_p"] < 1 else None
    sampling = SamplingConfig(float(fields["temperature"]), fields["top_k"], top_p, fields["seed"])
    return Params(prompt, fields["max_tokens"], sampling, stop), stream, bool(options.get("include_usage"))


def create_app(service: Service, shutdown_timeout: float = 30.0) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app):
        yield
        await asyncio.to_thread(service.close, shutdown_timeout)

    app = FastAPI(title="specdec serve", lifespan=lifespan)
    app.add_exception_handler(APIError, lambda request, e: error_response(e))

    @app.get("/", response_class=HTMLResponse)
    async def page():
        return HTMLResponse(PAGE.read_text())

    @app.get("/health")
    async def health():
        ok = not (service.closing or service.failure)
        return JSONResponse({"status": "ok" if ok else "closing" if service.closing else "failed",
                             "error": service.failure, "batch_size": len(service.engine.requests),
                             "queue_length": len(service.intake) + len(service.engine.waiting)},
                            status_code=200 if ok else 503)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": service.name, "object": "model", "created": 0,
                                            "owned_by": "specdec", "method": service.method, "k": service.k}]}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(service.prometheus(), media_type="text/plain; version=0.0.4")

    @app.post("/v1/completions")
    async def completions(request: Request):
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            service.requests["invalid"] += 1
            raise APIError(400, f"the request body is not valid JSON ({e}); send a JSON object") from None
        try:
            params, stream, usage = parse(body, service.name)
            job = service.submit(params)
        except APIError:
            service.requests["invalid"] += 1
            raise
        except QueueFull as e:
            raise APIError(429, str(e), code="queue_full", kind="rate_limit_error") from None
        except Closing as e:
            raise APIError(503, str(e), code="unavailable", kind="server_error") from None
        except SpecdecError as e:  # the prompt does not fit the context
            service.requests["invalid"] += 1
            raise APIError(400, str(e), "prompt", "context_length_exceeded") from None
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": service.name}
        if stream:
            return StreamingResponse(sse(service, job, head, usage), media_type="text/event-stream")
        return await whole(service, job, head, request)

    return app


def usage_of(job: Job, completion: int) -> dict:
    prompt = len(job.ids) + bool(job.healed)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


async def whole(service: Service, job: Job, head: dict, request: Request) -> JSONResponse:
    """Wait for the whole completion (checking once a second that the client is still there)."""
    tokens, text, first_at, ended = [], "", None, False
    try:
        while True:
            try:
                event = await asyncio.wait_for(job.next_event(), 1.0)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    return JSONResponse({})
                continue
            first_at = first_at or time.perf_counter()
            tokens += event.tokens
            text += "".join(piece for piece, _ in event.pieces)
            if event.finish_reason:
                ended = True
                break
    finally:
        service.finished(job, first_at, len(tokens), ended)
    if event.finish_reason == "error":
        raise APIError(500, f"the engine failed: {service.failure}; see the server's log", kind="server_error")
    return JSONResponse({**head, "choices": [{"index": 0, "text": text, "logprobs": None,
                                              "finish_reason": FINISH[event.finish_reason]}],
                         "usage": usage_of(job, len(tokens)),
                         "specdec": {**stats(service, event), "token_ids": tokens}})


def stats(service: Service, event: Event) -> dict:
    return {"method": service.method, "k": service.k, "steps": event.steps, "proposed": event.proposed,
            "accepted": event.accepted}


async def sse(service: Service, job: Job, head: dict, include_usage: bool):
    """Server-sent events in OpenAI's streaming format: one event per engine step (steps that
    queued up behind a slow client go out as one event); finish_reason "error" if the engine failed."""
    tokens, first_at, ended = 0, None, False
    try:
        while True:
            event = await job.next_event()
            first_at = first_at or time.perf_counter()
            tokens += len(event.tokens)
            finish = FINISH[event.finish_reason] if event.finish_reason else None
            chunk = {**head, "choices": [{"index": 0, "text": "".join(p for p, _ in event.pieces), "logprobs": None,
                                          "finish_reason": finish}],
                     "specdec": {**stats(service, event), "token_ids": event.tokens, "emitted": tokens,
                                 "pieces": event.pieces}}
            yield f"data: {json.dumps(chunk)}\n\n"
            if finish:
                ended = True
                break
        if include_usage:
            yield f"data: {json.dumps({**head, 'choices': [], 'usage': usage_of(job, tokens)})}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        service.finished(job, first_at, tokens, ended)
