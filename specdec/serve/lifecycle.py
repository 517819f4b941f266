"""The server as a process (`serve`): its listening socket, taken before the model loads (so a port in
use fails at once); the target and its drafter loaded, the service made; uvicorn on a thread of its
own while the engine keeps the main one (service.py says why); and SIGTERM or Ctrl-C: the first stops
admission and drains, a second exits at once."""
from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import uvicorn

from .. import kernels
from ..api import DraftPlan, load
from ..errors import SpecdecError, counted
from ..lm.kv_cache import BLOCK, block_bytes, budget_blocks, describe
from .app import http_config
from .guard import Limits
from .service import Service


@dataclass(frozen=True)
class Launch:
    """What a server is asked to be (`specdec serve`'s flags, checked): the target (a path or packaged
    name, None: the default) and how it loads, its drafter, the service's name and sizes (Service), the
    address it listens on, the kernels' threads (None: auto) and the seconds a shutdown drains."""
    model: str | None
    draft: DraftPlan
    dtype: torch.dtype | None = None
    device: str | None = None
    quantize: str | None = None
    name: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    max_batch: int = 16
    max_queue: int = 64
    kv_budget: str | None = None
    kv_dtype: torch.dtype = torch.bfloat16
    prefix_cache: int | None = None
    threads: int | None = None
    shutdown_timeout: float = 30.0


def listening_socket(host: str, port: int) -> socket.socket:
    """A socket bound to host:port and listening, or one line saying why not."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise SpecdecError(f"cannot listen on {host}:{port}: {e.strerror}; give --host an address of this machine"
                           ) from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise SpecdecError(f"cannot listen on {host}:{port}: {e.strerror}; choose another --port or --host"
                           ) from None
    sock.set_inheritable(True)
    return sock


def serve(launch: Launch, limits: Limits) -> None:
    """Listen, load, and serve until a signal has drained the server (`run`). The target's KV cache is
    sized by the launch's budget (lm/kv_cache.budget_blocks: by default from the memory free now); with
    -k auto the verify curves are read or measured as the service is made, before the server listens."""
    sock = listening_socket(launch.host, launch.port)  # a port in use fails now, before loading anything
    target = load(launch.model, dtype=launch.dtype, device=launch.device, quantize=launch.quantize)
    proposer, k = launch.draft.build(target)
    kernels.set_threads(launch.threads)
    cfg = target.admitted.model.config
    blocks, budget = budget_blocks(launch.kv_budget, block_bytes(cfg.num_hidden_layers, cfg.num_key_value_heads,
                                                                 cfg.head_dim, launch.kv_dtype))
    method = proposer.name if proposer is not None and k != 0 else "plain"
    service = Service(target, proposer, k, method, launch.max_batch, launch.max_queue, name=launch.name,
                      widths=launch.draft.widths, kv_tokens=blocks * BLOCK, kv_dtype=launch.kv_dtype,
                      prefix_cache=launch.prefix_cache, shutdown_timeout=launch.shutdown_timeout)
    if service.engine.cache.pool is not None:
        say(f"{describe(service.engine.cache.pool)} ({budget})")
    ready = (f"{service.name}" + ("" if service.name == target.name else f" ({target.path})") + f", {method}"
             + (f" k={k}" if k else "") + f", up to {counted(launch.max_batch, 'request')} per batch and "
             f"{launch.max_queue} queued" + (", API key required" if limits.api_key else "")
             + f"; http://{launch.host}:{launch.port}/")
    run(service, uvicorn.Server(http_config(service, limits)), sock, lambda: say(ready))


def run(service, server: uvicorn.Server, sock: socket.socket, on_ready: Callable[[], None]) -> None:
    """Serve `service` (serve/service.Service) with uvicorn's `server` (its config app.http_config's) on
    `sock` until a signal has drained it: uvicorn answers on its own thread, the engine steps on this
    one; `on_ready` runs once the server listens."""
    signals = []

    def stop(signum, frame) -> None:
        """First SIGTERM/SIGINT: stop admission and drain (the engine loop then returns); second: exit now."""
        signals.append(signum)
        if len(signals) == 1:
            say(f"shutting down: no new requests; running ones get up to {service.shutdown_timeout:g} s (Ctrl-C "
                "again to exit at once)")
            service.begin_close()
        else:
            say("exiting at once")
            os._exit(130 if signum == signal.SIGINT else 143)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="specdec-http", daemon=True)
    thread.start()
    while not server.started and thread.is_alive():
        time.sleep(0.02)
    if not server.started:
        host, port = sock.getsockname()[:2]
        raise SpecdecError(f"the HTTP server did not start on {host}:{port} (see the message above)")
    on_ready()
    try:
        service.run()
    finally:
        server.should_exit = True
        thread.join()


def say(line: str) -> None:
    print(f"specdec serve: {line}", file=sys.stderr, flush=True)
