"""`specdec serve` as a real process on 127.0.0.1 with real clients (the official `openai` client and
httpx): output equal to `specdec generate` (api.generate, what the command runs), streaming, stop
strings, seeds, 32 concurrent streams with different settings, and faults: bad requests, a
disconnect mid-stream, a flood beyond the queue (capacity = batch + queue), graceful shutdown (drain,
then errors for what is left, never a truncated answer), a second Ctrl-C, kill -9 and a restart,
a port in use.

Models: the tiny checkpoint of conftest.py as target and a noisy copy of it as the draft model (it
agrees with the target often, not always, so both accepted and rejected drafts occur).
"""
from __future__ import annotations

import asyncio
import json
import signal
import time

import httpx
import openai
import pytest

from specdec import api
from specdec.decoding.pipeline import TextStream
from specdec.lm.tokenizer import EOS_ID
from specdec.proposers import DraftModelProposer

from ..serve_helpers import HANG, Server, wait_until
from ..spec_helpers import NEAR_TIE, greedy_divergence

K = 3
PROMPTS = ["def f(x):", "import os\nimport sys\n", "class A:\n    ", "for i in range(10):"]


@pytest.fixture(scope="module")
def target(tiny_checkpoint):
    return api.load(tiny_checkpoint)


@pytest.fixture(scope="module")
def servers(tiny_checkpoint, draft_checkpoint, tmp_path_factory):
    logs = tmp_path_factory.mktemp("serve-logs")
    started = {"plain": Server("--model", str(tiny_checkpoint), "--max-batch", "8", log=logs / "plain.log"),
               "draft": Server("--model", str(tiny_checkpoint), "--draft", "draft-model", "--draft-model",
                               str(draft_checkpoint), "-k", str(K), "--max-batch", "8", log=logs / "draft.log")}
    yield started
    for server in started.values():
        assert server.stop(), server.log.read_text()


def offline(target, draft_checkpoint, method: str, prompt: str, **settings) -> api.Result:
    if method == "plain":
        return api.generate(target, prompt, **settings)
    proposer = DraftModelProposer(model=api.load_draft_model(target, draft_checkpoint).model)
    return api.generate(target, prompt, proposer=proposer, k=K, **settings)


def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def assert_greedy_equal(target, prompt: str, got: list[int], expected: list[int]) -> None:
    """Equal, or diverging only at a near-tie of the target (a batched forward may round differently)."""
    ids = [EOS_ID] + target.tokenizer.encode(prompt)
    gap = greedy_divergence(target.model, ids, got, expected)
    assert gap is None or gap < NEAR_TIE, f"{prompt!r}: {got} != {expected} (top-2 gap {gap})"


@pytest.mark.parametrize("method", ["plain", "draft"])
def test_greedy_completions_equal_specdec_generate(servers, target, draft_checkpoint, method):
    c = client(servers[method])
    assert [m.id for m in c.models.list().data] == ["tiny"]
    for prompt in PROMPTS:
        got = c.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0)
        want = offline(target, draft_checkpoint, method, prompt, max_new_tokens=24)
        figures = got.model_extra["specdec"]
        assert figures["token_ids"] == want.tokens[0]  # batch 1 on both sides: exactly equal
        assert got.choices[0].text == want.texts[0]
        assert got.choices[0].finish_reason == {"length": "length", "eos": "stop", "stop": "stop"}[want.finish_reasons[0]]
        assert got.usage.completion_tokens == len(want.tokens[0])
        assert got.usage.prompt_tokens == want.stats["prompt_tokens"][0]
        if method == "draft":
            assert figures["method"] == "draft-model" and figures["k"] == K and figures["proposed"] > 0
            assert figures["steps"] == want.stats["steps"] and figures["accepted"] == want.stats["accepted"]


def test_streaming_gives_the_same_text_with_draft_and_target_pieces(servers):
    c = client(servers["draft"])
    whole = c.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=40, temperature=0)
    chunks = list(c.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=40, temperature=0, stream=True,
                                       stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == whole.choices[0].text
    finals = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].usage.completion_tokens == 40
    pieces = [p for ch in chunks if ch.choices for p in ch.model_extra["specdec"]["pieces"]]
    assert "".join(t for t, _ in pieces) == text
    kinds = {kind for _, kind in pieces}
    assert kinds == {"draft", "target"}  # the noisy draft is accepted often, not always
    ids = [t for ch in chunks if ch.choices for t in ch.model_extra["specdec"]["token_ids"]]
    assert ids == whole.model_extra["specdec"]["token_ids"]


