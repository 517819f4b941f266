"""specdec serve against llama.cpp's llama-server on the same GGUF files, under load.

Every configured server starts once (specdec plain and with a draft; llama-server plain and with its
speculative types, where its build is given), each on its own port, and they stay up while only one
at a time is driven. For each workload and concurrency c, every server in turn answers the same wave
of requests from c streaming clients (each takes the next request when its last one ends); repeats
interleave the servers (in turn, the order reversed every other wave), so a disturbance of the machine
hits one repeat of each, not one server. The ratios the bars are about (drafting over plain, specdec over
llama-server) are each the median of the waves' own ratios (`ratios`).

Workloads: HumanEval completions (/v1/completions, greedy, trailing whitespace stripped so that no
server heals a token) and chat (/v1/chat/completions, specdec's own everyday questions, temperature 0.8
with a seed per request). Per cell: aggregate completion tokens/s over the wave (tokens as each server
counts them in `usage`), p50/p95 request latency and time to first token, failed requests, the servers'
resident memory idle and at peak; for specdec's servers, each wave's engine counters (target forwards,
drafts proposed and accepted: a drafting server that drafted nothing served plainly). Conditions: the
files, each server's command line, any server that failed to start and why, the CPU. By default every
wave repeats the same prompts and no server keeps a prompt's cache for a later request (--prompt-cache
keeps them: a repeated prompt is then not prefilled again, and the figures say more about the caches
than about decoding); --fresh-prompts gives each wave prompts no server has answered (a drafter's memory
of earlier answers cannot copy them).

    python benchmarks/serve_head_to_head.py --model qwen2.5-coder-1.5b --draft-model qwen2.5-coder-0.5b \
        --llama-server LLAMA_BUILD/bin/llama-server --out docs/evidence/serve-head-to-head [-- --draft-vocab auto]

Arguments after `--` go to specdec's drafting server (its drafter's options).

The smoke test (tests/test_benchmarks.py) runs it on the toy target with specdec's servers alone.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from specdec.bench.conditions import hardware, software
from specdec.bench.workloads import CHAT_PROMPTS, humaneval_prompts
from specdec.lm.packaged import resolve

WORKLOADS = {"humaneval": "HumanEval completions, greedy", "chat": "everyday chat, temperature 0.8, seeded"}
PROMPT_CACHE = {False: "off: specdec serve --prefix-cache 0, llama-server requests with cache_prompt false (every "
                       "prompt prefilled; requests running together may still share specdec's prompt blocks)",
                True: "on: each server's own (the waves repeat the same prompts: a cached prompt is not prefilled)"}


class Waves:
    """The prompts of each wave: the first `n` of the workload's pool every time, or with `fresh` the next
    `n` (round the pool again when it runs out, counted in `repeated`)."""

    def __init__(self, pools: dict[str, list[str]], n: int, fresh: bool):
        self.pools, self.n, self.fresh = pools, n, fresh
        self.at = {workload: 0 for workload in pools}
        self.repeated = 0

    def next(self, workload: str) -> list[str]:
        pool = self.pools[workload]
        if len(pool) < self.n:
            raise SystemExit(f"the {workload} workload has {len(pool)} prompts, not {self.n}")
        if not self.fresh:
            return pool[:self.n]
        start = self.at[workload]
        self.at[workload] += self.n
        self.repeated += sum(i >= len(pool) for i in range(start, start + self.n))
        return [pool[i % len(pool)] for i in range(start, start + self.n)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One server process on its own port; `rss` and `peak` read its resident memory (bytes)."""

    def __init__(self, name: str, argv: list[str], port: int, health: str):
        self.name, self.argv, self.port, self.health = name, argv, port, health
        self.url = f"http://127.0.0.1:{port}"
        self.log = open(os.devnull if not os.environ.get("SERVE_H2H_LOGS") else f"/tmp/{name}.log", "w")
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT)
        self.error: str | None = None

    def wait(self, timeout: float = 900) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.error = f"exited with status {self.proc.returncode} before answering"
                return False
            try:
                if httpx.get(self.url + self.health, timeout=2).status_code == 200:
                    return True
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        self.error = f"did not answer {self.health} within {timeout:.0f} s"
        return False

    def memory(self, field: str) -> int | None:
        try:
            with open(f"/proc/{self.proc.pid}/status") as f:
                for line in f:
                    if line.startswith(field + ":"):
                        return int(line.split()[1]) * 1024
        except OSError:
            return None
        return None

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def split_at_dashes(argv: list[str]) -> tuple[list[str], list[str]]:
    """A script's own arguments, then those after `--` (for `specdec serve`)."""
    return (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])


