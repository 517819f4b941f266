"""Adaptive speculation (`k="auto"`): before each step, choose how many levels to draft, and
whether as a chain or a tree, from what pays on this machine; 0 levels is plain decoding.

The predicted rate of an option (shape s, depth d) is tokens per second over the batch:

    rate(s, d) = Σ_rows E_b(s, d) / (t_B(n(s, d)) + draft(d) + overhead)

- E_b(s, d) = 1 + Σ_{i<=d} Π_{j<=i} q_bj: q_bj is row b's chance that a draft at depth j is
  accepted once the accepted path got to depth j - 1 and the step allowed depth j (decayed counts
  per row with a prior). It folds the cost model's proposal rate p_j and acceptance α_j into one
  (costmodel.predicted_speedup), per shape: a tree's alternatives raise it.
- t_B(n): the target's forward over n tokens per row at the batch's current size B (rows join and
  leave), measured on this machine once per batch size (powers of two) and cached
  (calibration.py); n(s, d) the window such a step really carried (a running mean; it starts at
  1 + Σ widths[:d], what a full proposal would carry).
- draft(d): the proposer's seconds per step at depth d, overhead: the engine's own seconds per
  step (running means of what the steps took; a depth not yet measured is scaled from the nearest
  one that was, in proportion to d; draft(d) is the median of its latest five steps, or the
  fewest seconds of its first two, so one spike does not keep a depth from being drafted).

What a run learned carries over to the next run of the same proposer, target and capacity in
this process (`remember`): the costs, the probe stretch and, as the joining rows' prior, the rows'
mean q per shape and depth. A benchmark thus stops exploring what it already knows; a server's
rows start from what the earlier ones taught.

The option of highest rate is drafted. Plain decoding, when it is the best, runs as a stretch of
steps (the engine's lean plain loop, with its own overhead estimate) followed by a probe: one
level drafted, cycling through the shapes; each probe that does not change the verdict doubles the
next stretch (PROBE_EVERY up to MAX_STRETCH steps), so a method that does not pay costs little. When
a one-level probe is predicted to cost less than CHEAP of the throughput (n-gram lookup under greedy
decoding), it comes after every plain step instead, since such matches come in bursts. While drafting pays, every
PROBE_EVERY steps one level deeper than the best is drafted instead, so the estimates of levels
not chosen stay fresh, and a drafting choice holds for HOLD steps between weighings. `summary()` says what was chosen and why: each option's mean predicted
speedup over plain decoding.

This module knows nothing about models or tokens: the engine reports each step's outcome.
"""
from __future__ import annotations

import statistics
import weakref
from collections import Counter, deque
from typing import Callable

import numpy as np

from ..lm.interface import Admitted
from .calibration import cached_verify_curve, verify_curves
from .costmodel import VerifyCurve

AUTO_DEPTH = 8                        # the deepest option considered
AUTO_TREE = (3, 2, 2, 1, 1, 1, 1, 1)  # the tree shape tried beside chains, for proposers that draft trees
PRIOR, PRIOR_WEIGHT = 0.7, 1.0        # q before any evidence: optimistic, so speculation gets tried
DECAY = 0.9                           # weight of a row's older steps per new one (about the last 10)
SMOOTHING = 0.2                       # running means of costs and windows
PROBE_EVERY = 16
HOLD = 4
MAX_STRETCH = 256
REMEMBERED_WEIGHT = 2.0               # pseudo-steps a remembered q counts for in a new row
REMEMBERED_STRETCH = 2 * PROBE_EVERY  # the longest stretch a new run starts with (it re-checks early)
CHEAP = 0.03                          # a probe predicted to cost less than this share of throughput is free

# proposer -> {(target id, batch size, shapes): what its last run learned}
_MEMORY: "weakref.WeakKeyDictionary[object, dict]" = weakref.WeakKeyDictionary()