def test_stop_strings_cut_the_text_exactly(servers, target, draft_checkpoint):
    c = client(servers["draft"])
    full = offline(target, draft_checkpoint, "draft", PROMPTS[1], max_new_tokens=40).texts[0]
    stop = full[len(full) // 2:len(full) // 2 + 3]
    want = full[:full.index(stop)]
    got = c.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=40, temperature=0, stop=[stop])
    assert got.choices[0].text == want and got.choices[0].finish_reason == "stop"
    streamed = c.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=40, temperature=0, stop=stop,
                                    stream=True)
    assert "".join(ch.choices[0].text for ch in streamed) == want


@pytest.mark.parametrize("method", ["plain", "draft"])
def test_a_seed_makes_sampling_reproducible(servers, method):
    c = client(servers[method])
    settings = dict(model="tiny", prompt=PROMPTS[3], max_tokens=30, temperature=1.0, top_p=0.95)
    first = c.completions.create(seed=5, **settings).model_extra["specdec"]["token_ids"]
    assert c.completions.create(seed=5, **settings).model_extra["specdec"]["token_ids"] == first
    assert c.completions.create(seed=6, **settings).model_extra["specdec"]["token_ids"] != first


def concurrent_settings(i: int) -> dict:
    """32 requests: lengths 8..39, every second one greedy, the others sampled with various settings."""
    settings = {"prompt": PROMPTS[i % len(PROMPTS)] + " " * (i % 3 == 2), "max_tokens": 8 + i}
    if i % 2 == 0:
        return {**settings, "temperature": 0}
    return {**settings, "temperature": [0.7, 1.0, 1.3][i % 3], "top_p": [None, 0.9][i % 4 // 2], "seed": i,
            **({"extra_body": {"top_k": 20}} if i % 8 == 1 else {})}


def test_32_concurrent_streams_with_different_settings(servers, target, draft_checkpoint):
    async def one(c: openai.AsyncOpenAI, i: int):
        stream = await c.completions.create(model="tiny", stream=True, **concurrent_settings(i))
        text, ids, finish = "", [], None
        async for chunk in stream:
            text += chunk.choices[0].text
            ids += chunk.model_extra["specdec"]["token_ids"]
            finish = chunk.choices[0].finish_reason or finish
        return text, ids, finish

    async def all_of_them():
        async with openai.AsyncOpenAI(base_url=servers["draft"].url + "/v1", api_key="unused", max_retries=0,
                                      timeout=120) as c:
            return await asyncio.gather(*(one(c, i) for i in range(32)))

    results = asyncio.run(all_of_them())
    for i, (text, ids, finish) in enumerate(results):
        s = concurrent_settings(i)
        assert finish in ("length", "stop") and 0 < len(ids) <= s["max_tokens"]
        assert finish == "stop" or len(ids) == s["max_tokens"]
        if s["temperature"] == 0:
            want = offline(target, draft_checkpoint, "draft", s["prompt"], max_new_tokens=s["max_tokens"])
            assert_greedy_equal(target, s["prompt"], ids, want.tokens[0])
            if ids == want.tokens[0]:
                assert text == want.texts[0]
    assert servers["draft"].metric("specdec_batch_size") == 0


def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(servers):
    url = servers["draft"].url + "/v1/completions"
    cases = [
        (b"{not json", 400, None),
        (b"[1, 2]", 400, None),
        (json.dumps({"prompt": 5}).encode(), 400, "prompt"),
        (json.dumps({"prompt": "x", "temperature": "hot"}).encode(), 400, "temperature"),
        (json.dumps({"prompt": "x", "max_tokens": "5"}).encode(), 400, "max_tokens"),
        (json.dumps({"prompt": "x", "max_tokens": -1}).encode(), 400, "max_tokens"),
        (json.dumps({"prompt": "x", "top_p": 2}).encode(), 400, "top_p"),
        (json.dumps({"prompt": "x", "stop": [3]}).encode(), 400, "stop"),
        (json.dumps({"prompt": "x", "stream": "yes"}).encode(), 400, "stream"),
        (json.dumps({"prompt": "x", "n": 2}).encode(), 400, "n"),
        (json.dumps({"prompt": "x", "model": "gpt-4"}).encode(), 404, "model"),
        (json.dumps({"prompt": "word " * 300, "max_tokens": 10}).encode(), 400, "prompt"),  # context 256
    ]
    for body, status, param in cases:
        r = httpx.post(url, content=body, headers={"Content-Type": "application/json"})
        assert r.status_code == status, (body, r.text)
        error = r.json()["error"]
        assert error["message"] and error["type"] and error["param"] == param, (body, error)
    assert "context" in httpx.post(url, json={"prompt": "word " * 300}).json()["error"]["message"]
    with pytest.raises(openai.BadRequestError):
        client(servers["draft"]).completions.create(model="tiny", prompt="x", temperature=-1)
    assert httpx.get(servers["draft"].url + "/health").json()["status"] == "ok"
    nothing = client(servers["draft"]).completions.create(model="tiny", prompt="x", max_tokens=0)
    assert nothing.choices[0].text == "" and nothing.choices[0].finish_reason == "length"
    ok = client(servers["draft"]).completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=5, temperature=0)
    assert ok.usage.completion_tokens == 5


