"""Adaptive speculation (`k="auto"`): before each step, choose how many levels to draft, and
whether as a chain or a tree, from what pays on this machine; 0 levels is plain decoding.

The predicted rate of an option (shape s, depth d) is tokens per second over the batch:

    rate(s, d) = Σ_rows E_b(s, d) / (t_B(n(s, d)) + d × draft_level + overhead)

- E_b(s, d) = 1 + Σ_{i<=d} Π_{j<=i} q_bj: q_bj is row b's chance that a draft at depth j is
  accepted once the accepted path got to depth j - 1 and the step allowed depth j (decayed counts
  per row with a prior). It folds the cost model's proposal rate p_j and acceptance α_j into one
  (costmodel.predicted_speedup), per shape: a tree's alternatives raise it.
- t_B(n): the target's forward over n tokens per row at this batch size, measured on this
  machine once and cached (calibration.py); n(s, d) the window such a step really carried
  (a running mean; it starts at 1 + Σ widths[:d], what a full proposal would carry).
- draft_level: the proposer's seconds per level drafted, overhead: the engine's own seconds per
  step (running means of what the steps took).

The option of highest rate is drafted. Every PROBE_EVERY steps one level deeper than the best is
drafted instead (cycling through the shapes), so the estimates of levels not chosen stay fresh at
a bounded cost. `summary()` says what was chosen and why: each option's mean predicted speedup
over plain decoding.

This module knows nothing about models or tokens: the engine reports each step's outcome.
"""
from __future__ import annotations

from collections import Counter

import numpy as np

from .calibration import cached_verify_curve
from .costmodel import VerifyCurve

AUTO_DEPTH = 8                        # the deepest option considered
AUTO_TREE = (3, 2, 2, 1, 1, 1, 1, 1)  # the tree shape tried beside chains, for proposers that draft trees
PRIOR, PRIOR_WEIGHT = 0.7, 1.0        # q before any evidence: optimistic, so speculation gets tried
DECAY = 0.9                           # weight of a row's older steps per new one (about the last 10)
SMOOTHING = 0.2                       # running means of costs and windows
PROBE_EVERY = 16


