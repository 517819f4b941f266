"""`specdec bench serve`: the server against the same engine offline, plain vs speculative.

For each method (plain decoding = the engine with k = 0, and one speculative method) and each
concurrency c:
- offline: every prompt submitted to an Engine of c rows in this process (continuous batching,
  no HTTP): output tokens / wall time;
- server: `specdec serve` in a subprocess, c clients streaming over HTTP (httpx), each taking
  the next prompt when its last one ends: output tokens / wall time, time to first token (request
  sent to first streamed text), and inter-token latency: each streamed event's gap since the
  previous one, divided over the tokens it carries (a speculative step streams several at once).

Greedy decoding, HumanEval prompts without trailing whitespace (so neither side heals a token),
the same max_tokens; the server's client runs on the same machine and its CPU use is part of the
figure. Ratios: server / offline at each c, speculative / plain at each c.
"""
from __future__ import annotations

import asyncio
import json
import math
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import torch

from ..api import Loaded, encode_prompts
from ..decoding.engine import Engine, Request
from ..decoding.pipeline import stop_rule
from .conditions import hardware, software
from .workloads import humaneval_prompts


def offline(target, proposer, k: int, ids: list[list[int]], max_tokens: int, concurrency: int) -> dict:
    engine = Engine(target.admitted, proposer, k, concurrency, target.admitted.context)
    requests = [Request(p, stop_rule(target.tokenizer, max_tokens)) for p in ids]
    start = time.perf_counter()
    for request in requests:
        engine.submit(request)
    while engine.busy:
        engine.step()
    seconds = time.perf_counter() - start
    tokens = sum(len(r.row.tokens) for r in requests)
    m = engine.metrics
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds, "tau": m.mean_acceptance_length,
            "acceptance_rate": m.acceptance_rate, "steps": m.steps, "step_breakdown_ms": m.step_breakdown_ms,
            "prefill_seconds": m.prefill_seconds}


def engine_seconds(url: str) -> dict[str, float]:
    """The server's engine time by phase so far (its /metrics)."""
    lines = httpx.get(url + "/metrics").text.splitlines()
    return {line.split('"')[1]: float(line.split()[-1]) for line in lines
            if line.startswith("specdec_engine_seconds_total{")}


async def clients(url: str, prompts: list[str], max_tokens: int, concurrency: int) -> dict:
    todo = list(enumerate(prompts))
    ttft, gaps, tokens = [], [], 0

    async def worker(h: httpx.AsyncClient):
        nonlocal tokens
        while todo:
            _, prompt = todo.pop(0)
            body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
            sent = last = time.perf_counter()
            async with h.stream("POST", url + "/v1/completions", json=body) as r:
                r.raise_for_status()
                async for line in r.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    now = time.perf_counter()
                    n = len(json.loads(line[6:])["specdec"]["token_ids"])
                    if not n:
                        continue
                    if last == sent:
                        ttft.append(now - sent)
                    else:
                        gaps.extend([(now - last) / n] * n)
                    tokens += n
                    last = now

    before = engine_seconds(url)
    async with httpx.AsyncClient(timeout=600) as h:
        start = time.perf_counter()
        await asyncio.gather(*(worker(h) for _ in range(concurrency)))
        seconds = time.perf_counter() - start
    engine = {phase: t - before[phase] for phase, t in engine_seconds(url).items()}
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds, "engine_seconds": engine,
            "ttft_p50_ms": 1e3 * percentile(ttft, 50), "ttft_p99_ms": 1e3 * percentile(ttft, 99),
            "itl_p50_ms": 1e3 * percentile(gaps, 50), "itl_p99_ms": 1e3 * percentile(gaps, 99)}