def test_a_disconnect_mid_stream_frees_the_row_and_others_are_unaffected(servers, target, draft_checkpoint):
    server = servers["draft"]
    cancelled = server.metric('specdec_requests_total{outcome="cancelled"}')
    want = offline(target, draft_checkpoint, "draft", PROMPTS[2], max_new_tokens=60)

    async def leaver():
        async with httpx.AsyncClient(timeout=60) as h:
            body = {"prompt": PROMPTS[0], "max_tokens": 200, "temperature": 0, "stream": True}
            async with h.stream("POST", server.url + "/v1/completions", json=body) as r:
                events = 0
                async for line in r.aiter_lines():
                    events += line.startswith("data: ")
                    if events == 3:
                        return events  # leaving the block closes the connection mid-stream

    async def stayer():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as c:
            got = await c.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=60, temperature=0)
        return got.model_extra["specdec"]["token_ids"]

    async def both():
        return await asyncio.gather(leaver(), stayer())

    events, ids = asyncio.run(both())
    assert events == 3
    assert_greedy_equal(target, PROMPTS[2], ids, want.tokens[0])
    # the row leaves at its next step, however long a loaded machine takes
    wait_until(lambda: server.metric("specdec_batch_size") == 0, "the disconnected row leaving the batch")
    assert server.metric('specdec_requests_total{outcome="cancelled"}') == cancelled + 1


def test_metrics_are_prometheus_text(servers):
    text = httpx.get(servers["draft"].url + "/metrics").text
    families = {line.split()[2]: line.split()[3] for line in text.splitlines() if line.startswith("# TYPE")}
    for name in ("specdec_requests_total", "specdec_generated_tokens_total", "specdec_steps_total",
                 "specdec_proposed_tokens_total", "specdec_accepted_tokens_total",
                 "specdec_accepted_per_position_total", "specdec_acceptance_per_position", "specdec_acceptance_rate",
                 "specdec_mean_acceptance_length", "specdec_queue_length", "specdec_batch_size", "specdec_engine_seconds_total",
                 "specdec_time_to_first_token_seconds", "specdec_inter_token_seconds", "specdec_request_seconds"):
        assert name in families, name
    assert families["specdec_time_to_first_token_seconds"] == "histogram"
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, sample = line.rsplit(" ", 1)
            float(sample)  # every sample is a number (NaN included)
    positions = [line for line in text.splitlines() if line.startswith("specdec_acceptance_per_position{")]
    assert len(positions) == K
    assert 0 < float(text.split("\nspecdec_acceptance_rate ")[1].split()[0]) < 1


def test_a_flood_beyond_the_queue_gets_429_and_the_accepted_requests_complete(tiny_checkpoint, tmp_path):
    server = Server("--model", str(tiny_checkpoint), "--max-batch", "1", "--max-queue", "2", log=tmp_path / "log")
    try:
        async def one(h: httpx.AsyncClient, i: int):
            r = await h.post(server.url + "/v1/completions",
                             json={"prompt": PROMPTS[i % 4], "max_tokens": 60, "temperature": 0})
            return r.status_code, r.json(), r.headers.get("retry-after")

        async def flood():
            async with httpx.AsyncClient(timeout=120) as h:
                return await asyncio.gather(*(one(h, i) for i in range(10)))

        results = asyncio.run(flood())
        codes = [code for code, _, _ in results]
        assert codes.count(200) == 3 and codes.count(429) == 7, codes  # room for batch 1 + queue 2, no more
        for code, body, retry in results:
            if code == 429:
                assert body["error"]["type"] == "rate_limit_error" and "queued" in body["error"]["message"]
                assert retry == "1"
            else:
                assert code == 200 and body["usage"]["completion_tokens"] == 60
        assert server.metric('specdec_requests_total{outcome="rejected"}') == codes.count(429)
        assert httpx.get(server.url + "/health").status_code == 200
    finally:
        assert server.stop(), server.log.read_text()


