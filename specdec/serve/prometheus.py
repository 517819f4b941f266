"""The server's metrics in Prometheus' text exposition format (version 0.0.4), written out here
rather than through a client library: a handful of counters, gauges and histograms.

Engine counters (steps, proposed, accepted, per-position acceptance, τ) are read from the
engine's SpecMetrics at scrape time, so they have one definition (metrics.py); request counts
and latency histograms are kept here.
"""
from __future__ import annotations

import bisect
import threading

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Histogram:
    def __init__(self, name: str, help: str, buckets: tuple[float, ...] = LATENCY_BUCKETS):
        self.name, self.help, self.buckets = name, help, buckets
        self.counts = [0] * (len(buckets) + 1)  # the last: above every bound (+Inf only)
        self.sum = 0.0
        self.lock = threading.Lock()

    def observe(self, value: float) -> None:
        with self.lock:
            self.counts[bisect.bisect_left(self.buckets, value)] += 1
            self.sum += value

    def lines(self) -> list[str]:
        with self.lock:
            counts, total = list(self.counts), self.sum
        out = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        running = 0
        for bound, n in zip(self.buckets, counts):
            running += n
            out.append(f'{self.name}_bucket{{le="{bound}"}} {running}')
        out += [f'{self.name}_bucket{{le="+Inf"}} {sum(counts)}', f"{self.name}_sum {total}",
                f"{self.name}_count {sum(counts)}"]
        return out


def family(name: str, kind: str, help: str, samples: list[tuple[str, float]]) -> list[str]:
    """One metric family; samples: (label set such as '{position="1"}' or '', value)."""
    return [f"# HELP {name} {help}", f"# TYPE {name} {kind}"] + [f"{name}{labels} {value}" for labels, value in samples]


def value(x: float | None) -> str:
    """A sample value as Prometheus writes it (NaN: not defined yet, e.g. α before any draft)."""
    return "NaN" if x is None else repr(float(x)) if isinstance(x, float) else str(x)
