"""The HTTP side of `specdec serve` (FastAPI on uvicorn): OpenAI's completions and chat completions
APIs and formats, /v1/models, /health, /metrics and the live view at /.

Every bad request gets OpenAI's error object ({"error": {"message", "type", "param", "code"}}):
400 (malformed JSON, wrong types, values out of range or not supported, a prompt that does not fit
the context, a chat request to a model without a chat template), 401 (API key), 403 (a foreign
web origin), 404 (another model), 408/413/415 (the body: too slow, too large, not JSON; guard.py),
429 (the server is full, with Retry-After) or 503 (shutting down, with Retry-After); the server
keeps serving. A client that goes away mid-request cancels its job: its row leaves at the next
step. A job still open when a shutdown's timeout runs out ends with an error: an error event in a
stream, a 503 error body otherwise; never a truncated answer that looks complete.

Responses carry specdec's figures in an extra field "specdec" (token ids, steps, proposed and
accepted drafts; in a stream, the step's text pieces labelled "draft" or "target").
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from pathlib import Path

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse

from ..decoding.pipeline import BadConstraint
from ..errors import SpecdecError
from . import requests
from .guard import Guard, Limits, protocol
from .prometheus import CONTENT_TYPE
from .requests import APIError, Parsed
from .service import Closing, Event, Job, NoChat, QueueFull, Service

PAGE = Path(__file__).with_name("static") / "index.html"
FINISH = {"eos": "stop", "stop": "stop", "length": "length"}  # specdec's -> OpenAI's
RETRY_AFTER = "1"  # seconds a client refused for load (429) or shutdown (503) should wait


def error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def ended_early(service: Service, reason: str) -> APIError:
    """The error of a job that ended without finishing: the shutdown deadline, or the engine broke."""
    if reason == "shutdown":
        return APIError(503, "the server shut down before this completion finished; retry on another instance",
                        code="shutdown", kind="server_error", headers={"Retry-After": RETRY_AFTER})
    return APIError(500, f"the engine failed: {service.failure}; see the server's log", code="engine_failed",
                    kind="server_error")


def http_config(service: Service, limits: Limits) -> uvicorn.Config:
    """uvicorn's settings for the app of `service` behind `limits` (guard.protocol: the head and idle timeouts)."""
    return uvicorn.Config(create_app(service, limits), log_level="warning", lifespan="off", http=protocol(limits),
                          timeout_keep_alive=limits.idle_timeout, timeout_graceful_shutdown=5)