def test_graceful_shutdown_finishes_a_running_stream(tiny_checkpoint, tmp_path):
    server = Server("--model", str(tiny_checkpoint), log=tmp_path / "log")
    body = {"prompt": PROMPTS[0], "max_tokens": 150, "temperature": 0, "stream": True}
    finish, events = None, 0
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            events += 1
            if events == 2:
                server.proc.send_signal(signal.SIGTERM)
            finish = json.loads(line[6:])["choices"][0]["finish_reason"] or finish
    assert finish == "length"
    assert server.ended_cleanly(), server.log.read_text()
    with pytest.raises(httpx.TransportError):
        httpx.get(server.url + "/health", timeout=2)


def read_stream(url: str, body: dict, events: list, timeout: float = 120) -> str:
    """A stream's outcome: "complete" (a finish_reason, then [DONE]), "error" (an error event, then
    [DONE]) or "broken" (the connection failed); never a success without its end."""
    finish, error = None, None
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=timeout) as r:
            if r.status_code != 200:
                return "refused"
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    assert (finish is None) != (error is None)
                    return "complete" if finish else "error"
                if line.startswith("data: "):
                    chunk = json.loads(line[6:])
                    error = chunk.get("error") or error
                    finish = finish or (chunk["choices"][0]["finish_reason"] if chunk.get("choices") else None)
                    events.append(chunk)
    except httpx.TransportError:
        return "broken"
    return "truncated"  # ended without [DONE] and without a transport error: the bug this guards against


def whole_outcome(url: str, body: dict, max_tokens: int) -> str:
    try:
        r = httpx.post(url + "/v1/completions", json=body, timeout=120)
    except httpx.TransportError:
        return "broken"
    if r.status_code == 200:
        got = r.json()
        done = got["choices"][0]["finish_reason"] == "stop" or got["usage"]["completion_tokens"] == max_tokens
        return "complete" if done else "truncated"
    assert r.json()["error"]["message"]
    return "error"


LONG = {"prompt": PROMPTS[0], "max_tokens": 220, "temperature": 1.0, "seed": 1}


def test_sigterm_drains_then_ends_what_is_left_with_errors(tiny_checkpoint, tmp_path):
    # 40 requests of 220 tokens one at a time: 8,800 steps, seconds even on a fast host (which did 660 steps
    # in 0.5 s), so work is left when the 1 s of grace ends; that second leaves room for the two checks
    # made while draining (0.1 s did not on a loaded machine: the server had closed before the second)
    server = Server("--model", str(tiny_checkpoint), "--max-batch", "1", "--shutdown-timeout", "1",
                    "--threads", "1", log=tmp_path / "log")
    import concurrent.futures
    with concurrent.futures.ThreadPoolExecutor(40) as pool:
        events = [[] for _ in range(8)]
        streams = [pool.submit(read_stream, server.url, {**LONG, "stream": True, "seed": i}, events[i])
                   for i in range(8)]
        wholes = [pool.submit(whole_outcome, server.url, {**LONG, "seed": 10 + i}, LONG["max_tokens"])
                  for i in range(32)]
        # all admitted; counted with those already finished
        wait_until(lambda: server.admitted() >= 40, "40 requests admitted")
        server.proc.send_signal(signal.SIGTERM)
        health = httpx.get(server.url + "/health", timeout=5)  # draining: observable, and no admission
        assert health.status_code == 503 and health.json()["status"] == "closing"
        refused = httpx.post(server.url + "/v1/completions", json={"prompt": "x"}, timeout=5)
        assert refused.status_code == 503 and refused.headers["retry-after"] and refused.json()["error"]
        outcomes = [f.result() for f in streams + wholes]
    assert set(outcomes) <= {"complete", "error"}, outcomes
    assert "error" in outcomes
    assert server.ended_cleanly(), server.log.read_text()
    assert "shutting down" in server.log.read_text()


def test_a_second_sigint_exits_at_once(tiny_checkpoint, tmp_path):
    server = Server("--model", str(tiny_checkpoint), "--shutdown-timeout", "600", "--max-batch", "1",
                    log=tmp_path / "log")
    import concurrent.futures
    with concurrent.futures.ThreadPoolExecutor(12) as pool:  # 2,650 steps queued: seconds even on a fast host
        events: list = []
        outcome = pool.submit(read_stream, server.url, {**LONG, "max_tokens": 230, "stream": True}, events)
        queued = [pool.submit(whole_outcome, server.url, LONG, LONG["max_tokens"]) for _ in range(11)]
        # all 12 admitted before the first SIGINT (a request that arrives while draining is refused, an
        # "error" outcome: on a loaded machine the stream's first event came before the last request)
        wait_until(lambda: events and server.admitted() >= 12, "the stream's first event, 12 requests admitted")
        server.proc.send_signal(signal.SIGINT)
        wait_until(lambda: "shutting down" in server.log.read_text(), "draining after the first SIGINT")
        started = time.monotonic()
        server.proc.send_signal(signal.SIGINT)
        # at once: not after the 600 s the drain allows (nor the minutes the queued requests need)
        assert server.proc.wait(HANG) == 130 and time.monotonic() - started < 60
        assert outcome.result() in ("complete", "broken") and {q.result() for q in queued} <= {"complete", "broken"}
    assert "exiting at once" in server.log.read_text() and "Traceback" not in server.log.read_text()


