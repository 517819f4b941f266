"""The engine behind the server: the main thread owns the model and runs the step loop (`run`);
HTTP handlers, on uvicorn's thread, hand it jobs through a bounded queue and read their tokens
back as events.

Why the main thread: the CPU kernels run each forward in an OpenMP region whose threads meet at a
barrier in every layer. OpenMP keeps one thread team per thread that ever started a region; the
main thread has one (loading the model starts regions), and a second team on another thread makes
more OpenMP threads than cores, so libgomp stops spinning at barriers and sleeps instead, and a
forward run from a second thread is much slower (docs/evidence/behind-the-code.md).

A job takes the one request path (decoding/pipeline.py), as `specdec generate` and the API do:
its prompt encoded by the checkpoint's rules (its prefix, special-token text as text unless the
request asks otherwise, chat messages through its chat template), the one context rule, a prompt
ending in whitespace token-healed (its first token restricted to those that extend the text)
unless the request says "heal": false, its own stop rule and text stream. So greedy output over
HTTP equals the command's. Encoding runs on a worker thread, never on the handlers' loop or the
engine's thread, and is bounded: a prompt longer than the context times the longest token is
refused without being encoded.

Admission: at most max_batch + max_queue jobs are in the server at once (running, queued or being
encoded); more get QueueFull (429).

Events reach the handler's asyncio loop through `call_soon_threadsafe`; a handler that goes away
sets `cancelled`, and the engine drops the row at its next step. `begin_close` stops admission;
running and queued jobs go on until `shutdown_timeout` has passed, then every job still open ends
with a final event whose finish_reason is "shutdown" (the handler turns it into an error), and
`run` returns.
"""
from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from ..api import Loaded
from ..decoding.engine import Engine, Request
from ..decoding import pipeline
from ..errors import SpecdecError
from ..lm.device import trim_heap
from ..lm.kv_cache import BLOCK
from .prometheus import Metrics
from .requests import Params


class QueueFull(SpecdecError):
    """More jobs wait than the queue holds (HTTP 429)."""


class Closing(SpecdecError):
    """The server is shutting down (HTTP 503)."""


class NoChat(SpecdecError):
    """The model has no chat template (HTTP 400)."""


@dataclass(frozen=True)
class Event:
    pieces: list[tuple[str, str]]  # (text, "draft" | "target")
    tokens: list[int]              # the step's token ids
    finish_reason: str | None      # set on the last event: "eos" | "stop" | "length" | "error" | "shutdown"
    steps: int                     # the request's counters after this step
    proposed: int
    accepted: int


def merged(events: list[Event]) -> Event:
    """Consecutive events of one job as one (a handler that fell behind sends them in one chunk)."""
    last = events[-1]
    return Event([p for e in events for p in e.pieces], [t for e in events for t in e.tokens], last.finish_reason,
                 last.steps, last.proposed, last.accepted)


@dataclass(eq=False)
class Job:
    params: Params
    prompt: pipeline.Prompt | None = None  # the encoded prompt (its last token backed off when healing; its constraint)
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    request: Request | None = None
    cancelled: bool = False
    ended: bool = False            # its final event is sent
    queued_at: float = field(default_factory=time.perf_counter)

    def cancel(self) -> None:
        self.cancelled = True
        if self.request is not None:
            self.request.cancelled = True

    async def next_event(self) -> Event:
        """The next event, merged with any that queued up behind it."""
        events = [await self.events.get()]
        while not self.events.empty():
            events.append(self.events.get_nowait())
        return events[0] if len(events) == 1 else merged(events)