def model_and_rest(server_args: list[str]) -> tuple[str, list[str]]:
    """`specdec serve` arguments split into --model's value and the others."""
    if "--model" not in server_args:
        raise SystemExit("give the server's --model after --")
    at = server_args.index("--model")
    return server_args[at + 1], server_args[:at] + server_args[at + 2:]


def specdec_server(name: str, model: str, extra: list[str], concurrency: int, budget: str | None,
                   prompt_cache: bool = True) -> Server:
    port = free_port()
    argv = [sys.executable, "-m", "specdec.cli", "serve", "--model", model, "--port", str(port),
            "--max-batch", str(concurrency), "--max-queue", str(4 * concurrency), *extra]
    argv += ["--kv-budget", budget] if budget else []
    argv += [] if prompt_cache else ["--prefix-cache", "0"]
    return Server(name, argv, port, "/health")


def llama_server(name: str, binary: str, model: str, extra: list[str], concurrency: int, context: int,
                 threads: int) -> Server:
    port = free_port()
    argv = [binary, "-m", model, "--port", str(port), "-t", str(threads), "-np", str(concurrency),
            "-c", str(context * concurrency), *extra]
    if "amx_tile" in open("/proc/cpuinfo").read():  # its repacking path crashes on AMX hosts (SIGSEGV)
        argv.append("--no-repack")
    return Server(name, argv, port, "/health")


def request_body(workload: str, prompt: str, index: int, max_tokens: int, peer: bool = False,
                 prompt_cache: bool = True) -> tuple[str, dict]:
    """The request for prompt `index` of a wave; to llama-server (`peer`) without its prompt cache where
    `prompt_cache` is off (specdec's server is started without one then)."""
    common = {"max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True}}
    if peer and not prompt_cache:
        common["cache_prompt"] = False
    if workload == "humaneval":
        return "/v1/completions", {"prompt": prompt, "temperature": 0, **common}
    return "/v1/chat/completions", {"messages": [{"role": "user", "content": prompt}], "temperature": 0.8,
                                    "seed": 1000 + index, **common}


async def wave(server: Server, workload: str, prompts: list[str], max_tokens: int, concurrency: int,
               prompt_cache: bool) -> dict:
    """Every prompt once, `concurrency` clients at a time; the wave's figures."""
    todo = list(enumerate(prompts))
    latency, ttft, failures = [], [], []
    tokens = 0

    async def one(client: httpx.AsyncClient, index: int, prompt: str) -> None:
        nonlocal tokens
        path, body = request_body(workload, prompt, index, max_tokens, not server.name.startswith("specdec"),
                                  prompt_cache)
        sent, first, usage, chunks = time.perf_counter(), None, None, 0
        try:
            async with client.stream("POST", server.url + path, json=body) as r:
                if r.status_code != 200:
                    failures.append(f"HTTP {r.status_code}")
                    return
                async for line in r.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    event = json.loads(line[6:])
                    usage = event.get("usage") or usage
                    for choice in event.get("choices") or []:
                        text = choice.get("text") or (choice.get("delta") or {}).get("content")
                        if text:
                            chunks += 1
                            first = first or time.perf_counter()
        except (httpx.HTTPError, json.JSONDecodeError) as e:
            failures.append(type(e).__name__)
            return
        latency.append(time.perf_counter() - sent)
        if first is not None:
            ttft.append(first - sent)
        tokens += usage["completion_tokens"] if usage else chunks

    async def client_loop(client: httpx.AsyncClient) -> None:
        while todo:
            index, prompt = todo.pop(0)
            await one(client, index, prompt)

    # a connection per request, for every server alike: a kept-alive connection the server has closed
    # (llama-server does between requests) would fail the next request before it is sent
    async with httpx.AsyncClient(timeout=httpx.Timeout(900, connect=30),
                                 limits=httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=0)
                                 ) as client:
        before = await engine_counters(client, server)
        start = time.perf_counter()
        await asyncio.gather(*(client_loop(client) for _ in range(concurrency)))
        seconds = time.perf_counter() - start
        after = await engine_counters(client, server)
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds, "failures": failures,
            "engine": {name: after[name] - before[name] for name in after},
            "latency_p50_s": percentile(latency, 50), "latency_p95_s": percentile(latency, 95),
            "ttft_p50_s": percentile(ttft, 50), "ttft_p95_s": percentile(ttft, 95)}


