"""Other clients' latency under a flood of oversized and slow clients, against quiet (docs/serving.md).

Starts `specdec serve` (the shipped target, plain decoding, --max-batch 8) on a free port; then
`--repeats` times, interleaved: QUIET seconds of normal clients alone, then FLOOD seconds of the
same normal clients while 16 clients send 10 MB bodies (half announced by Content-Length, half
chunked without one) in a loop and 50 clients trickle request heads one byte a second
(slowloris), reconnecting when the server closes them. Normal clients: 4 in parallel, each
sending greedy completions of 16 tokens one after another. Prints the median, p99 and count of
their latencies per phase, the p99 ratio flood / quiet, and the time a 10 MB body takes to be
refused; the last line is one JSON object.

    /work/tools/quiet python docs/serve-flood.py          (from the repository root)
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
BODY = {"prompt": "def fibonacci(n):", "max_tokens": 16, "temperature": 0}
TEN_MB = 10 * 1024 * 1024


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def normal(url: str, stop: asyncio.Event, latencies: list[float]) -> None:
    async with httpx.AsyncClient(timeout=60) as h:
        while not stop.is_set():
            t0 = time.perf_counter()
            r = await h.post(url + "/v1/completions", json=BODY)
            assert r.status_code == 200, r.text
            latencies.append(time.perf_counter() - t0)


async def oversized(port: int, stop: asyncio.Event, announced: bool, refusals: list[float]) -> None:
    chunk = b"x" * 65536
    while not stop.is_set():
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    + (f"Content-Length: {TEN_MB + 12}\r\n" if announced else "Transfer-Encoding: chunked\r\n")
                    + "\r\n").encode()
            t0 = time.perf_counter()
            writer.write(head + (b'{"prompt": "' if announced else b"c\r\n" + b'{"prompt": "' + b"\r\n"))
            answer = asyncio.ensure_future(reader.readline())
            sent = 0
            while sent < TEN_MB and not answer.done():
                writer.write(chunk if announced else b"10000\r\n" + chunk + b"\r\n")
                await writer.drain()
                sent += len(chunk)
            status = await asyncio.wait_for(answer, 10)
            refusals.append(time.perf_counter() - t0)
            assert b" 413 " in status, status
            writer.close()
        except (ConnectionError, asyncio.TimeoutError):
            await asyncio.sleep(0.01)


async def slow(port: int, stop: asyncio.Event) -> None:
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    while not stop.is_set():
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            for byte in head:
                if stop.is_set():
                    break
                writer.write(bytes([byte]))
                await writer.drain()
                await asyncio.sleep(1.0)
            writer.close()
        except ConnectionError:
            await asyncio.sleep(0.1)


async def phase(url: str, port: int, seconds: float, flood: bool) -> tuple[list[float], list[float]]:
    stop, latencies, refusals = asyncio.Event(), [], []
    tasks = [asyncio.ensure_future(normal(url, stop, latencies)) for _ in range(4)]
    if flood:
        tasks += [asyncio.ensure_future(oversized(port, stop, i % 2 == 0, refusals)) for i in range(16)]
        tasks += [asyncio.ensure_future(slow(port, stop)) for _ in range(50)]
    await asyncio.sleep(seconds)
    stop.set()
    for t in tasks[4:]:
        t.cancel()
    await asyncio.gather(*tasks[:4])
    await asyncio.gather(*tasks[4:], return_exceptions=True)
    return latencies, refusals


def p99(xs: list[float]) -> float:
    return sorted(xs)[min(len(xs) - 1, int(0.99 * len(xs)))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quiet-seconds", type=float, default=8)
    p.add_argument("--flood-seconds", type=float, default=8)
    args = p.parse_args()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    server = subprocess.Popen([sys.executable, "-m", "specdec.cli", "serve", "--port", str(port), "--max-batch", "8",
                               "--header-timeout", "10", "--max-connections", "256"], env=env,
                              stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(600):
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        httpx.post(url + "/v1/completions", json=BODY, timeout=60)  # warm
        quiet, flood, refusals = [], [], []
        per_repeat = []
        for _ in range(args.repeats):
            q, _ = asyncio.run(phase(url, port, args.quiet_seconds, False))
            f, r = asyncio.run(phase(url, port, args.flood_seconds, True))
            quiet += q
            flood += f
            refusals += r
            per_repeat.append(p99(f) / p99(q))
    finally:
        server.terminate()
        server.wait(60)
    result = {"quiet": {"median_s": statistics.median(quiet), "p99_s": p99(quiet), "requests": len(quiet)},
              "flood": {"median_s": statistics.median(flood), "p99_s": p99(flood), "requests": len(flood)},
              "p99_ratio": p99(flood) / p99(quiet), "p99_ratio_per_repeat": per_repeat,
              "refusal_of_10MB_s": {"median": statistics.median(refusals), "max": max(refusals),
                                    "count": len(refusals)},
              "conditions": {"server": "specdec serve, shipped target, plain, --max-batch 8, 1 process",
                             "normal_clients": 4, "request": BODY, "oversized_clients": 16, "slow_clients": 50,
                             "repeats": args.repeats, "quiet_s": args.quiet_seconds, "flood_s": args.flood_seconds,
                             "cpus": os.cpu_count()}}
    for name in ("quiet", "flood"):
        r = result[name]
        print(f"{name:>5}: median {r['median_s'] * 1000:.1f} ms, p99 {r['p99_s'] * 1000:.1f} ms over {r['requests']} "
              "requests")
    print(f"p99 flood / quiet: {result['p99_ratio']:.2f} (per repeat: "
          f"{', '.join(f'{x:.2f}' for x in per_repeat)}); a 10 MB body refused in "
          f"{result['refusal_of_10MB_s']['median'] * 1000:.1f} ms (median, max "
          f"{result['refusal_of_10MB_s']['max'] * 1000:.1f} ms, {len(refusals)} bodies)")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
