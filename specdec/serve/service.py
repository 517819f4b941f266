"""The engine behind the server: the main thread owns the model and runs the step loop (`run`);
HTTP handlers, on uvicorn's thread, hand it jobs through a bounded queue and read their tokens
back as events.

Why the main thread: the CPU kernels run each forward in an OpenMP region whose threads meet at a
barrier in every layer. OpenMP keeps one thread team per thread that ever started a region; the
main thread has one (loading the model starts regions), and a second team on another thread makes
more OpenMP threads than cores, so libgomp stops spinning at barriers and sleeps instead: measured,
a forward run from a second thread took 1.5 ms instead of 0.6 ms on 2 cores.

A job's prompt is encoded as `specdec generate` encodes it (api.py): <|endoftext|> first, and a
prompt ending in whitespace token-healed (its first token chosen on this thread, one target
forward, then the rest decoded by the engine), so greedy output over HTTP equals the command's.

Events reach the handler's asyncio loop through `call_soon_threadsafe`; a handler that goes away
sets `cancelled`, and the engine drops the row at its next step. `close` lets running and queued
jobs finish (graceful shutdown) or, after a timeout, cancels them.
"""
from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from dataclasses import dataclass, field


from ..api import Loaded
from ..engine import Engine, Request
from ..errors import SpecdecError
from ..metrics import PHASES
from ..healing import back_off, first_tokens
from ..sampling import SamplingConfig
from ..stopping import StopRule
from ..tokenizer import EOS_ID
from .prometheus import Histogram, family, value
from .text import TextStream


class QueueFull(SpecdecError):
    """More jobs wait than the queue holds (HTTP 429)."""


class Closing(SpecdecError):
    """The server is shutting down (HTTP 503)."""


@dataclass(frozen=True)
class Params:
    """A completion request's settings, already validated (app.py)."""
    prompt: str
    max_tokens: int
    sampling: SamplingConfig
    stop: tuple[str, ...]