class Adaptive:
    def __init__(self, curve: VerifyCurve, batch_size: int, shapes: dict[str, tuple[int, ...]],
                 measured_now: bool = False, note: str | None = None):
        self.curve, self.names = curve, list(shapes)
        self.shapes = [shapes[name] for name in self.names]
        self.depth = K = len(self.shapes[0])
        S = len(self.shapes)
        self.accepted = np.zeros((S, batch_size, K))
        self.offered = np.zeros((S, batch_size, K))
        self.window = np.array([[1.0 + sum(w[:d]) for d in range(K + 1)] for w in self.shapes])  # (S, K+1)
        self.level_seconds = 0.0
        self.overhead_seconds = 0.0
        self.steps = 0
        self.chosen: tuple[int, int] = (0, 0)
        self.choices: Counter = Counter()
        self.predicted_sum = np.zeros((S, K + 1))
        self.measured_now, self.note = measured_now, note

    @classmethod
    def for_run(cls, target, proposer, batch_size: int, widths: tuple[int, ...] | None) -> "Adaptive":
        """Options for this proposer: chains of 1..K levels and, where it drafts trees, the tree
        `widths` (default AUTO_TREE) cut at each depth; K = len(widths) or AUTO_DEPTH, at most what
        the proposer can draft. The target's verify curve at this batch size comes from the cache
        or is measured now."""
        limit = proposer.max_depth
        tree = tuple(widths) if widths is not None else AUTO_TREE
        depth = min(len(tree), limit or len(tree))
        tree, note = tree[:depth], None
        shapes = {"chain": (1,) * depth}
        if max(tree) > 1:
            if proposer.trees:
                shapes["tree"] = tree
            else:
                note = f"the {proposer.name} proposer drafts no trees: chains only"
        curve, measured_now = cached_verify_curve(target, batch_size, 1 + sum(max(w) for w in zip(*shapes.values())))
        return cls(curve, batch_size, shapes, measured_now, note)

    @property
    def widest(self) -> tuple[int, ...]:
        """The most nodes per depth any option drafts (for the room a cache needs)."""
        return tuple(max(w) for w in zip(*self.shapes))

    def rates(self, active: list[bool]) -> np.ndarray:
        """(S, K+1) predicted tokens per second of each option over the active rows."""
        q = (self.accepted + PRIOR * PRIOR_WEIGHT) / (self.offered + PRIOR_WEIGHT)          # (S, B, K)
        E = 1 + np.concatenate([np.zeros(q.shape[:2] + (1,)), np.cumprod(q, 2).cumsum(2)], 2)  # (S, B, K+1)
        tokens = E[:, np.asarray(active, dtype=bool)].sum(1)                                  # (S, K+1)
        top = max(self.curve.seconds)
        forward = np.vectorize(lambda n: self.curve.at(min(max(n, 1.0), top)))(self.window)
        cost = forward + np.arange(self.depth + 1) * self.level_seconds + self.overhead_seconds
        return tokens / cost

    def choose(self, active: list[bool]) -> tuple[int, tuple[int, ...]]:
        """The depth to draft this step and the widths per depth to draft it with."""
        rates = self.rates(active)
        self.predicted_sum += rates / rates[0, 0]
        s, d = np.unravel_index(np.argmax(rates), rates.shape)
        self.steps += 1
        if self.steps % PROBE_EVERY == 0:
            s = (self.steps // PROBE_EVERY) % len(self.shapes)
            d = min(self.depth, int(rates[s].argmax()) + 1)
        self.chosen = (int(s), int(d))
        self.choices[self.label(*self.chosen)] += 1
        return self.chosen[1], self.shapes[self.chosen[0]][:self.chosen[1]]

    def observe(self, limits: list[int], accepted: list[int], active: list[bool], width: int,
                draft_seconds: float, step_seconds: float, forward_seconds: float) -> None:
        """What the chosen step did: per row the levels it allowed and the drafts accepted, the
        window the target verified, and the seconds spent drafting, in the whole step and in the
        target's forward."""
        s, d = self.chosen
        levels = np.arange(self.depth)[None]                                   # (1, K)
        limits, accepted = np.asarray(limits)[:, None], np.asarray(accepted)[:, None]  # (B, 1)
        judged = (levels < np.minimum(limits, accepted + 1)) & np.asarray(active, dtype=bool)[:, None]
        self.offered[s] = np.where(judged, DECAY * self.offered[s] + 1, self.offered[s])
        self.accepted[s] = np.where(judged, DECAY * self.accepted[s] + (levels < accepted), self.accepted[s])
        self.window[s, d] += SMOOTHING * (width - self.window[s, d])
        if d:
            self.level_seconds += SMOOTHING * (draft_seconds / d - self.level_seconds)
        other = step_seconds - forward_seconds - (draft_seconds if d else 0.0)
        self.overhead_seconds += SMOOTHING * (other - self.overhead_seconds)

    def label(self, s: int, d: int) -> str:
        return "plain" if d == 0 else f"{self.names[s]}:{d}"

    def summary(self) -> dict:
        """What was chosen, how often, and each option's mean predicted speedup over plain decoding."""
        mean = self.predicted_sum / max(self.steps, 1)
        predicted = {self.label(s, d): round(float(mean[s, d]), 3)
                     for s in range(len(self.shapes)) for d in range(self.depth + 1) if d or s == 0}
        return {"shapes": dict(zip(self.names, self.shapes)), "choices": dict(self.choices),
                "predicted_speedup": predicted, "probe_every": PROBE_EVERY,
                "verify_curve_ms": {n: round(s * 1e3, 3) for n, s in sorted(self.curve.seconds.items())},
                "verify_curve_measured_now": self.measured_now, "note": self.note}


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