def test_kill_9_mid_load_then_restart(tiny_checkpoint, tmp_path):
    """Every client of a server killed with SIGKILL saw a complete answer or an error, never a
    truncated success; the restarted server on the same port serves again."""
    server = Server("--model", str(tiny_checkpoint), "--max-batch", "4", log=tmp_path / "log")
    import concurrent.futures
    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        events = [[] for _ in range(6)]
        streams = [pool.submit(read_stream, server.url, {**LONG, "stream": True, "seed": i}, events[i])
                   for i in range(6)]
        wholes = [pool.submit(whole_outcome, server.url, {**LONG, "seed": 10 + i}, LONG["max_tokens"])
                  for i in range(6)]
        wait_until(lambda: sum(map(len, events)) >= 10, "10 streamed events")
        server.proc.kill()
        outcomes = [f.result() for f in streams + wholes]
    assert set(outcomes) <= {"complete", "broken"} and "broken" in outcomes, outcomes
    server.proc.wait(10)
    again = Server("--model", str(tiny_checkpoint), "--port", str(server.port), log=tmp_path / "log2")
    try:
        assert again.url == server.url
        assert whole_outcome(again.url, {**LONG, "max_tokens": 20}, 20) == "complete"
    finally:
        assert again.stop(), again.log.read_text()


def test_a_port_in_use_is_one_line_before_any_banner(tiny_checkpoint, tmp_path):
    import socket
    import subprocess
    import sys
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "specdec.cli", "serve", "--model", str(tiny_checkpoint),
                               "--port", str(port)], capture_output=True, text=True, timeout=60,
                              env=Server.environment())
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        f"specdec: error: cannot listen on 127.0.0.1:{port}: Address already in use; choose another --port or --host"]


def test_text_stream_holds_back_what_could_start_a_stop_string():
    decode = lambda ids: "".join(map(chr, ids))  # one character per token
    stream = TextStream(decode, ("END",))
    assert stream.add([ord(c) for c in "abE"], 2) == [("ab", "draft")]  # "E" may start "END"
    assert stream.add([ord("x")], 0) == [("Ex", "target")]              # it did not
    assert stream.add([ord(c) for c in "EN"], 1) == []
    assert stream.add([ord("D")], 0, final="abEx") == []           # the stop cut it: nothing more
    healed = TextStream(decode, (), skip_chars=2)
    assert healed.add([ord(c) for c in "  if"], 1) == [("if", "target")]


def test_a_served_model_name_oversubscribed_threads_and_auto_k_said_at_startup(tiny_checkpoint, tmp_path):
    """--served-model-name is the name /v1/models lists and requests give; --threads above the
    cores is allowed and said once; -k auto measures the verify cost before the server listens,
    saying so once."""
    import os
    from pathlib import Path
    cores = len(os.sched_getaffinity(0))
    cache = tmp_path / "cache" / "specdec"  # no verify curve measured before; the kernels as built
    cache.mkdir(parents=True)
    built = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "specdec" / "kernels"
    (cache / "kernels").symlink_to(built)
    server = Server("--model", str(tiny_checkpoint), "--served-model-name", "my-model", "--draft", "ngram",
                    "--max-batch", "2", "--threads", str(cores + 1), log=tmp_path / "log",
                    env={"XDG_CACHE_HOME": str(tmp_path / "cache")})
    try:
        assert [m["id"] for m in httpx.get(server.url + "/v1/models").json()["data"]] == ["my-model"]
        done = httpx.post(server.url + "/v1/completions", json={"model": "my-model", "prompt": "def", "max_tokens": 4})
        assert done.status_code == 200 and done.json()["model"] == "my-model"
        assert httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "def"}).status_code == 404
    finally:
        assert server.stop(), server.log.read_text()
    log = server.log.read_text()
    assert log.count(f"warning: {cores + 1} threads are more than the {cores} cores") == 1
    assert log.count("measuring this machine's verify cost for my-model, once") == 1
    assert log.index("measuring this machine's verify cost") < log.index("specdec serve: my-model (")
