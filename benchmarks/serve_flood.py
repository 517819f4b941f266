"""Other clients' latency under a flood of oversized and slow clients, against quiet (docs/serving.md).

Starts `specdec serve` (the shipped target, plain decoding, --max-batch 8) on a free port; then
`--repeats` times, interleaved: QUIET seconds of normal clients alone, then FLOOD seconds of the
same normal clients while 16 clients (another process, nice 19) send 10 MB bodies (half announced by Content-Length, half
chunked without one) in a loop and 50 clients trickle request heads one byte a second
(slowloris), reconnecting when the server closes them. Normal clients: 4 in parallel, each
sending greedy completions of 16 tokens one after another. Prints the median, p99 and count of
their latencies per phase, the p99 ratio flood / quiet, and the time a 10 MB body takes to be
refused (measured first, alone: from sending its head to reading the 413); the last line is one
JSON object.

    python benchmarks/serve_flood.py [--repeats 3] [--quiet-seconds 8] [--flood-seconds 8] [--model PATH]
        (on an otherwise idle machine)
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
            head = ("POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
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


async def refusal(port: int) -> float:
    """Seconds from sending a 10 MB request's head (and its first 64 KiB) to reading the 413."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    t0 = time.perf_counter()
    writer.write(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {TEN_MB}\r\n\r\n".encode() + b"x" * 65536)
    status = await reader.readline()
    seconds = time.perf_counter() - t0
    assert b" 413 " in status, status
    writer.close()
    return seconds


async def refusals(port: int, n: int) -> list[float]:
    return [await refusal(port) for _ in range(n)]


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


async def flood_clients(port: int, seconds: float) -> int:
    """16 oversized and 50 slow clients for `seconds`; returns how many bodies got their 413."""
    stop, refused = asyncio.Event(), []
    tasks = [asyncio.ensure_future(oversized(port, stop, i % 2 == 0, refused)) for i in range(16)]
    tasks += [asyncio.ensure_future(slow(port, stop)) for _ in range(50)]
    await asyncio.sleep(seconds)
    stop.set()
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return len(refused)


async def phase(url: str, port: int, seconds: float, flood: bool) -> tuple[list[float], int]:
    """Normal clients for `seconds`, beside the flood (another process, niced: an attacker's CPU is
    not the server's; on this 2-core machine it would otherwise take the cores from both)."""
    stop, latencies = asyncio.Event(), []
    flooder = None
    if flood:
        flooder = await asyncio.create_subprocess_exec(
            "nice", "-n", "19", sys.executable, __file__, "--flood-client", str(port), str(seconds),
            stdout=asyncio.subprocess.PIPE)
    tasks = [asyncio.ensure_future(normal(url, stop, latencies)) for _ in range(4)]
    await asyncio.sleep(seconds)
    stop.set()
    await asyncio.gather(*tasks)
    refused = int((await flooder.communicate())[0]) if flooder else 0
    return latencies, refused


def p99(xs: list[float]) -> float:
    return sorted(xs)[min(len(xs) - 1, int(0.99 * len(xs)))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quiet-seconds", type=float, default=8)
    p.add_argument("--flood-seconds", type=float, default=8)
    p.add_argument("--refusals", type=int, default=20, help="10 MB bodies refused alone, timed first")
    p.add_argument("--model", default=str(REPO / "models" / "target"), help="the served target (default: the "
                   "shipped one)")
    p.add_argument("--flood-client", nargs=2, metavar=("PORT", "SECONDS"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.flood_client:
        print(asyncio.run(flood_clients(int(args.flood_client[0]), float(args.flood_client[1]))))
        return
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    server = subprocess.Popen([sys.executable, "-m", "specdec.cli", "serve", "--model", args.model,
                               "--port", str(port), "--max-batch", "8",
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
        quiet, flood, flooded_refusals = [], [], []
        per_repeat = []
        alone = asyncio.run(refusals(port, args.refusals))
        for _ in range(args.repeats):
            q, _ = asyncio.run(phase(url, port, args.quiet_seconds, False))
            f, r = asyncio.run(phase(url, port, args.flood_seconds, True))
            quiet += q
            flood += f
            flooded_refusals.append(r)
            per_repeat.append(p99(f) / p99(q))
    finally:
        server.terminate()
        server.wait(60)
    result = {"quiet": {"median_s": statistics.median(quiet), "p99_s": p99(quiet), "requests": len(quiet)},
              "flood": {"median_s": statistics.median(flood), "p99_s": p99(flood), "requests": len(flood)},
              "p99_ratio": p99(flood) / p99(quiet), "p99_ratio_per_repeat": per_repeat,
              "refusal_of_10MB_s": {"median": statistics.median(alone), "max": max(alone), "count": len(alone)},
              "flood_bodies_refused": sum(flooded_refusals),
              "conditions": {"server": f"specdec serve, {args.model}, plain, --max-batch 8, 1 process",
                             "normal_clients": 4, "request": BODY, "oversized_clients": 16, "slow_clients": 50,
                             "flood_process": "separate, nice 19",
                             "repeats": args.repeats, "quiet_s": args.quiet_seconds, "flood_s": args.flood_seconds,
                             "cpus": os.cpu_count()}}
    for name in ("quiet", "flood"):
        r = result[name]
        print(f"{name:>5}: median {r['median_s'] * 1000:.1f} ms, p99 {r['p99_s'] * 1000:.1f} ms over {r['requests']} "
              "requests")
    print(f"p99 flood / quiet: {result['p99_ratio']:.2f} (per repeat: "
          f"{', '.join(f'{x:.2f}' for x in per_repeat)}); {sum(flooded_refusals)} 10 MB bodies refused during "
          f"the floods; alone, a 10 MB body is refused in {result['refusal_of_10MB_s']['median'] * 1000:.1f} ms "
          f"(median of {len(alone)}, max {result['refusal_of_10MB_s']['max'] * 1000:.1f} ms)")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