@dataclass(frozen=True)
class Event:
    pieces: list[tuple[str, str]]  # (text, "draft" | "target")
    tokens: list[int]              # the step's token ids
    finish_reason: str | None      # set on the last event: "eos" | "stop" | "length"
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
    ids: list[int]                 # <|endoftext|> + the prompt's ids (the last backed off when healing)
    healed: str                    # text the first token must start with ("" = no healing)
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    request: Request | None = None
    cancelled: bool = False
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
                 name: str | None = None, widths: tuple[int, ...] | None = None):
        self.target, self.method, self.k = target, method, k
        self.name = name or target.path.name
        self.context = target.model.config.max_position_embeddings
        self.engine = Engine(target.model, proposer, k, capacity, self.context, widths=widths)
        self.max_queue = max_queue
        self.intake: deque[Job] = deque()  # jobs not yet healed and submitted (this thread reads them)
        self.loop: asyncio.AbstractEventLoop | None = None  # the handlers' loop
        self.outbox: list[tuple[Job, Event]] = []  # events of the current step, handed over at once
        self.wake = threading.Condition()
        self.closing = False
        self.failure: str | None = None  # why the engine loop stopped, if it failed
        self.stopped = threading.Event()  # the engine loop has returned
        self.requests = {"ok": 0, "cancelled": 0, "rejected": 0, "invalid": 0}
        self.prompt_tokens = 0
        self.ttft = Histogram("specdec_time_to_first_token_seconds", "Queueing, prefill and first step of a request.")
        self.itl = Histogram("specdec_inter_token_seconds", "A request's mean time per token after its first.")
        self.e2e = Histogram("specdec_request_seconds", "Whole request, from arrival to its last token.")

    # ---- the handler side (asyncio thread) ----

    def encode(self, params: Params) -> tuple[list[int], str]:
        """The prompt's ids and healed text, refused when prompt + max_tokens exceed the context."""
        healed = back_off(self.target.tokenizer, params.prompt)
        ids = [EOS_ID] + healed.ids
        needed = len(ids) + bool(healed.text) + params.max_tokens
        if needed > self.context:
            raise SpecdecError(f"the prompt has {len(ids) + bool(healed.text)} tokens and max_tokens is "
                               f"{params.max_tokens}: {needed} tokens exceed the model's context of "
                               f"{self.context}. Shorten the prompt or lower max_tokens")
        return ids, healed.text

    def submit(self, params: Params) -> Job:
        ids, healed = self.encode(params)
        if self.closing or self.failure:
            raise Closing(f"the server is {'shutting down' if self.closing else 'broken: ' + self.failure}; "
                          "retry on another instance")
        if len(self.intake) + len(self.engine.waiting) >= self.max_queue:
            self.requests["rejected"] += 1
            raise QueueFull(f"{self.max_queue} requests are already queued; retry later")
        self.loop = asyncio.get_running_loop()
        job = Job(params, ids, healed)
        self.prompt_tokens += len(ids) + bool(healed)
        with self.wake:
            self.intake.append(job)
            self.wake.notify()
        return job

    def finished(self, job: Job, first_at: float | None, tokens: int, ended: bool) -> None:
        """A handler is done with a job: count it and its latencies."""
        now = time.perf_counter()
        if not ended:
            job.cancel()
        self.requests["ok" if ended else "cancelled"] += 1
        self.e2e.observe(now - job.queued_at)
        if first_at is not None:
            self.ttft.observe(first_at - job.queued_at)
            if tokens > 1:
                self.itl.observe((now - first_at) / (tokens - 1))

    # ---- the engine side (the main thread) ----

    def run(self) -> None:
        """The engine loop, until `close` and every job is done (or cancelled)."""
        try:
            while True:
                with self.wake:
                    while not (self.intake or self.engine.busy or self.closing):
                        self.wake.wait(0.5)  # a timeout keeps the thread responsive to signals
                    if self.closing and not (self.intake or self.engine.busy):
                        return
                while self.intake:
                    self._admit(self.intake.popleft())
                self.engine.step()
                self._hand_over()
        except Exception as e:  # the engine is broken: say so to every waiting handler and to /health
            self.failure = f"{type(e).__name__}: {e}"
            for request in [*self.engine.requests, *self.engine.waiting]:
                request.on_tokens(request, [], 0)
            self._hand_over()
            raise
        finally:
            self.stopped.set()

    def _hand_over(self) -> None:
        """Deliver the step's events to their handlers: one wake-up of their loop per step."""
        if self.outbox:
            batch, self.outbox = self.outbox, []
            self.loop.call_soon_threadsafe(_deliver, batch)

    def _admit(self, job: Job) -> None:
        """Heal the prompt when needed (its first token, emitted at once), then queue the request."""
        p = job.params
        generator = p.sampling.generator(self.engine.device)
        tokenizer = self.target.tokenizer
        skip = len(job.healed)
        rule = StopRule(p.max_tokens, EOS_ID, p.stop, lambda tokens: tokenizer.decode(tokens)[skip:])
        stream = TextStream(tokenizer.decode, p.stop, skip)

        def on_tokens(request: Request, tokens: list[int], drafted: int) -> None:
            row = request.row
            final = row.text() if row.done else None
            reason = row.finish_reason or ("error" if self.failure else None)
            self.outbox.append((job, Event(stream.add(tokens, drafted, final), tokens, reason, request.steps,
                                           request.proposed, request.accepted)))

        ids = job.ids
        first = None
        if job.healed and p.max_tokens > 0:
            first = first_tokens(self.target.model, tokenizer, [ids], [job.healed], p.sampling, generator)[0]
            ids = ids + [first]
        job.request = Request(ids, rule, p.sampling, generator, on_tokens, cancelled=job.cancelled)
        if first is not None:
            job.request.row.append(first)  # healing chose it: the row's first token, from the target
            on_tokens(job.request, [first], 0)
        self.engine.submit(job.request)

    def close(self, timeout: float) -> None:
        """Finish running and queued jobs within `timeout` seconds, then cancel what is left; return
        when the engine loop has stopped (any thread but the loop's)."""
        with self.wake:
            self.closing = True
            self.wake.notify()
        if not self.stopped.wait(timeout):
            for request in [*self.engine.requests, *self.engine.waiting]:
                request.cancelled = True
            self.intake.clear()
            self.stopped.wait()

    # ---- /metrics ----

    def prometheus(self) -> str:
        m = self.engine.metrics
        positions = range(1, m.k + 1)
        lines = [
            *family("specdec_requests_total", "counter", "Completion requests by outcome.",
                    [(f'{{outcome="{o}"}}', n) for o, n in self.requests.items()]),
            *family("specdec_prompt_tokens_total", "counter", "Prompt tokens of accepted requests.",
                    [("", self.prompt_tokens)]),
            *family("specdec_generated_tokens_total", "counter", "Tokens emitted by the engine.", [("", m.emitted)]),
            *family("specdec_steps_total", "counter", "Target verification forward passes.", [("", m.steps)]),
            *family("specdec_row_steps_total", "counter", "Verifications of one row.", [("", m.row_steps)]),
            *family("specdec_proposed_tokens_total", "counter", "Draft tokens proposed.", [("", m.proposed)]),
            *family("specdec_accepted_tokens_total", "counter", "Draft tokens the target accepted.", [("", m.accepted)]),
            *family("specdec_accepted_per_position_total", "counter", "Steps where draft i was accepted.",
                    [(f'{{position="{i}"}}', n) for i, n in zip(positions, m.accepted_per_position)]),
            *family("specdec_reached_per_position_total", "counter",
                    "Steps where draft i was proposed and drafts before it accepted.",
                    [(f'{{position="{i}"}}', n) for i, n in zip(positions, m.reached_per_position)]),
            *family("specdec_acceptance_rate", "gauge", "α: accepted / proposed since start.",
                    [("", value(m.acceptance_rate))]),
            *family("specdec_acceptance_per_position", "gauge", "α_i: accepted_i / reached_i since start.",
                    [(f'{{position="{i}"}}', value(a)) for i, a in zip(positions, m.acceptance_per_position)]),
            *family("specdec_mean_acceptance_length", "gauge", "τ: emitted tokens / row steps (with the "
                    "recovered or bonus token).", [("", value(m.mean_acceptance_length))]),
            *family("specdec_engine_seconds_total", "counter", "Engine time by phase of the step loop (metrics.py).",
                    [(f'{{phase="{name.removesuffix("_seconds")}"}}', value(getattr(m, name)))
                     for name in ("prefill_seconds", *PHASES)]),
            *family("specdec_queue_length", "gauge", "Requests waiting for a row.",
                    [("", len(self.intake) + len(self.engine.waiting))]),
            *family("specdec_batch_size", "gauge", "Rows in the running batch.", [("", len(self.engine.requests))]),
            *self.ttft.lines(), *self.itl.lines(), *self.e2e.lines(),
        ]
        return "\n".join(lines) + "\n"


def _deliver(batch: list[tuple[Job, Event]]) -> None:
    for job, event in batch:
        job.events.put_nowait(event)
