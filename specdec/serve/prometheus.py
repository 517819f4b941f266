"""The server's metrics for Prometheus, through prometheus_client: a registry per server holding
the latency histograms (observed as requests end) and a collector that reads everything else at
scrape time, so the engine's counters (steps, proposed, accepted, per-position acceptance, τ)
keep their one definition (metrics.py) and the request counts and queue gauges their service.
"""
from __future__ import annotations

from functools import partial

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..decoding.metrics import PHASES

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def nan(x: float | None) -> float:
    """A figure that is not defined yet (α before any draft) as NaN."""
    return float("nan") if x is None else float(x)


class Metrics:
    """`service`: anything with .engine (engine.Engine), .requests (outcome -> count),
    .prompt_tokens, .queue_length and .jobs."""

    def __init__(self, service):
        self.service = service
        self.registry = CollectorRegistry(auto_describe=False)
        self.ttft = Histogram("specdec_time_to_first_token_seconds", "Queueing, prefill and first step of a request.",
                              buckets=LATENCY_BUCKETS, registry=self.registry)
        self.itl = Histogram("specdec_inter_token_seconds", "A request's mean time per token after its first.",
                             buckets=LATENCY_BUCKETS, registry=self.registry)
        self.e2e = Histogram("specdec_request_seconds", "Whole request, from arrival to its last token.",
                             buckets=LATENCY_BUCKETS, registry=self.registry)
        self.registry.register(self)

    def text(self) -> bytes:
        return generate_latest(self.registry)

    def collect(self):
        s, m = self.service, self.service.engine.metrics
        positions = [str(i) for i in range(1, m.k + 1)]

        def family(kind, name: str, help: str, value: float | None = None, label: str | None = None,
                   samples: list | None = None):
            metric = kind(name, help, value=value, labels=[label] if label else None)
            for key, v in samples or ():
                metric.add_metric([key], v)
            return metric

        counter, gauge = partial(family, CounterMetricFamily), partial(family, GaugeMetricFamily)

        yield counter("specdec_requests", "Completion requests by outcome.", label="outcome",
                      samples=list(s.requests.items()))
        yield counter("specdec_prompt_tokens", "Prompt tokens of accepted requests.", s.prompt_tokens)
        yield counter("specdec_generated_tokens", "Tokens emitted by the engine.", m.emitted)
        yield counter("specdec_steps", "Target verification forward passes.", m.steps)
        yield counter("specdec_row_steps", "Verifications of one row.", m.row_steps)
        yield counter("specdec_proposed_tokens", "Draft tokens proposed.", m.proposed)
        yield counter("specdec_accepted_tokens", "Draft tokens the target accepted.", m.accepted)
        yield counter("specdec_accepted_per_position", "Steps where draft i was accepted.", label="position",
                      samples=list(zip(positions, m.accepted_per_position)))
        yield counter("specdec_reached_per_position", "Steps where draft i was proposed and drafts before it "
                      "accepted.", label="position", samples=list(zip(positions, m.reached_per_position)))
        yield gauge("specdec_acceptance_rate", "α: accepted / proposed since start.", nan(m.acceptance_rate))
        yield gauge("specdec_acceptance_per_position", "α_i: accepted_i / reached_i since start.", label="position",
                    samples=[(p, nan(a)) for p, a in zip(positions, m.acceptance_per_position)])
        yield gauge("specdec_mean_acceptance_length", "τ: emitted tokens / row steps (with the recovered or bonus "
                    "token).", nan(m.mean_acceptance_length))
        yield counter("specdec_engine_seconds", "Engine time by phase of the step loop (metrics.py).", label="phase",
                      samples=[(name.removesuffix("_seconds"), float(getattr(m, name)))
                               for name in ("prefill_seconds", *PHASES)])
        yield gauge("specdec_queue_length", "Requests waiting for a row.", s.queue_length)
        yield gauge("specdec_batch_size", "Rows in the running batch.", len(s.engine.requests))
        yield gauge("specdec_jobs", "Requests in the server: running, queued or being encoded "
                    "(at most --max-batch + --max-queue).", len(s.jobs))
        pool = s.engine.cache.pool
        if pool is not None:  # the target's KV cache in blocks (lm/kv_cache.py)
            yield gauge("specdec_kv_blocks", "The target's KV cache blocks by state: held by rows, cached prefix "
                        "blocks no row holds, free; promised: set aside for running rows' growth.", label="state",
                        samples=[("in_use", pool.in_use), ("idle", len(pool.idle)), ("free", len(pool.free)),
                                 ("promised", pool.promised)])
            yield counter("specdec_kv_shared_blocks", "Prompt blocks mapped from the prefix cache instead of "
                          "prefilled.", pool.shared_hits)
