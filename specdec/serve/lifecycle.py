"""The server as a process: its listening socket, taken before the model loads (so a port in use
fails at once); uvicorn on a thread of its own while the engine keeps the main one (service.py says
why); and SIGTERM or Ctrl-C: the first stops admission and drains, a second exits at once."""
from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
from typing import Callable

import uvicorn

from ..errors import SpecdecError
from .app import create_app
from .guard import Limits, protocol


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


def run(service, limits: Limits, sock: socket.socket, shutdown_timeout: float, on_ready: Callable[[], None]) -> None:
    """Serve `service` (serve/service.Service) on `sock` until a signal has drained it: uvicorn
    answers on its own thread, the engine steps on this one; `on_ready` runs once the server listens."""
    server = uvicorn.Server(uvicorn.Config(create_app(service, limits), log_level="warning", lifespan="off",
                                           http=protocol(limits), timeout_keep_alive=limits.idle_timeout,
                                           timeout_graceful_shutdown=5))
    signals = []

    def stop(signum, frame) -> None:
        """First SIGTERM/SIGINT: stop admission and drain (the engine loop then returns); second: exit now."""
        signals.append(signum)
        if len(signals) == 1:
            print(f"specdec serve: shutting down: no new requests; running ones get up to {shutdown_timeout:g} s "
                  "(Ctrl-C again to exit at once)", file=sys.stderr, flush=True)
            service.begin_close(shutdown_timeout)
        else:
            print("specdec serve: exiting at once", file=sys.stderr, flush=True)
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