ENGINE_COUNTERS = ("specdec_steps_total", "specdec_proposed_tokens_total", "specdec_accepted_tokens_total")


async def engine_counters(client: httpx.AsyncClient, server: Server) -> dict[str, float]:
    """specdec's engine counters from its /metrics (target forwards, drafts proposed and accepted), so a
    wave says whether its server drafted at all; {} for a peer."""
    if not server.name.startswith("specdec"):
        return {}
    text = (await client.get(server.url + "/metrics")).text
    return {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
            if line.split(" ", 1)[0] in ENGINE_COUNTERS}


def percentile(values: list[float], q: float) -> float | None:
    """The nearest-rank q-th percentile (None without values)."""
    if not values:
        return None
    ranked = sorted(values)
    return ranked[min(len(ranked) - 1, max(math.ceil(q / 100 * len(ranked)) - 1, 0))]


class PeakWatch:
    """Samples every server's resident memory while the waves run (VmHWM misses nothing, but an
    idle figure needs VmRSS before the first request)."""

    def __init__(self, servers: list[Server]):
        self.servers, self.peak = servers, {s.name: 0 for s in servers}
        self.done = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        while not self.done.wait(0.2):
            for s in self.servers:
                self.peak[s.name] = max(self.peak[s.name], s.memory("VmRSS") or 0)

    def stop(self) -> dict:
        self.done.set()
        self.thread.join()
        return self.peak