class Service:
    def __init__(self, target: Loaded, proposer, k: int | str, method: str, capacity: int = 16, max_queue: int = 64,
                 name: str | None = None, widths: tuple[int, ...] | None = None, kv_tokens: int | None = None,
                 kv_dtype: torch.dtype | None = torch.bfloat16, prefix_cache: int | None = None,
                 shutdown_timeout: float = 30.0):
        """proposer None (k = 0): plain decoding. kv_tokens: the positions the target's KV cache holds
        (None: every row's whole context; lifecycle.serve gives the server's budget); kv_dtype: its keys'
        and values'; prefix_cache: positions of prompt blocks kept after their rows leave, for later
        requests that begin alike (None: the pool's default, KEEP_IDLE; 0: prompts are shared among
        running rows only). shutdown_timeout: the seconds open jobs may go on once closing begins."""
        self.target, self.method, self.k, self.shutdown_timeout = target, method, k, shutdown_timeout
        self.name = name or target.name
        self.context = target.admitted.context
        self.engine = Engine(target.admitted, proposer, k, capacity, self.context, widths=widths, name=self.name,
                             kv_dtype=kv_dtype, kv_tokens=kv_tokens)
        pool = self.engine.cache.pool
        if pool is not None and prefix_cache is not None:
            pool.keep_idle = prefix_cache // BLOCK
        self.capacity, self.max_queue = capacity, max_queue
        self.jobs: set[Job] = set()  # admitted and not yet finished by their handler (batch + queue at most)
        longest = max(len(b) for b in target.tokenizer.token_bytes if b is not None)
        self.max_prompt_chars = self.context * longest  # a longer prompt cannot fit the context
        self.chat = target.tokenizer.has_chat_template  # a folder's template is loaded by the first chat request
        self.encoding = threading.BoundedSemaphore(2)  # prompts encoded at once
        self.intake: deque[Job] = deque()  # jobs not yet healed and submitted (this thread reads them)
        self.loop: asyncio.AbstractEventLoop | None = None  # the handlers' loop
        self.outbox: list[tuple[Job, Event]] = []  # events of the current step, handed over at once
        self.wake = threading.Condition()
        self.closing = False
        self.deadline = float("inf")  # when a closing server ends the jobs still open (time.monotonic)
        self.failure: str | None = None  # why the engine loop stopped, if it failed
        self.stopped = threading.Event()  # the engine loop has returned
        self.requests = {"ok": 0, "cancelled": 0, "rejected": 0, "invalid": 0, "shutdown": 0}
        self.prompt_tokens = 0
        self.metrics = Metrics(self)

    # ---- the handler side (asyncio thread) ----

    def admit(self, params: Params) -> Job:
        """A slot for a new job (handlers' loop), or QueueFull / Closing."""
        if self.closing or self.failure:
            raise Closing(f"the server is {'shutting down' if self.closing else 'broken: ' + self.failure}; "
                          "retry on another instance")
        if params.messages is not None and not self.chat:
            raise NoChat(f"the model {self.name} has no chat template (no \"chat_template\" in its "
                         "tokenizer_config.json, no chat_template.jinja): send a plain prompt to /v1/completions")
        if len(self.jobs) >= self.capacity + self.max_queue:
            self.requests["rejected"] += 1
            raise QueueFull(f"{self.capacity} requests are running and {self.max_queue} queued, as many as this "
                            "server takes (--max-batch, --max-queue); retry later")
        self.loop = asyncio.get_running_loop()
        job = Job(params)
        self.jobs.add(job)
        return job

    def encode(self, job: Job) -> None:
        """The job's prompt (a worker thread; decoding/pipeline.py), refused when it and max_tokens do
        not fit the context."""
        p = job.params
        if p.messages is None and len(p.prompt) > self.max_prompt_chars:
            raise SpecdecError(f"the prompt has {len(p.prompt)} characters, more than the model's context of "
                               f"{self.context} tokens can hold. Shorten the prompt")
        with self.encoding:
            job.prompt = pipeline.prepare(self.target.tokenizer, self.context, p.options, p.prompt,
                                          None if p.messages is None else list(p.messages), budget="max_tokens",
                                          vocab=self.target.admitted.model.config.vocab_size)
        self.engine.check_memory(job.prompt.length, p.options.max_new_tokens, "max_tokens")

    def submit(self, job: Job) -> None:
        """Hand an encoded job to the engine (handlers' loop)."""
        if self.closing:
            raise Closing("the server is shutting down; retry on another instance")
        self.prompt_tokens += job.prompt.length
        with self.wake:
            self.intake.append(job)
            self.wake.notify()

    def finished(self, job: Job, first_at: float | None, tokens: int, ended: bool) -> None:
        """A handler is done with a job: count it and its latencies."""
        now = time.perf_counter()
        self.jobs.discard(job)
        if not job.ended:
            job.cancel()
        self.requests["ok" if ended else "shutdown" if job.ended else "cancelled"] += 1
        self.metrics.e2e.observe(now - job.queued_at)
        if first_at is not None:
            self.metrics.ttft.observe(first_at - job.queued_at)
            if tokens > 1:
                self.metrics.itl.observe((now - first_at) / (tokens - 1))

    # ---- the engine side (the main thread) ----

    def run(self) -> None:
        """The engine loop, until `begin_close` and every job is done (or ended at the deadline)."""
        try:
            while True:
                with self.wake:
                    while not (self.intake or self.engine.busy or self.closing):
                        self.wake.wait(0.5)  # a timeout keeps the thread responsive to signals
                    if self.closing and not (self.intake or self.engine.busy):
                        return
                if self.closing and time.monotonic() >= self.deadline:
                    self._end_open_jobs()
                while self.intake:
                    self._admit(self.intake.popleft())
                self.engine.step()
                self._hand_over()
                if not self.engine.busy:  # the last row has left: what the step loop freed goes back too
                    trim_heap()  # the trim alone: a collection's pause would fall on the next request
        except Exception as e:  # the engine is broken: say so to every waiting handler and to /health
            self.failure = f"{type(e).__name__}: {e}"
            for request in [*self.engine.requests, *self.engine.waiting]:
                request.on_tokens(request, [], 0)
            self._hand_over()
            raise
        finally:
            self.stopped.set()

    def _end_open_jobs(self) -> None:
        """The shutdown deadline has passed: every job still open gets its final event now
        ("shutdown") and leaves the engine at its next step."""
        self.intake.clear()
        for request in [*self.engine.requests, *self.engine.waiting]:
            request.cancelled = True
        for job in list(self.jobs):
            if not job.ended:
                job.ended = True
                job.cancelled = True
                self.outbox.append((job, Event([], [], "shutdown", 0, 0, 0)))
        self._hand_over()

    def _hand_over(self) -> None:
        """Deliver the step's events to their handlers: one wake-up of their loop per step."""
        if self.outbox:
            batch, self.outbox = self.outbox, []
            self.loop.call_soon_threadsafe(_deliver, batch)

    def _admit(self, job: Job) -> None:
        """The job's request through the pipeline (its stop rule, text stream and constraint or healed
        first token's rule), queued for the engine."""
        p = job.params

        def on_text(request: Request, pieces: list[tuple[str, str]], tokens: list[int]) -> None:
            if job.ended:
                return
            reason = request.row.finish_reason or ("error" if self.failure else None)
            job.ended = reason is not None
            self.outbox.append((job, Event(pieces, tokens, reason, request.steps, request.proposed,
                                           request.accepted)))

        job.request = pipeline.request(self.target.tokenizer, job.prompt, p.options,
                                       p.sampling.generator(self.target.admitted.device), on_text)
        job.request.cancelled = job.cancelled
        self.engine.submit(job.request)

    def begin_close(self, timeout: float | None = None) -> None:
        """Stop admission (any thread); open jobs go on for `timeout` seconds (None: the service's
        shutdown_timeout), then end."""
        with self.wake:
            self.closing = True
            self.deadline = time.monotonic() + (self.shutdown_timeout if timeout is None else timeout)
            self.wake.notify()

    @property
    def queue_length(self) -> int:
        return len(self.intake) + len(self.engine.waiting)


def _deliver(batch: list[tuple[Job, Event]]) -> None:
    for job, event in batch:
        job.events.put_nowait(event)