def median_run(runs: list[dict]) -> dict:
    """The run of median throughput (its latencies with it)."""
    return sorted(runs, key=lambda r: r["tokens_per_s"])[len(runs) // 2]


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank q-th percentile (with fewer than 100 values, p99 is the largest)."""
    ranked = sorted(values)
    return ranked[min(len(ranked) - 1, math.ceil(q / 100 * len(ranked)) - 1)]


def start_server(args: list[str]) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "specdec.cli", "serve", "--port", str(port), *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"specdec serve did not start: {proc.stderr.read()}")


def bench_serve(target: Loaded, method: str, serve_args: list[str], proposer, k: int,
                concurrencies: list[int], n_prompts: int, max_tokens: int, repeats: int) -> dict:
    prompts = [p.rstrip() for p in humaneval_prompts(n_prompts)]
    ids = encode_prompts(target, prompts, max_tokens)
    methods = {"plain": (None, 0, []), method: (proposer, k, serve_args)}
    model_args = ["--model", str(target.path)]
    offline(target, proposer, k, ids[:2], 8, 2)  # warm-up: kernels, allocator
    cells = []
    for name, (prop, kk, args) in methods.items():
        proc, url = start_server([*model_args, *args, "--max-batch", str(max(concurrencies))])
        try:
            asyncio.run(clients(url, prompts[:2], 8, 2))  # warm-up
            for c in concurrencies:
                runs = []
                for _ in range(repeats):  # interleaved: a disturbance hits one pair, not one side
                    runs.append((offline(target, prop, kk, ids, max_tokens, c),
                                 asyncio.run(clients(url, prompts, max_tokens, c))))
                off, on = (median_run([r[side] for r in runs]) for side in (0, 1))
                cells.append({"method": name, "k": kk, "concurrency": c, "offline": off, "server": on,
                              "server_over_offline": on["tokens_per_s"] / off["tokens_per_s"],
                              "repeats_tokens_per_s": [[r[0]["tokens_per_s"], r[1]["tokens_per_s"]] for r in runs]})
                print(f"{name} c={c}: offline {off['tokens_per_s']:.0f} tok/s, server {on['tokens_per_s']:.0f} tok/s "
                      f"(medians of {repeats})", file=sys.stderr)
        finally:
            proc.terminate()
            proc.wait(60)
    plain = {cell["concurrency"]: cell for cell in cells if cell["method"] == "plain"}
    for cell in cells:
        base = plain[cell["concurrency"]]
        cell["speculative_over_plain"] = {side: cell[side]["tokens_per_s"] / base[side]["tokens_per_s"]
                                          for side in ("offline", "server")}
    return {"cells": cells, "conditions": {
        "target": target.name, "method": method, "k": k, "workload": f"humaneval, first {n_prompts} prompts "
        "(trailing whitespace stripped)", "max_tokens": max_tokens, "sampling": "greedy", "repeats": repeats,
        "client": "httpx streaming clients in the bench process, same machine", "server_args": serve_args,
        "hardware": hardware(),
        "software": software(), "torch_threads": torch.get_num_threads()}}


def format_serve(result: dict) -> str:
    lines = ["| method | clients | offline tok/s | server tok/s | server / offline | TTFT p50 ms | TTFT p99 ms | "
             "inter-token p50 ms | inter-token p99 ms | spec / plain offline | spec / plain server | τ |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in result["cells"]:
        s, o = c["server"], c["offline"]
        tau = "–" if o["tau"] is None else f"{o['tau']:.2f}"
        lines.append(f"| {c['method']} k={c['k']} | {c['concurrency']} | {o['tokens_per_s']:.0f} | {s['tokens_per_s']:.0f} | "
                     f"{c['server_over_offline']:.2f}x | {s['ttft_p50_ms']:.0f} | {s['ttft_p99_ms']:.0f} | "
                     f"{s['itl_p50_ms']:.1f} | {s['itl_p99_ms']:.1f} | {c['speculative_over_plain']['offline']:.2f}x | "
                     f"{c['speculative_over_plain']['server']:.2f}x | {tau} |")
    cond = result["conditions"]
    lines.append(f"\n{cond['target']}, greedy, {cond['workload']}, max_tokens {cond['max_tokens']}, median of "
                 f"{cond['repeats']} interleaved repeats; "
                 f"{cond['hardware']['cpu']}, {cond['torch_threads']} threads; {cond['client']}")
    return "\n".join(lines) + "\n" + json.dumps(result)


def write(result: dict, out: str) -> None:
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / "serve.json").write_text(json.dumps(result, indent=1))