def run(args) -> dict:
    model = str(resolve(args.model))
    draft = str(resolve(args.draft_model)) if args.draft_model else None
    top = max(args.concurrency)
    specdec = {"specdec plain": ["--quantize", "gguf"] if model.endswith(".gguf") else []}
    if draft:
        specdec[f"specdec {args.draft}"] = (specdec["specdec plain"] + ["--draft", args.draft, "--draft-model", draft]
                                            + args.draft_options)
    servers = [specdec_server(name, model, extra, top, args.kv_budget, args.prompt_cache)
               for name, extra in specdec.items()]
    if args.llama_server:
        peers = {"plain": [], "ngram-mod": ["--spec-type", "ngram-mod"],
                 "draft": ["-md", draft, "--spec-type", "draft-simple"] if draft else None}
        servers += [llama_server(f"llama-server {name}", args.llama_server, model, peers[name], top, args.context,
                                 args.threads) for name in args.peers if peers[name] is not None]
    up, failed = [], {}
    for s in servers:
        if s.wait():
            up.append(s)
        else:
            failed[s.name] = s.error
            s.stop()
    idle = {s.name: s.memory("VmRSS") for s in up}
    pools = {"humaneval": [p.rstrip() for p in humaneval_prompts()], "chat": list(CHAT_PROMPTS)}
    waves = Waves(pools, args.prompts, args.fresh_prompts)
    cells = []
    watch = PeakWatch(up)
    try:
        for s in up:  # warm-up: first-use costs (kernels, the allocator, verify curves) are not timed
            asyncio.run(wave(s, "humaneval", pools["humaneval"][-2:], 8, 2, args.prompt_cache))
        for workload in args.workloads:
            for c in args.concurrency:
                runs = {s.name: [] for s in up}
                for repeat in range(args.repeats):
                    prompts = waves.next(workload)  # every server answers the same wave, in turn
                    for s in up if repeat % 2 == 0 else up[::-1]:  # first and last alternate (a drift evens out)
                        runs[s.name].append(asyncio.run(wave(s, workload, prompts, args.max_tokens, c,
                                                             args.prompt_cache)))
                for s in up:
                    median = sorted(runs[s.name], key=lambda r: r["tokens_per_s"])[len(runs[s.name]) // 2]
                    cells.append({"server": s.name, "workload": workload, "concurrency": c, **median,
                                  "repeats_tokens_per_s": [r["tokens_per_s"] for r in runs[s.name]],
                                  "failed_requests": sum(len(r["failures"]) for r in runs[s.name])})
                    spread = ", ".join(f"{r['tokens_per_s']:.1f}" for r in runs[s.name])
                    print(f"{workload} c={c} {s.name}: {median['tokens_per_s']:.1f} tok/s ({spread}), "
                          f"{cells[-1]['failed_requests']} failed", file=sys.stderr, flush=True)
    finally:
        peak = watch.stop()
        for s in up:
            s.stop()
    files = {"model": model, "draft_model": draft}
    return {"cells": cells, "ratios": ratios(cells), "conditions": {
        "files": {k: v and {"path": Path(v).name, "bytes": Path(v).stat().st_size} for k, v in files.items()},
        "servers": {s.name: [Path(a).name if a in (model, draft, sys.executable, args.llama_server) else a for a in s.argv]
                    for s in servers},
        "failed_to_start": failed, "workloads": {w: WORKLOADS[w] for w in args.workloads},
        "prompts_per_wave": args.prompts, "max_tokens": args.max_tokens, "repeats": args.repeats,
        "prompt_cache": PROMPT_CACHE[args.prompt_cache],
        "prompts": ("fresh: each wave the next prompts of its workload, every server the same wave; prompts a server "
                    f"had answered before: {waves.repeated}" if args.fresh_prompts else
                    "the same prompts every wave (a drafter's memory of earlier answers, such as suffix lookup's, "
                    "can copy them from the second wave on)"),
        "resident_bytes": {name: {"idle": idle[name], "peak": peak[name]} for name in idle},
        "client": "httpx streaming clients in this process, same machine; one server driven at a time",
        "hardware": hardware(), "software": software()}}


def ratios(cells: list[dict]) -> list[dict]:
    """Per workload and concurrency, the ratios the bars are about: specdec drafting over specdec plain,
    and specdec's best over llama-server's best (best: the highest median). Each is the median over the
    waves of one wave's ratio: both servers answered the same prompts, one right after the other, so
    the host's drifts (its memory's speed moves within minutes) and the prompts' lengths cancel."""
    def speed(cell: dict) -> float:
        return cell["tokens_per_s"]

    def paired(a: dict, b: dict) -> float:
        return statistics.median(x / y for x, y in zip(a["repeats_tokens_per_s"], b["repeats_tokens_per_s"]))

    rows = []
    for workload, level in dict.fromkeys((c["workload"], c["concurrency"]) for c in cells):
        here = [c for c in cells if (c["workload"], c["concurrency"]) == (workload, level)]
        ours = [c for c in here if c["server"].startswith("specdec")]
        peers = [c for c in here if c not in ours]
        plain = [c for c in ours if c["server"] == "specdec plain"]
        row = {"workload": workload, "concurrency": level}
        for drafting in (c for c in ours if plain and c is not plain[0]):
            row[f"{drafting['server']} / specdec plain"] = paired(drafting, plain[0])
        if ours and peers:
            best, peer = max(ours, key=speed), max(peers, key=speed)
            row["specdec best / llama-server best"] = paired(best, peer)
            row["best"] = [best["server"], peer["server"]]
        rows.append(row)
    return rows


def table(result: dict) -> str:
    servers = list(dict.fromkeys(c["server"] for c in result["cells"]))
    lines = []
    for workload in dict.fromkeys(c["workload"] for c in result["cells"]):
        cells = [c for c in result["cells"] if c["workload"] == workload]
        levels = sorted({c["concurrency"] for c in cells})
        lines += [f"\n{result['conditions']['workloads'][workload]}: aggregate tokens/s (p50 latency s, "
                  "p50 time to first token s, failed)", "",
                  "| server | " + " | ".join(f"c={c}" for c in levels) + " |", "|---|" + "---|" * len(levels)]
        for name in servers:
            row = []
            for level in levels:
                c = next((c for c in cells if c["server"] == name and c["concurrency"] == level), None)
                row.append("–" if c is None else
                           f"{c['tokens_per_s']:.1f} ({fmt(c['latency_p50_s'])}, {fmt(c['ttft_p50_s'])}, "
                           f"{c['failed_requests']})")
            lines.append(f"| {name} | " + " | ".join(row) + " |")
        rows = sorted((r for r in result["ratios"] if r["workload"] == workload), key=lambda r: r["concurrency"])
        for key in dict.fromkeys(k for r in rows for k in r if " / " in k):
            lines.append(f"| {key}, median of the waves' ratios | "
                         + " | ".join(f"{r[key]:.2f}x" if key in r else "–" for r in rows) + " |")
    return "\n".join(lines)


def fmt(x: float | None) -> str:
    return "–" if x is None else f"{x:.2f}"


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(c["workload"] for c in result["cells"]))
    fig, axes = plt.subplots(1, len(workloads), figsize=(6 * len(workloads), 4), squeeze=False)
    for ax, workload in zip(axes[0], workloads):
        cells = [c for c in result["cells"] if c["workload"] == workload]
        for name in dict.fromkeys(c["server"] for c in cells):
            mine = sorted((c["concurrency"], c["tokens_per_s"]) for c in cells if c["server"] == name)
            ax.plot([c for c, _ in mine], [t for _, t in mine], marker="o", label=name,
                    linestyle="-" if name.startswith("specdec") else "--")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel("aggregate completion tokens/s")
        ax.set_title(result["conditions"]["workloads"][workload])
        ax.legend(fontsize=8)
    fig.suptitle(f"{result['conditions']['files']['model']['path']} on {result['conditions']['hardware']['cpu']}",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a GGUF file or a packaged model's name (specdec pair list)")
    p.add_argument("--draft-model", help="the draft model's GGUF file or name (specdec's draft and llama-server's -md)")
    p.add_argument("--draft", default="hybrid", help="specdec's --draft with the draft model (default hybrid)")
    p.add_argument("--llama-server", help="llama.cpp's llama-server binary (built natively); absent: specdec alone")
    p.add_argument("--peers", nargs="+", choices=("plain", "ngram-mod", "draft"), default=["plain", "ngram-mod", "draft"],
                   help="llama-server's configurations: plain, --spec-type ngram-mod, -md DRAFT (draft-simple)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8, 16])
    p.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    p.add_argument("--prompts", type=int, default=16, help="requests per wave (default 16)")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--repeats", type=int, default=3, help="interleaved waves per cell; the median is kept")
    p.add_argument("--context", type=int, default=1024, help="llama-server's positions per slot (its -c / -np)")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="llama-server's -t")
    p.add_argument("--kv-budget", help="specdec serve's --kv-budget (default its own)")
    p.add_argument("--fresh-prompts", action="store_true",
                   help="each wave the next --prompts prompts of its workload (every server the same wave), so that "
                        "no server has answered a wave's prompts before (default: the first --prompts every wave)")
    p.add_argument("--prompt-cache", action="store_true",
                   help="keep the servers' prompt caches across requests (every wave repeats the same prompts, so "
                        "a cached prompt is not prefilled again); default off: each request's prompt is prefilled")
    p.add_argument("--out", help="a folder for head-to-head.json, .txt (the tables) and .png")
    given = argv if argv is not None else sys.argv[1:]
    ours, draft_options = split_at_dashes(given)
    args = p.parse_args(ours)
    args.draft_options = draft_options
    result = run(args)
    result["command"] = ["python", "benchmarks/serve_head_to_head.py",  # the peer's build folder by its role, not its path
                         *("LLAMA_BUILD/bin/llama-server" if a == args.llama_server else a for a in given)]
    text = table(result)
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "head-to-head.json").write_text(json.dumps(result, indent=1))
        (out / "head-to-head.txt").write_text(text + "\n")  # not .md: the folder may lie inside the docs site
        plot(result, out / "head-to-head.png")
    print(json.dumps({"cells": len(result["cells"]), "failed_to_start": result["conditions"]["failed_to_start"],
                      "median_tokens_per_s": statistics.median(c["tokens_per_s"] for c in result["cells"])
                      if result["cells"] else None}))


if __name__ == "__main__":
    main()
