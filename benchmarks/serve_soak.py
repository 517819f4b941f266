"""A soak of `specdec serve`: many clients for minutes, streamed and not, some hanging up mid-answer.

One server (specdec's flags after `--`), `--clients` clients for `--minutes`: each sends HumanEval
completions and chat requests in turn, every third one streamed, every seventh streamed request
abandoned after its third chunk (the client closes the connection). Every answer is checked (200 and
a finish reason; a non-streamed one's usage), the server's resident memory is sampled every second,
and after the last client the server must still answer /health. Prints one line a minute and a JSON
summary: requests sent, answered, abandoned by design, failed (with why), the resident memory after
the first minute, at its highest, at the end, and its growth over the second half of the soak.

    python benchmarks/serve_soak.py --minutes 10 --clients 16 -- --model qwen2.5-coder-1.5b --quantize gguf

The smoke test (tests/test_benchmarks.py) runs it for seconds on the toy target.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import threading
import time
from collections import Counter

import httpx

from serve_head_to_head import model_and_rest, request_body, specdec_server, split_at_dashes
from specdec.bench.workloads import chat_prompts, humaneval_prompts


async def client(url: str, index: int, deadline: float, prompts: dict, max_tokens: int, tally: Counter,
                 failures: list) -> None:
    n, workloads = index, list(prompts)
    async with httpx.AsyncClient(timeout=600) as h:
        while time.monotonic() < deadline:
            n += 1
            workload = workloads[n % len(workloads)]
            texts = prompts[workload]
            path, body = request_body(workload, texts[n % len(texts)], n, max_tokens)
            body["stream"] = n % 3 == 0
            if not body["stream"]:
                del body["stream_options"]
            tally["sent"] += 1
            try:
                if body["stream"]:
                    chunks, finished = 0, None
                    async with h.stream("POST", url + path, json=body) as r:
                        if r.status_code != 200:
                            raise RuntimeError(f"HTTP {r.status_code}")
                        async for line in r.aiter_lines():
                            if line.startswith("data: {"):
                                chunks += 1
                                for choice in json.loads(line[6:]).get("choices") or []:
                                    finished = choice.get("finish_reason") or finished
                                if n % 7 == 0 and chunks == 3:
                                    break  # hang up mid-answer: the server must free the row
                    if n % 7 == 0 and chunks >= 3 and finished is None:
                        tally["abandoned"] += 1
                        continue
                    if finished is None:
                        raise RuntimeError("a stream ended without a finish reason")
                else:
                    r = await h.post(url + path, json=body)
                    if r.status_code != 200:
                        raise RuntimeError(f"HTTP {r.status_code}: {r.text[:200]}")
                    answer = r.json()
                    if not answer["choices"][0].get("finish_reason") or answer["usage"]["completion_tokens"] < 1:
                        raise RuntimeError(f"an incomplete answer: {answer}")
                tally["answered"] += 1
            except (httpx.HTTPError, RuntimeError, json.JSONDecodeError, KeyError) as e:
                tally["failed"] += 1
                failures.append(f"{type(e).__name__}: {e}"[:200])


def main(argv: list[str] | None = None) -> None:
    ours, server_args = split_at_dashes(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=10)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--workloads", nargs="+", choices=("humaneval", "chat"), default=["humaneval", "chat"])
    args = p.parse_args(ours)
    model, extra = model_and_rest(server_args)
    server = specdec_server("specdec", model, extra, args.clients, None)
    if not server.wait():
        raise SystemExit(f"the server did not start: {server.error}")
    prompts = {w: [t.rstrip() for t in humaneval_prompts(32)] if w == "humaneval" else chat_prompts(16)
               for w in args.workloads}
    tally, failures, memory = Counter(), [], []
    done = threading.Event()

    def watch():
        start = time.monotonic()
        while not done.wait(1.0):
            memory.append((time.monotonic() - start, server.memory("VmRSS")))
            if len(memory) % 60 == 0:
                print(f"{len(memory) // 60} min: {dict(tally)}, resident {memory[-1][1] / 2 ** 30:.2f} GiB",
                      file=sys.stderr, flush=True)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    deadline = time.monotonic() + 60 * args.minutes

    async def everyone():
        await asyncio.gather(*(client(server.url, i, deadline, prompts, args.max_tokens, tally, failures)
                               for i in range(args.clients)))

    try:
        asyncio.run(everyone())
        time.sleep(2)
        healthy = httpx.get(server.url + "/health", timeout=10).status_code == 200
        end = server.memory("VmRSS")
    finally:
        done.set()
        watcher.join()
        server.stop()
    settled = [m for t, m in memory if t >= min(60, memory[-1][0] / 2)] or [end]
    half = [m for t, m in memory if t >= memory[-1][0] / 2] or [end]
    summary = {"minutes": args.minutes, "clients": args.clients, "server_args": server_args, **tally,
               "failures": Counter(failures).most_common(5), "healthy_after": healthy,
               "resident_gib": {"after_first_minute": round(settled[0] / 2 ** 30, 3),
                                "highest": round(max(m for _, m in memory) / 2 ** 30, 3) if memory else None,
                                "end": round(end / 2 ** 30, 3),
                                "second_half_growth": round((half[-1] - half[0]) / 2 ** 30, 3)}}
    print(json.dumps(summary))
    if tally["failed"] or not healthy:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