def options(proposer, widths: tuple[int, ...] | None) -> tuple[dict[str, tuple[int, ...]], str | None]:
    """The shapes a run weighs, by name, and a note where the tree is left out: chains of 1..K
    levels and, where the proposer drafts trees, the tree `widths` (default AUTO_TREE); K =
    len(widths) or AUTO_DEPTH, at most what the proposer can draft."""
    tree = tuple(widths) if widths is not None else AUTO_TREE
    depth = min(len(tree), proposer.max_depth or len(tree))
    tree, note = tree[:depth], None
    shapes = {"chain": (1,) * depth}
    if max(tree) > 1:
        if proposer.trees:
            shapes["tree"] = tree
        else:
            note = f"the {proposer.name} proposer drafts no trees: chains only"
    return shapes, note


def window(shapes: dict[str, tuple[int, ...]]) -> int:
    """Tokens per row of the widest verify window any of the shapes makes."""
    return 1 + sum(max(w) for w in zip(*shapes.values()))


def curve_batch(rows: int, capacity: int) -> int:
    """The batch size whose verify curve prices a step over `rows` rows: the next power of two, at most capacity."""
    return min(capacity, 1 << max(rows - 1, 0).bit_length())


def measure_ahead(target: Admitted, proposer, capacity: int, widths: tuple[int, ...] | None, name: str) -> float:
    """Read, or measure now, every verify curve a run of up to `capacity` rows may ask for, so that
    no timed region pays for the measurement (calibration.verify_curves says so on stderr when it
    measures); returns the seconds spent measuring (0 when they were stored)."""
    batches = sorted({curve_batch(rows, capacity) for rows in range(capacity + 1)})
    return verify_curves(target, batches, window(options(proposer, widths)[0]), name)[1]


