"""A real `specdec serve` process on 127.0.0.1 for the server tests, and the tiny draft it uses."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from .conftest import free_port

REPO = Path(__file__).resolve().parent.parent
HANG = 600  # seconds: a state that never comes fails the test instead of hanging it


def wait_until(condition, what: str) -> None:
    """Poll `condition()` until it holds; a state that never comes fails with `what` after HANG seconds."""
    deadline = time.monotonic() + HANG
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {HANG} s"
        time.sleep(0.01)


class Server:
    """`specdec serve ARGS` in a subprocess; `url` once /health answers."""

    def __init__(self, *args: str, log: Path, env: dict | None = None):
        """ARGS may hold --port; else a free port is chosen. env: variables set for the server."""
        if "--port" not in args:
            args = ("--port", str(free_port()), *args)
        self.port = int(args[args.index("--port") + 1])
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        self.proc = subprocess.Popen([sys.executable, "-m", "specdec.cli", "serve", *args],
                                     env={**self.environment(), **(env or {})}, stdout=log.open("w"),
                                     stderr=subprocess.STDOUT)
        deadline = time.monotonic() + HANG  # a bound against a hang: loading takes long on a loaded machine
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"specdec serve exited with {self.proc.returncode}: {log.read_text()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"specdec serve did not answer /health within {HANG} s: {log.read_text()}")

    @staticmethod
    def environment() -> dict:
        return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}

    def stop(self, timeout: float = 60) -> bool:
        """SIGTERM (graceful shutdown) and wait; True when it ended cleanly: exit status 0 and no
        traceback in the log."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.ended_cleanly(timeout)

    def ended_cleanly(self, timeout: float = 60) -> bool:
        return self.proc.wait(timeout) == 0 and "Traceback" not in self.log.read_text()

    def metric(self, name: str, default: float | None = None) -> float:
        """One sample of /metrics, e.g. 'specdec_requests_total{outcome="cancelled"}'; `default` when
        the sample is absent (None: a KeyError)."""
        for line in httpx.get(self.url + "/metrics").text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[-1])
        if default is None:
            raise KeyError(name)
        return default

    def admitted(self) -> int:
        """Requests admitted since start: those still held and those already finished, however."""
        finished = sum(self.metric(f'specdec_requests_total{{outcome="{o}"}}', 0)
                       for o in ("ok", "cancelled", "shutdown"))
        return httpx.get(self.url + "/health").json()["jobs"] + int(finished)
