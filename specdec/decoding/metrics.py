"""Counters of a speculative run and the metrics derived from them, each defined once here.

Counters (docs/design.md, "Metrics and conditions"), per run:

- steps: target verification forward passes (docs/design.md's step: the unit wall time is paid in).
- row_steps: verifications of one row; a step over B active rows adds B (at batch 1, row_steps =
  steps). Counting per row keeps τ a per-sequence figure, so plain decoding has τ = 1 at any
  batch size.
- proposed: draft tokens proposed; accepted: draft tokens the target accepted (the verifier's
  count, including any that a stop condition then cut off); emitted: tokens appended to rows.
- forced: emitted tokens that were drafts forced by a constraint's grammar (decoding/guided.py).
- accepted_per_position[i] / reached_per_position[i]: steps where draft i+1 was accepted /
  steps where draft i+1 was proposed and drafts 1..i were all accepted. For a tree (tree.py),
  position i + 1 is depth i + 1: a node there was accepted / the accepted path reached depth i and
  its last node had children. proposed counts every node.
- prefill_seconds (target prefill and proposer start); per step, the phases of the loop:
  propose_seconds, forward_seconds (the target's verification forward), acceptance_seconds,
  commit_seconds (emitting tokens, stop checks, cache rollback, the features along a tree's accepted
  path), observe_seconds (the proposer's bookkeeping and draft-cache updates), metrics_seconds (these
  counters); other_seconds: the rest of the run; first_token_seconds (start of the run to the first
  emitted token).
  draft_seconds = propose + observe; verify_seconds = forward + acceptance.

Derived: α = accepted / proposed; α_i = accepted_per_position[i] / reached_per_position[i];
p_i = reached_per_position[i] / (row steps where drafts 1..i were all accepted: row_steps for i = 0, else
accepted_per_position[i-1]), the chance that draft i+1 was proposed at all once reachable (1 for a
proposer that always drafts k, lower for n-gram lookup, which drafts only what it finds);
τ = emitted / row_steps (includes the recovered or bonus token); c = draft seconds per step /
one target single-token forward at the same batch size (`target_token_seconds`, measured by the
caller, e.g. from a k = 0 run; None when not measured); tokens/s = emitted / total seconds;
step_breakdown_ms: each phase's milliseconds per step. A position never drafted has no α_i (nor,
never reachable, p_i): `to_dict` leaves such positions out, so its α_i and p_i lists stop at the
deepest position drafted (reached positions come first: reaching depth i + 1 needs depth i accepted).
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import takewhile

PHASES = ("propose_seconds", "forward_seconds", "acceptance_seconds", "commit_seconds", "observe_seconds",
          "metrics_seconds")


def _ratio(num: float, den: float) -> float | None:
    return num / den if den else None


def _defined(values: list[float | None]) -> list[float]:
    """The values up to the first position that does not have one (never drafted: module docstring)."""
    return list(takewhile(lambda v: v is not None, values))


@dataclass
class SpecMetrics:
    k: int
    batch_size: int
    steps: int = 0
    row_steps: int = 0
    proposed: int = 0
    accepted: int = 0
    emitted: int = 0
    forced: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [k]
    reached_per_position: list[int] = field(default_factory=list)   # [k]
    prefill_seconds: float = 0.0
    propose_seconds: float = 0.0
    forward_seconds: float = 0.0
    acceptance_seconds: float = 0.0
    commit_seconds: float = 0.0
    observe_seconds: float = 0.0
    metrics_seconds: float = 0.0
    other_seconds: float = 0.0
    first_token_seconds: float | None = None
    target_token_seconds: float | None = None
    adaptive: dict | None = None  # k="auto": what was chosen and why (adaptive.Adaptive.summary)

    def __post_init__(self):
        self.accepted_per_position = self.accepted_per_position or [0] * self.k
        self.reached_per_position = self.reached_per_position or [0] * self.k

    @contextmanager
    def timed(self, counter: str):
        """Add the wall time of the block to the seconds counter named `counter`."""
        start = time.perf_counter()
        try:
            yield
        finally:
            setattr(self, counter, getattr(self, counter) + time.perf_counter() - start)

    def record_step(self, draft_lengths: list[int], accepted: list[int], emitted: list[int],
                    reached: list[int] | None = None) -> None:
        """One verification forward pass over every row of the batch, per row: drafts proposed, drafts
        accepted, tokens emitted, and for a tree the depths reached (tree.levels_reached; a chain:
        min(drafts, accepted + 1)) (plain counters: a few additions per row)."""
        self.steps += 1
        self.emitted += sum(emitted)
        if reached is None:
            reached = [min(drafts, n + 1) for drafts, n in zip(draft_lengths, accepted)]
        for drafts, n, depth in zip(draft_lengths, accepted, reached):
            self.row_steps += 1
            self.proposed += drafts
            self.accepted += n
            for i in range(depth):  # draft i+1 was reached, and accepted when i < n
                self.reached_per_position[i] += 1
                self.accepted_per_position[i] += i < n

    def record_phases(self, clock) -> None:
        """The phases of one step from its clock readings (`Clock`; "window": the verify window
        assembled, just before the target's forward, a gap left to other_seconds); the metrics' own
        time runs from "observed" to now."""
        r = clock.readings
        self.propose_seconds += r["proposed"] - r["start"]
        self.forward_seconds += r["forward"] - r["window"]
        self.acceptance_seconds += r["accepted"] - r["forward"]
        self.commit_seconds += r["committed"] - r["accepted"]
        self.observe_seconds += r["observed"] - r["committed"]
        self.metrics_seconds += time.perf_counter() - r["observed"]

    def __add__(self, other: "SpecMetrics") -> "SpecMetrics":
        """The counters of two runs with the same k added up (e.g. the batches of one benchmark
        cell); first-token time and the caller's target_token_seconds are not counters and are
        left unset."""
        if other.k != self.k:
            raise ValueError(f"cannot add the counters of runs with k={self.k} and k={other.k}")
        return SpecMetrics(
            self.k, self.batch_size,
            **{name: getattr(self, name) + getattr(other, name)
               for name in ("steps", "row_steps", "proposed", "accepted", "emitted", "forced", *PHASES,
                            "prefill_seconds", "other_seconds")},
            accepted_per_position=[a + b for a, b in zip(self.accepted_per_position, other.accepted_per_position)],
            reached_per_position=[a + b for a, b in zip(self.reached_per_position, other.reached_per_position)])

    @property
    def draft_seconds(self) -> float:
        return self.propose_seconds + self.observe_seconds

    @property
    def verify_seconds(self) -> float:
        return self.forward_seconds + self.acceptance_seconds

    @property
    def total_seconds(self) -> float:
        return self.prefill_seconds + sum(getattr(self, name) for name in PHASES) + self.other_seconds

    @property
    def step_breakdown_ms(self) -> dict[str, float | None]:
        """Milliseconds per step of each phase of the loop (and of the rest of the run)."""
        return {name.removesuffix("_seconds"): _ratio(getattr(self, name) * 1e3, self.steps)
                for name in (*PHASES, "other_seconds")}

    @property
    def acceptance_rate(self) -> float | None:
        """α."""
        return _ratio(self.accepted, self.proposed)

    @property
    def acceptance_per_position(self) -> list[float | None]:
        """α_i, i = 1..k."""
        return [_ratio(a, r) for a, r in zip(self.accepted_per_position, self.reached_per_position)]

    @property
    def proposal_rate_per_position(self) -> list[float | None]:
        """p_i, i = 1..k."""
        before = [self.row_steps, *self.accepted_per_position[:-1]]
        return [_ratio(r, b) for r, b in zip(self.reached_per_position, before)]

    @property
    def mean_acceptance_length(self) -> float | None:
        """τ."""
        return _ratio(self.emitted, self.row_steps)

    @property
    def draft_cost_ratio(self) -> float | None:
        """c."""
        if self.target_token_seconds is None or not self.steps:
            return None
        return self.draft_seconds / self.steps / self.target_token_seconds

    @property
    def tokens_per_second(self) -> float | None:
        return _ratio(self.emitted, self.total_seconds)

    @property
    def seconds_per_token(self) -> float | None:
        return _ratio(self.total_seconds, self.emitted)

    def to_dict(self) -> dict:
        return {
            "k": self.k, "batch_size": self.batch_size,
            "steps": self.steps, "row_steps": self.row_steps, "proposed": self.proposed,
            "accepted": self.accepted, "emitted": self.emitted, "forced": self.forced,
            "accepted_per_position": list(self.accepted_per_position),
            "reached_per_position": list(self.reached_per_position),
            "acceptance_rate": self.acceptance_rate,
            "acceptance_per_position": _defined(self.acceptance_per_position),
            "proposal_rate_per_position": _defined(self.proposal_rate_per_position),
            "mean_acceptance_length": self.mean_acceptance_length,
            "draft_cost_ratio": self.draft_cost_ratio,
            "prefill_seconds": self.prefill_seconds, "draft_seconds": self.draft_seconds,
            "verify_seconds": self.verify_seconds, "other_seconds": self.other_seconds,
            **{name: getattr(self, name) for name in PHASES}, "step_breakdown_ms": self.step_breakdown_ms,
            "total_seconds": self.total_seconds, "first_token_seconds": self.first_token_seconds,
            "target_token_seconds": self.target_token_seconds,
            "tokens_per_second": self.tokens_per_second, "seconds_per_token": self.seconds_per_token,
            "adaptive": self.adaptive,
        }


class Clock:
    """The clock readings of one step, by the name of the phase just ended ("chosen", "proposed",
    "window", "forward", "accepted", "committed", "observed"); the step's start is "start"."""

    def __init__(self):
        self.readings = {"start": time.perf_counter()}

    def mark(self, phase: str) -> None:
        self.readings[phase] = time.perf_counter()

    def __getitem__(self, phase: str) -> float:
        return self.readings[phase]

    @property
    def total(self) -> float:
        return time.perf_counter() - self.readings["start"]

    @property
    def forward(self) -> float:
        return self.readings["forward"] - self.readings["window"]

    @property
    def drafting(self) -> float:
        """The proposer's seconds: proposing and observing."""
        r = self.readings
        return r["proposed"] - r["chosen"] + r["observed"] - r["committed"]