class Adaptive:
    def __init__(self, curves: VerifyCurve | Callable[[int], VerifyCurve], rows: int,
                 shapes: dict[str, tuple[int, ...]], note: str | None = None):
        """curves: the target's verify curve for a batch of B rows (a function of B), or one curve
        for every batch size; rows: the rows of the batch to begin with (more `join` later)."""
        self.curves = curves if callable(curves) else (lambda rows: curves)
        self.names = list(shapes)
        self.shapes = [shapes[name] for name in self.names]
        self.depth = K = len(self.shapes[0])
        S = len(self.shapes)
        self.accepted = np.zeros((S, rows, K))  # per shape and row: decayed counts by depth
        self.offered = np.zeros((S, rows, K))
        self.prior = None  # (accepted, offered) (S, K) a joining row starts with; None: nothing
        self.window = np.array([[1.0 + sum(w[:d]) for d in range(K + 1)] for w in self.shapes])  # (S, K+1)
        self.draft_seconds = np.zeros(K + 1)                  # per depth, running means
        self.draft_measured = np.zeros(K + 1, dtype=bool)     # depth 0: never (it drafts nothing)
        self.draft_samples = [deque(maxlen=5) for _ in range(K + 1)]  # the latest seconds per depth
        self.plain_run = 0                                    # plain steps since the last drafting step
        self.stretch = PROBE_EVERY                            # plain steps before the next probe
        self.probes = 0
        self.held = 0                                         # steps the current choice still holds
        self.overhead_seconds = np.zeros(K + 1)  # per step: [0] of a plain stretch, [1:] of a drafting step
        self.steps = 0        # steps decided (a plain stretch counts each of its steps)
        self.evaluations = 0  # times the options were weighed
        self.chosen: tuple[int, int] = (0, 0)
        self.choices: Counter = Counter()
        self.predicted_sum = np.zeros((S, K + 1))
        self.note = note
        self.memory, self.memory_key = None, None

    @classmethod
    def for_run(cls, target: Admitted, proposer, capacity: int, widths: tuple[int, ...] | None) -> "Adaptive":
        """Options for this proposer (`options`, the tree cut at each depth). The target's verify
        curves come from the cache or are measured on first need, at batch sizes of powers of two
        up to `capacity` (`measure_ahead` measures them before a timed run); what earlier runs of
        this proposer learned is recalled."""
        shapes, note = options(proposer, widths)
        measured: dict[int, VerifyCurve] = {}

        def curves(rows: int) -> VerifyCurve:
            batch = curve_batch(rows, capacity)
            if batch not in measured:
                measured[batch] = cached_verify_curve(target, batch, window(shapes))[0]
            return measured[batch]

        adaptive = cls(curves, 0, shapes, note)
        try:
            memory = _MEMORY.setdefault(proposer, {})
        except TypeError:  # a proposer that cannot be weakly referenced starts afresh every run
            memory = {}
        adaptive.memory, adaptive.memory_key = memory, (id(target.lm), capacity, tuple(shapes.items()))
        adaptive.recall(memory.get(adaptive.memory_key))
        return adaptive

    def recall(self, learned: dict | None) -> None:
        if learned is None:
            return
        for name in ("draft_seconds", "draft_measured", "overhead_seconds", "window"):
            setattr(self, name, learned[name].copy())
        self.draft_samples = [deque([s], maxlen=5) if seen else deque(maxlen=5)
                              for s, seen in zip(self.draft_seconds, self.draft_measured)]
        self.stretch = min(learned["stretch"], REMEMBERED_STRETCH)
        seen = learned["seen"]
        self.prior = np.where(seen, learned["q"] * REMEMBERED_WEIGHT, 0.0), np.where(seen, REMEMBERED_WEIGHT, 0.0)

    def remember(self) -> None:
        """Keep what this run learned for the next run (see the module docstring)."""
        if self.memory is None:
            return
        offered = self.offered.sum(1)                                           # (S, K)
        q = (self.accepted.sum(1) + PRIOR * PRIOR_WEIGHT) / (offered + PRIOR_WEIGHT)
        self.memory[self.memory_key] = {
            "q": q, "seen": offered > 0, "stretch": self.stretch,
            **{name: getattr(self, name).copy() for name in ("draft_seconds", "draft_measured", "overhead_seconds",
                                                             "window")}}

    def join(self, rows: int) -> None:
        """Rows appended to the batch: they start from the remembered acceptance, if any."""
        S, _, K = self.accepted.shape
        accepted, offered = self.prior if self.prior is not None else (np.zeros((S, K)), np.zeros((S, K)))
        self.accepted = np.concatenate([self.accepted, np.repeat(accepted[:, None], rows, 1)], 1)
        self.offered = np.concatenate([self.offered, np.repeat(offered[:, None], rows, 1)], 1)

    def leave(self, keep: list[int]) -> None:
        """Only rows `keep` stay, in that order."""
        self.accepted, self.offered = self.accepted[:, keep], self.offered[:, keep]

    @property
    def widest(self) -> tuple[int, ...]:
        """The most nodes per depth any option drafts (for the room a cache needs)."""
        return tuple(max(w) for w in zip(*self.shapes))

    def rates(self) -> np.ndarray:
        """(S, K+1) predicted tokens per second of each option over the batch's rows."""
        q = (self.accepted + PRIOR * PRIOR_WEIGHT) / (self.offered + PRIOR_WEIGHT)          # (S, B, K)
        E = 1 + np.concatenate([np.zeros(q.shape[:2] + (1,)), np.cumprod(q, 2).cumsum(2)], 2)  # (S, B, K+1)
        curve = self.curves(q.shape[1])
        points = sorted(curve.seconds)
        forward = np.interp(self.window, points, [curve.seconds[n] for n in points])          # (S, K+1)
        return E.sum(1) / (forward + self.draft_estimates() + self.overhead_seconds)

    def draft_estimates(self) -> np.ndarray:
        """(K+1,) draft seconds per step by depth: measured, else scaled from the nearest measured depth."""
        measured = np.flatnonzero(self.draft_measured)
        if measured.size == 0:
            return np.zeros(self.depth + 1)
        depths = np.arange(self.depth + 1)
        nearest = measured[np.abs(depths[:, None] - measured[None]).argmin(1)]
        return np.where(self.draft_measured, self.draft_seconds, self.draft_seconds[nearest] * depths / nearest)

    def choose(self) -> tuple[int, tuple[int, ...], int]:
        """The depth to draft next, the widths per depth to draft it with, and for how many steps
        (1 when drafting; plain decoding: up to the next probe). A drafting choice holds for HOLD
        steps before the options are weighed again (between probes): weighing costs tens of
        microseconds, and the estimates move slowly."""
        if self.held and (self.steps + 1) % PROBE_EVERY:
            self.held -= 1
            return self.chosen[1], self.shapes[self.chosen[0]][:self.chosen[1]], 1
        rates = self.rates()
        self.predicted_sum += rates / rates[0, 0]
        self.evaluations += 1
        s, d = np.unravel_index(np.argmax(rates), rates.shape)
        steps = 1
        # a probe predicted to cost less than CHEAP of the throughput (n-gram lookup, greedy) comes
        # after every plain step: such matches come in bursts
        stretch = 1 if rates[:, 1].max() >= (1 - CHEAP) * rates[0, 0] else self.stretch
        if d == 0 and self.plain_run < stretch:
            steps = stretch - self.plain_run
        elif d == 0 or (self.steps + 1) % PROBE_EVERY == 0:  # probe one level deeper than the shape's best
            s = self.probes % len(self.shapes)
            d = min(self.depth, int(rates[s].argmax()) + 1)
            self.probes += 1
            if self.plain_run:
                self.stretch = min(2 * self.stretch, MAX_STRETCH)
        else:
            self.stretch, self.held = PROBE_EVERY, HOLD - 1
        self.chosen = (int(s), int(d))
        return self.chosen[1], self.shapes[self.chosen[0]][:self.chosen[1]], steps

    def observe(self, limits: list[int], accepted: list[int], width: int, draft_seconds: float,
                step_seconds: float, forward_seconds: float) -> None:
        """What the chosen step did: per row the levels it allowed and the drafts accepted, the
        window the target verified, and the seconds spent drafting, in the whole step and in the
        target's forward."""
        s, d = self.chosen
        self.steps += 1
        self.choices[self.label(s, d)] += 1
        levels = np.arange(self.depth)[None]                                   # (1, K)
        limits, accepted = np.asarray(limits)[:, None], np.asarray(accepted)[:, None]  # (B, 1)
        judged = levels < np.minimum(limits, accepted + 1)
        self.offered[s] = np.where(judged, DECAY * self.offered[s] + 1, self.offered[s])
        self.accepted[s] = np.where(judged, DECAY * self.accepted[s] + (levels < accepted), self.accepted[s])
        self.window[s, d] += SMOOTHING * (width - self.window[s, d])
        # robust to the spikes of a first step (lazy set-up, cold caches), a busy machine or a
        # catch-up after a long stretch: the fewest seconds of up to 2 samples, the median of 3..5
        samples = self.draft_samples[d]
        samples.append(draft_seconds)
        self.draft_seconds[d] = min(samples) if len(samples) < 3 else statistics.median(samples)
        self.draft_measured[d] = True
        self.plain_run = 0
        other = step_seconds - forward_seconds - draft_seconds
        self.overhead_seconds[1:] += SMOOTHING * (other - self.overhead_seconds[1:])

    def observe_plain(self, steps: int, seconds: float, forward_seconds: float) -> None:
        """A plain stretch of `steps` steps took `seconds`, `forward_seconds` of them in forwards."""
        self.steps += steps
        self.plain_run += steps
        self.choices["plain"] += steps
        if steps:
            other = (seconds - forward_seconds) / steps
            self.overhead_seconds[0] += SMOOTHING * (other - self.overhead_seconds[0])

    def label(self, s: int, d: int) -> str:
        return "plain" if d == 0 else f"{self.names[s]}:{d}"

    def summary(self) -> dict:
        """What was chosen, how often, and each option's mean predicted speedup over plain decoding."""
        mean = self.predicted_sum / max(self.evaluations, 1)
        predicted = {self.label(s, d): round(float(mean[s, d]), 3)
                     for s in range(len(self.shapes)) for d in range(self.depth + 1) if d or s == 0}
        return {"shapes": dict(zip(self.names, self.shapes)), "choices": dict(self.choices),
                "predicted_speedup": predicted, "probe_every": PROBE_EVERY,
                "note": self.note}


def merge_summaries(summaries: list[dict | None]) -> dict | None:
    """One summary for several runs (a benchmark's batches): choices added up, each option's
    predicted speedup averaged over the runs."""
    summaries = [s for s in summaries if s]
    if not summaries:
        return None
    choices: Counter = Counter()
    for s in summaries:
        choices.update(s["choices"])
    predicted = {option: round(sum(s["predicted_speedup"][option] for s in summaries) / len(summaries), 3)
                 for option in summaries[0]["predicted_speedup"]}
    return {**summaries[-1], "choices": dict(choices), "predicted_speedup": predicted}
