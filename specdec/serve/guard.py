"""What stands between the network and the routes: limits, the API key, content types, CORS.

- `Guard`, an ASGI middleware, per request and before any route runs:
  - CORS, closed by default: a request whose Origin is neither the server itself nor one of
    `cors_origins` gets 403 (so a web page elsewhere cannot drive the server, not even with a
    "simple" text/plain POST that browsers send without asking); allowed origins get the CORS
    headers and their preflight (OPTIONS) answered;
  - the API key: `Authorization: Bearer KEY` on /v1/* (and on /health and /metrics when
    `key_for_all`), else 401;
  - POST bodies: JSON only (415 otherwise); a Content-Length above `max_body` is refused with 413
    before a byte of the body is read; a body without one is counted while read and refused at
    the limit; a body not complete within `body_timeout` seconds gets 408. The route then gets
    the whole body at once.
- `protocol(...)`: uvicorn's HTTP/1.1 protocol with a connection cap (connections beyond
  `max_connections` are closed at once) and a header timeout (a connection that has not sent a
  whole request head within `header_timeout` seconds of connecting, or of its previous
  response, is closed). uvicorn's keep-alive timeout closes idle connections.

Errors are OpenAI's error object. This module knows nothing about models or the engine.
"""
from __future__ import annotations

import asyncio
import hmac
import json
from dataclasses import dataclass

from uvicorn.protocols.http.h11_impl import H11Protocol

CLOSE = ((b"connection", b"close"),)


@dataclass(frozen=True)
class Limits:
    max_body: int = 1 << 20            # bytes of a request body
    body_timeout: float = 10.0         # seconds to receive a whole body
    header_timeout: float = 10.0       # seconds to receive a request's head
    idle_timeout: float = 5.0          # seconds a kept-alive connection may stay idle
    max_connections: int = 256
    api_key: str | None = None
    key_for_all: bool = False          # /health and /metrics need the key too
    cors_origins: tuple[str, ...] = ()  # "*" allows every origin


def error(status: int, message: str, code: str, kind: str = "invalid_request_error",
          headers: tuple = ()) -> tuple[int, list, bytes]:
    """An OpenAI error response; a refusal before the body is read also closes the connection
    (`Connection: close`), so the server never reads the rest of a body it refused."""
    body = json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}}).encode()
    return status, [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                    *headers], body


async def send_response(send, response: tuple[int, list, bytes]) -> None:
    status, headers, body = response
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class Guard:
    def __init__(self, app, limits: Limits):
        self.app, self.limits = app, limits

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        origin, method, path = headers.get("origin"), scope["method"], scope["path"]
        cors = ()
        if origin is not None and not self.same_origin(origin, headers.get("host", "")):
            if not ("*" in self.limits.cors_origins or origin in self.limits.cors_origins):
                return await send_response(send, error(
                    403, f"requests from the web origin {origin[:100]} are not allowed; start the server with "
                         "--cors-origin ORIGIN to allow it", "origin_not_allowed"))
            cors = ((b"access-control-allow-origin", origin.encode("latin-1")), (b"vary", b"Origin"))
            if method == "OPTIONS":
                return await send_response(send, (204, [*cors, (b"access-control-allow-methods", b"GET, POST"),
                                                        (b"access-control-allow-headers",
                                                         b"Authorization, Content-Type"),
                                                        (b"access-control-max-age", b"600")], b""))
        send = self.with_headers(send, cors) if cors else send
        if self.needs_key(path) and not self.key_ok(headers.get("authorization", "")):
            return await send_response(send, error(
                401, "a valid API key is needed: send the header 'Authorization: Bearer KEY' (the key the server "
                     "was started with, --api-key)", "invalid_api_key", "authentication_error",
                ((b"www-authenticate", b"Bearer"),)))
        if method != "POST":
            return await self.app(scope, receive, send)
        kind = headers.get("content-type", "").split(";")[0].strip().lower()
        if kind != "application/json":
            return await send_response(send, error(
                415, f"the request body must be JSON with 'Content-Type: application/json', got "
                     f"{kind[:100] or 'no content type'}", "unsupported_media_type", headers=CLOSE))
        length = headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > self.limits.max_body):
            return await send_response(send, error(
                413, f"the request body has {length[:30]} bytes; this server takes at most {self.limits.max_body} "
                     "(--max-body-bytes)", "request_too_large", headers=CLOSE))
        try:
            body = await asyncio.wait_for(self.read_body(receive), self.limits.body_timeout)
        except asyncio.TimeoutError:
            return await send_response(send, error(
                408, f"the request body did not arrive within {self.limits.body_timeout:g} s", "request_timeout",
                headers=CLOSE))
        if body is None:
            return await send_response(send, error(
                413, f"the request body exceeds {self.limits.max_body} bytes (--max-body-bytes)", "request_too_large",
                headers=CLOSE))
        if body is False:
            return  # the client went away
        return await self.app(scope, replay(body, receive), send)

    def needs_key(self, path: str) -> bool:
        if self.limits.api_key is None:
            return False
        return path.startswith("/v1/") or (self.limits.key_for_all and path in ("/health", "/metrics"))

    def key_ok(self, authorization: str) -> bool:
        scheme, _, key = authorization.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(key.strip().encode(), self.limits.api_key.encode())

    @staticmethod
    def same_origin(origin: str, host: str) -> bool:
        return origin.partition("://")[2] == host

    @staticmethod
    def with_headers(send, extra: tuple):
        async def sending(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)
        return sending

    async def read_body(self, receive) -> bytes | None | bool:
        """The whole body; None past the limit; False when the client disconnected."""
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return False
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limits.max_body:
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


def replay(body: bytes, receive):
    """An ASGI receive that hands over the body read, then the connection's own messages
    (http.disconnect when the client goes away)."""
    sent = False

    async def receiving():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()
    return receiving


def protocol(limits: Limits) -> type:
    """uvicorn's H11Protocol with the connection cap and the header timeout of `limits`."""

    class Guarded(H11Protocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self.head_timer = None
            if len(self.connections) > limits.max_connections:
                self.transport.close()
                return
            self.arm_head_timer()

        def arm_head_timer(self) -> None:
            self.head_timer = self.loop.call_later(limits.header_timeout, self.head_timed_out)

        def head_timed_out(self) -> None:
            self.head_timer = None
            if self.cycle is None or self.cycle.response_complete:  # no request head yet
                self.transport.close()

        def data_received(self, data: bytes) -> None:
            waiting = self.cycle is None or self.cycle.response_complete
            if waiting and self.head_timer is None:
                self.arm_head_timer()  # the first bytes of a kept-alive connection's next request
            super().data_received(data)
            if self.head_timer is not None and self.cycle is not None and not self.cycle.response_complete:
                self.head_timer.cancel()
                self.head_timer = None

        def connection_lost(self, exc) -> None:
            if getattr(self, "head_timer", None) is not None:
                self.head_timer.cancel()
            super().connection_lost(exc)

    return Guarded