def create_app(service: Service, limits: Limits = Limits()):
    app = FastAPI(title="specdec serve", openapi_url=None, docs_url=None, redoc_url=None)
    add_error_handlers(app)

    def model_card() -> dict:
        return {"id": service.name, "object": "model", "created": 0, "owned_by": "specdec", "method": service.method,
                "k": service.k, "context_length": service.context, "chat": service.chat}

    @app.get("/", response_class=HTMLResponse)
    async def page():
        return HTMLResponse(PAGE.read_text())

    @app.get("/health")
    async def health():
        ok = not (service.closing or service.failure)
        return JSONResponse({"status": "ok" if ok else "closing" if service.closing else "failed",
                             "error": service.failure, "batch_size": len(service.engine.requests),
                             "queue_length": service.queue_length,
                             "jobs": len(service.jobs)},
                            status_code=200 if ok else 503, headers={} if ok else {"Retry-After": RETRY_AFTER})

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        if name != service.name:
            raise APIError(404, f"model {name[:100]!r} is not served here; this server serves {service.name!r}",
                           "model", "model_not_found")
        return model_card()

    @app.get("/metrics")
    async def metrics():
        return Response(service.metrics.text(), media_type=CONTENT_TYPE)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await run(service, request, read(service, await request.body(), requests.completion), chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await run(service, request, read(service, await request.body(), requests.chat), chat=True)

    return Guard(app, limits)


def add_error_handlers(app) -> None:
    """Every error as the API's JSON error (requests.APIError): raised ones, malformed requests, unknown routes
    and methods."""
    app.add_exception_handler(APIError, lambda request, e: error_response(e))
    app.add_exception_handler(RequestValidationError, lambda request, e: error_response(
        APIError(400, "the request is malformed")))
    app.add_exception_handler(404, lambda request, e: error_response(
        APIError(404, f"no route {request.method} {request.url.path[:100]}; see GET /v1/models, "
                      "POST /v1/completions, POST /v1/chat/completions", code="not_found")))
    app.add_exception_handler(405, lambda request, e: error_response(
        APIError(405, f"{request.method} is not allowed on {request.url.path[:100]}", code="method_not_allowed")))


def read(service: Service, raw: bytes, parse) -> Parsed:
    """A request body parsed by `parse`; a malformed one is counted and refused."""
    try:
        return parse(requests.decode_json(raw), service.name)
    except APIError:
        service.requests["invalid"] += 1
        raise

def response_head(service: Service, chat: bool) -> dict:
    """What every response (or chunk) of one completion starts with: its id, object, time and model."""
    prefix, kind = ("chatcmpl", "chat.completion") if chat else ("cmpl", "text_completion")
    return {"id": f"{prefix}-{uuid.uuid4().hex}", "object": kind, "created": int(time.time()), "model": service.name}


async def run(service: Service, request: Request, parsed: Parsed, chat: bool):
    """Admit, encode and submit a parsed completion request; its response, streamed or whole, or the
    API error of a full queue, a closing server, a chat without a template or a prompt too long."""
    try:
        job = service.admit(parsed.params)
    except QueueFull as e:
        raise APIError(429, str(e), code="server_full", kind="rate_limit_error",
                       headers={"Retry-After": RETRY_AFTER}) from None
    except Closing as e:
        raise APIError(503, str(e), code="unavailable", kind="server_error",
                       headers={"Retry-After": RETRY_AFTER}) from None
    except NoChat as e:
        service.requests["invalid"] += 1
        raise APIError(400, str(e), "messages", "no_chat_template") from None
    try:
        await asyncio.to_thread(service.encode, job)
        service.submit(job)
    except Closing as e:
        service.finished(job, None, 0, False)
        raise APIError(503, str(e), code="unavailable", kind="server_error",
                       headers={"Retry-After": RETRY_AFTER}) from None
    except BadConstraint as e:
        service.finished(job, None, 0, False)
        service.requests["invalid"] += 1
        raise APIError(400, str(e), "response_format", "invalid_response_format") from None
    except SpecdecError as e:  # the prompt does not fit the context
        service.finished(job, None, 0, False)
        service.requests["invalid"] += 1
        raise APIError(400, str(e), "messages" if chat else "prompt", "context_length_exceeded") from None
    head = response_head(service, chat)
    if parsed.stream:
        return StreamingResponse(sse(service, job, head, parsed.include_usage, chat), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    return await whole(service, job, head, request, chat)


def usage_of(job: Job, completion: int) -> dict:
    prompt = job.prompt.length
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def choice(text: str, finish: str | None, chat: bool, delta: bool = False) -> dict:
    if not chat:
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    message = {"role": "assistant", "content": text}
    return {"index": 0, ("delta" if delta else "message"): message, "logprobs": None, "finish_reason": finish}


async def whole(service: Service, job: Job, head: dict, request: Request, chat: bool) -> Response:
    """Wait for the whole completion (checking once a second that the client is still there)."""
    tokens, text, first_at, event = [], "", None, None
    try:
        while True:
            try:
                event = await asyncio.wait_for(job.next_event(), 1.0)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    return Response(status_code=499)  # nobody reads it
                continue
            first_at = first_at or time.perf_counter()
            tokens += event.tokens
            text += "".join(piece for piece, _ in event.pieces)
            if event.finish_reason:
                break
    finally:
        service.finished(job, first_at, len(tokens), event is not None and event.finish_reason in FINISH)
    if event.finish_reason not in FINISH:
        return error_response(ended_early(service, event.finish_reason))
    return JSONResponse({**head, "choices": [choice(text, FINISH[event.finish_reason], chat)],
                         "usage": usage_of(job, len(tokens)),
                         "specdec": {**stats(service, event), "token_ids": tokens}})


def stats(service: Service, event: Event) -> dict:
    return {"method": service.method, "k": service.k, "steps": event.steps, "proposed": event.proposed,
            "accepted": event.accepted}


async def sse(service: Service, job: Job, head: dict, include_usage: bool, chat: bool):
    """Server-sent events in OpenAI's streaming format: one event per engine step (steps that
    queued up behind a slow client go out as one event). A job that ends without finishing (the
    shutdown deadline, a broken engine) ends with an error event, then [DONE]."""
    tokens, first_at, finished = 0, None, False
    head = {**head, "object": "chat.completion.chunk"} if chat else head
    try:
        if chat:
            yield f"data: {json.dumps({**head, 'choices': [choice('', None, True, True)]})}\n\n"
        while True:
            event = await job.next_event()
            first_at = first_at or time.perf_counter()
            if event.finish_reason and event.finish_reason not in FINISH:
                yield f"data: {json.dumps(ended_early(service, event.finish_reason).body())}\n\n"
                break
            tokens += len(event.tokens)
            finish = FINISH.get(event.finish_reason)
            text = "".join(p for p, _ in event.pieces)
            piece = choice(text, finish, chat, delta=True)
            if chat:
                piece["delta"] = {"content": text} if text or not finish else {}
            chunk = {**head, "choices": [piece],
                     "specdec": {**stats(service, event), "token_ids": event.tokens, "emitted": tokens,
                                 "pieces": event.pieces}}
            yield f"data: {json.dumps(chunk)}\n\n"
            if finish:
                finished = True
                break
        if finished and include_usage:
            yield f"data: {json.dumps({**head, 'choices': [], 'usage': usage_of(job, tokens)})}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        service.finished(job, first_at, tokens, finished)
