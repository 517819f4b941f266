"""A real `specdec serve` under memory pressure: its KV cache is a budget of blocks (lm/kv_cache.py),
so a request waits for its blocks, a full queue answers 429, a request that can never fit answers
400 at once, and the process stays up; after a wave, the memory its rows took goes back."""
from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time

import httpx

from specdec.bench.workloads import humaneval_prompts

from ..serve_helpers import Server

MODEL = "models/target"  # the shipped 22M target: 3 KB of bf16 keys and values a position, 6 KB in float32


def resident(server: Server) -> int:
    with open(f"/proc/{server.proc.pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


async def completions(url: str, bodies: list[dict]) -> list[tuple[int, dict]]:
    async with httpx.AsyncClient(timeout=600) as h:
        async def one(body):
            r = await h.post(url + "/v1/completions", json=body)
            return r.status_code, r.json()
        return await asyncio.gather(*(one(b) for b in bodies))


def test_a_small_kv_budget_admits_by_memory_and_every_request_ends_200_429_or_400(tmp_path):
    """256 positions (16 blocks), 8 rows, a queue of 4: requests of 72-112 positions run two or three
    at a time while the others wait; one that needs more than the whole budget is refused at once."""
    server = Server("--model", MODEL, "--kv-budget", "256", "--max-batch", "8", "--max-queue", "4",
                    log=tmp_path / "log")
    try:
        prompts = [p.rstrip() for p in humaneval_prompts(6)]
        small = [{"prompt": "def add(a, b):", "max_tokens": 64 + 8 * (i % 6), "temperature": 0} for i in range(14)]
        huge = [{"prompt": prompts[i], "max_tokens": 200, "temperature": 0} for i in range(2)]
        results = asyncio.run(completions(server.url, huge + small))  # the huge ones first: before the queue fills
        codes = [code for code, _ in results]
        assert set(codes) <= {200, 429, 400}, codes
        assert codes[:2] == [400, 400] and all("whole cache holds 256" in body["error"]["message"]
                                               for _, body in results[:2])
        assert codes.count(200) >= 3 and codes.count(429) >= 1, codes  # 8 rows + 4 queued at most
        for (code, body), request in zip(results[2:], small):
            if code == 200:
                assert body["usage"]["completion_tokens"] <= request["max_tokens"]
        assert httpx.get(server.url + "/health").status_code == 200
        code, body = asyncio.run(completions(server.url, small[:1]))[0]
        assert code == 200  # everything it was lent came back
    finally:
        assert server.stop(), server.log.read_text()


def test_memory_returns_to_its_idle_level_after_a_wave(tmp_path):
    """16 rows of ~800 float32 positions (~80 MB of keys and values) come and go; the resident memory
    grows by about that during the wave and is back within the prefix cache's bound (4,096 positions,
    24 MB) and 32 MB of allocator slack after it."""
    server = Server("--model", MODEL, "--kv-dtype", "float32", "--max-batch", "16", log=tmp_path / "log")
    try:
        prompts = [p.rstrip() for p in humaneval_prompts(17)]
        asyncio.run(completions(server.url, [{"prompt": prompts[16], "max_tokens": 16, "temperature": 0}]))
        time.sleep(0.5)
        idle = resident(server)
        peak, done = [idle], threading.Event()

        def watch():
            while not done.wait(0.05):
                peak.append(resident(server))

        watcher = threading.Thread(target=watch)
        watcher.start()
        bodies = [{"prompt": p, "max_tokens": 640, "temperature": 0} for p in prompts[:16]]  # (seeded rows keep noise rows: 64 MB at most)
        try:
            results = asyncio.run(completions(server.url, bodies))
        finally:
            done.set()
            watcher.join()
        assert [code for code, _ in results] == [200] * 16
        tokens = sum(body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"] for _, body in results)
        time.sleep(0.5)
        after = resident(server)
        grown = max(peak) - idle
        assert grown > 0.5 * tokens * 6 * 1024, (grown, tokens)  # the rows' keys and values were resident
        assert after - idle < 24 * 2 ** 20 + 32 * 2 ** 20, (idle, max(peak), after)
    finally:
        assert server.stop(), server.log.read_text()


def test_a_repeated_prefix_is_mapped_not_prefilled_and_the_metrics_say_so(tmp_path):
    server = Server("--model", MODEL, log=tmp_path / "log")
    try:
        preamble = humaneval_prompts(3)[2] * 3  # several full blocks
        for question in ("# one\n", "# two\n"):
            code, _ = asyncio.run(completions(server.url, [{"prompt": preamble + question, "max_tokens": 4,
                                                            "temperature": 0}]))[0]
            assert code == 200
        shared = server.metric("specdec_kv_shared_blocks_total")
        tokens = len(preamble) // 8  # characters per token are fewer than 8: a lower bound on the blocks
        assert shared >= tokens // 16, (shared, tokens)
        assert server.metric('specdec_kv_blocks{state="in_use"}') == 0  # both rows gone
        assert server.metric('specdec_kv_blocks{state="promised"}') == 0
    finally:
        assert server.stop(), server.log.read_text()


def test_without_a_prefix_cache_a_later_request_is_prefilled_again(tmp_path):
    """--prefix-cache 0: the blocks of a prompt go back with its row, so the same prompt later shares
    nothing (what a benchmark of fresh prompts measures); a negative size is refused before loading."""
    server = Server("--model", MODEL, "--prefix-cache", "0", log=tmp_path / "log")
    try:
        body = {"prompt": humaneval_prompts(3)[2] * 3, "max_tokens": 4, "temperature": 0}
        for _ in range(2):
            assert asyncio.run(completions(server.url, [body]))[0][0] == 200
        assert server.metric("specdec_kv_shared_blocks_total") == 0
    finally:
        assert server.stop(), server.log.read_text()
    refused = subprocess.run([sys.executable, "-m", "specdec.cli", "serve", "--model", MODEL, "--prefix-cache", "-1"],
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "--prefix-cache" in refused.stderr, refused.stderr
