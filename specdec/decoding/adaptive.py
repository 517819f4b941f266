"""Adaptive speculation (`k="auto"`): before each step, choose how many levels to draft, and
whether as a chain or a tree, from what pays on this machine; 0 levels is plain decoding.

The predicted rate of an option (shape s, depth d) is tokens per second over the batch:

    rate(s, d) = Σ_rows E_b(s, d) / (t_B(n(s, d)) + draft(d) + overhead(d))

E_b from each row's decayed acceptance by depth with a prior (`acceptance`); t_B the target's verify
curve at the batch's size (calibration.py; the engine hands the curves over), scaled by what this run's
forwards took; draft and overhead from what the steps cost, a probe's catch-up on what the proposer
has not read priced apart (`catch_up`, `repays`). Plain decoding runs as stretches that double while a
probe one level deeper does not change the verdict (`choose`, `probe`); what a run learned carries over
to the next run of the same proposer (`remember`). docs/methods/auto.md tells the whole policy and why.

This module knows nothing about models or tokens: the engine hands it the verify curves and
reports each step's outcome.
"""
from __future__ import annotations

import math
import statistics
import weakref
from collections import Counter, deque
from typing import Callable

import numpy as np

from .costmodel import VerifyCurve
from .protocol import Joining

AUTO_DEPTH = 8                        # the deepest option considered
AUTO_TREE = (3, 2, 2, 1, 1, 1, 1, 1)  # the tree shape tried beside chains, for proposers that draft trees
PRIOR, PRIOR_WEIGHT = 0.7, 1.0        # q before any evidence: optimistic, so speculation gets tried
DECAY = 0.9                           # weight of a row's older steps per new one (about the last 10)
SMOOTHING = 0.2                       # running means of costs and windows
PROBE_EVERY = 16
HOLD = 4
MAX_STRETCH = 256
REMEMBERED_WEIGHT = 4.0               # the most pseudo-steps what earlier rows taught counts for in a new row
REMEMBERED_STRETCH = 2 * PROBE_EVERY  # the longest stretch a new run starts with (it re-checks early), unless
# the last run knew its acceptance too low to pay (then up to MAX_STRETCH)
CHEAP = 0.03                          # a probe predicted to cost less than this share of throughput is free
PLAUSIBLE = 1.64                      # how many standard errors above its estimate a q may plausibly lie (5%)

LEARNED = ("draft_share", "draft_measured", "draft_clean", "overhead_seconds", "overhead_measured", "forward_scale",
           "window", "probe_cost", "catch_ups")

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


def widest(shapes: dict[str, tuple[int, ...]]) -> tuple[int, ...]:
    """The most nodes per depth any of the shapes drafts (for the room a cache needs)."""
    return tuple(max(w) for w in zip(*shapes.values()))


def curve_batch(rows: int, capacity: int) -> int:
    """The batch size whose verify curve prices a step over `rows` rows: the next power of two, at most capacity."""
    return min(capacity, 1 << max(rows - 1, 0).bit_length())


def curve_batches(capacity: int) -> list[int]:
    """Every batch size whose verify curve a run of up to `capacity` rows may ask for (`curve_batch`)."""
    return sorted({curve_batch(rows, capacity) for rows in range(capacity + 1)})


class Adaptive:
    def __init__(self, curves: VerifyCurve | dict[int, VerifyCurve], rows: int,
                 shapes: dict[str, tuple[int, ...]], note: str | None = None, reading: float = 0.0):
        """curves: the target's verify curves by batch size (`curve_batches` of the capacity, the
        largest one), or one curve for every batch size; rows: the rows of the batch to begin with
        (more `join` later). reading: what the proposer's network costs a token it reads, as a share
        of the target's (protocol.Proposer.reading_size): until they are measured, its drafts are priced
        by it (`draft_estimates`), and its catch-up never below it (`catch_up_seconds`)."""
        self.curves: Callable[[int], VerifyCurve] = (
            (lambda rows: curves[curve_batch(rows, max(curves))]) if isinstance(curves, dict) else (lambda rows: curves))
        self.reading = reading
        self.names = list(shapes)
        self.shapes = [shapes[name] for name in self.names]
        self.depth = K = len(self.shapes[0])
        self.chain = next((i for i, w in enumerate(self.shapes) if max(w) == 1), None)  # the chain shape, if any
        S = len(self.shapes)
        self.accepted = np.zeros((S, rows, K))  # per shape and row: decayed counts by depth
        self.offered = np.zeros((S, rows, K))
        self.taught = np.zeros((2, S, K))  # (accepted, offered) counts of earlier runs
        self.seen = np.zeros((2, S, K))    # (accepted, offered) counts of this run's steps, every row, undecayed
        self.window = np.array([[1.0 + sum(w[:d]) for d in range(K + 1)] for w in self.shapes])  # (S, K+1)
        self.draft_share = np.zeros(K + 1)  # per depth, a step's draft seconds over a plain step's forward at its batch
        self.draft_measured = np.zeros(K + 1, dtype=bool)     # depth 0: never (it drafts nothing)
        self.draft_samples = [deque(maxlen=5) for _ in range(K + 1)]  # the latest shares per depth
        self.draft_clean = np.zeros(K + 1, dtype=bool)        # measured on a step without a catch-up
        self.confirm: tuple[int, int] | None = None           # a probe's option, drafted again at once
        self.episode: float | None = None                     # seconds lost to plain decoding since the last probe
        self.probe_cost = np.zeros(2)                         # (running mean of a probe's loss in seconds, probes)
        self.catch_ups = np.zeros(3)  # the measured catch-ups' (seconds, tokens), decayed, and how many (`catch_up`)
        self.catch_up_prior = reading * token_seconds(self.curves(1 << 30))  # before a switch measured it
        self.unread = np.zeros(rows)                          # per row: tokens the proposer has not read yet
        self.plain_run = 0                                    # plain steps since the last drafting step
        self.joined = False                                   # rows joined since the last drafting step
        self.stretch = PROBE_EVERY                            # plain steps before the next probe
        self.probes = 0
        self.held = 0                                         # steps the current choice still holds
        self.overhead_seconds = np.zeros(K + 1)  # per step: [0] of a plain stretch, [d] of a drafting step at depth d
        self.overhead_measured = np.zeros(K + 1, dtype=bool)
        self.forward_scale = np.ones(2)  # the run's forwards / the curve's: [0] plain steps, [1] drafting steps
        self.forward_samples = (deque(maxlen=5), deque(maxlen=5))  # the latest of each (`typical`)
        self.stopped = False             # plain decoding without probes: nothing would pay, every draft accepted
        self.hopeless = False            # nothing would pay at the plausible upper bounds of q either
        self.verdict = (0, False)        # (rows, hopeless) of the latest weighing at the most rows
        self.steps = 0        # steps decided (a plain stretch counts each of its steps)
        self.evaluations = 0  # times the options were weighed
        self.chosen: tuple[int, int] = (0, 0)
        self.choices: Counter = Counter()
        self.predicted_sum = np.zeros((S, K + 1))
        self.note = note
        self.memory, self.memory_key = None, None

    @classmethod
    def for_run(cls, curves: dict[int, VerifyCurve], proposer, widths: tuple[int, ...] | None,
                target_size: int = 0) -> "Adaptive":
        """Options for this proposer (`options`, the tree cut at each depth), priced by the target's
        verify curves at the batch sizes `curve_batches` of the capacity (the engine reads or
        measures them: calibration.verify_curves) and, until measured, by the proposer's reading as a
        share of the target's (`reading_size` over the target's `target_size`; 0: unknown); what earlier
        runs of this proposer (a drafter is made for one target) at the same capacity learned is recalled."""
        shapes, note = options(proposer, widths)
        reading = getattr(proposer, "reading_size", 0) / target_size if target_size else 0.0
        adaptive = cls(curves, 0, shapes, note, reading)
        try:
            memory = _MEMORY.setdefault(proposer, {})
        except TypeError:  # a proposer that cannot be weakly referenced starts afresh every run
            memory = {}
        adaptive.memory, adaptive.memory_key = memory, (max(curves), tuple(shapes.items()))
        adaptive.recall(memory.get(adaptive.memory_key))
        return adaptive

    def recall(self, learned: dict | None) -> None:
        if learned is None:
            return
        for name in LEARNED:
            setattr(self, name, learned[name].copy())
        self.draft_samples = [deque([s], maxlen=5) if seen else deque(maxlen=5)
                              for s, seen in zip(self.draft_share, self.draft_measured)]
        self.forward_samples = (deque([self.forward_scale[0]], maxlen=5),
                                deque([self.forward_scale[1]] if self.draft_measured.any() else [], maxlen=5))
        # a run that ended knowing no draft could plausibly pay does not make the next one probe early: a
        # probe after a stretch costs the proposer's catch-up on all of it (EAGLE's layer, a draft model's
        # forwards over every row), which a short run never earns back
        self.stretch = min(learned["stretch"], MAX_STRETCH if learned["hopeless"] else REMEMBERED_STRETCH)
        # earlier runs count for at most REMEMBERED_WEIGHT pseudo-steps, so this run's rows soon outweigh
        # them (a benchmark's next cell may sample at another temperature, with another acceptance)
        taught = learned["taught"]
        self.taught = taught * np.minimum(1.0, REMEMBERED_WEIGHT / np.maximum(taught[1], 1e-12))

    def remember(self) -> None:
        """Keep what this run learned for the next run (see the module docstring)."""
        if self.memory is None:
            return
        self.memory[self.memory_key] = {"taught": self.taught + self.seen, "stretch": self.stretch,
                                        "hopeless": self.verdict[1],
                                        **{name: getattr(self, name).copy() for name in LEARNED}}

    def finish(self) -> dict:
        """The run ended: what it learned kept (`remember`), what it chose returned (`summary`)."""
        self.remember()
        return self.summary()

    def join(self, joining: Joining) -> None:
        """Rows appended to the batch: they start from what every step so far taught (`prior`); their
        prompts are tokens the proposer reads with its first draft for them (`repays`)."""
        rows = len(joining.prompts)
        self.held = 0  # a choice held for the batch before is weighed again for this one
        self.joined = True  # the next drafting step reads their prompts: a catch-up, not a draft's price
        self.confirm = None  # so it would not price the draft alone either: whether it repays is weighed
        self.unread = np.concatenate([self.unread, np.asarray([len(p) for p in joining.prompts], dtype=float)])
        accepted, offered = self.prior()
        self.accepted = np.concatenate([self.accepted, np.repeat(accepted[:, None], rows, 1)], 1)
        self.offered = np.concatenate([self.offered, np.repeat(offered[:, None], rows, 1)], 1)

    def read(self, unread: list[int] | None) -> None:
        """What the proposer says each row has not read (Proposer.unread), in place of the count kept
        here (prompts joined, plain steps since a drafting step): a hybrid's draft model has not read
        the rows that lookup drafted, and catches up on them when it drafts for them again."""
        if unread is not None:
            self.unread = np.asarray(unread, dtype=float)

    def prior(self) -> tuple[np.ndarray, np.ndarray]:
        """(S, K) counts (accepted, offered) a row starts from: what every drafting step taught
        (`learned`), as at most REMEMBERED_WEIGHT pseudo-steps (fewer where there was less evidence:
        a depth seldom reached)."""
        mean, offered = self.learned()
        weight = np.minimum(offered, REMEMBERED_WEIGHT)
        return mean * weight, weight

    def learned(self) -> tuple[np.ndarray, np.ndarray]:
        """(S, K) the acceptance of every drafting step of this run and, remembered, of earlier ones,
        undecayed (a row's own decayed counts when it left were its low point if it stopped drafting:
        the rejections that made plain decoding win), and how many drafts it counts."""
        accepted, offered = self.taught + self.seen
        return accepted / np.maximum(offered, 1e-12), offered

    def leave(self, keep: list[int]) -> None:
        """Only rows `keep` stay, in that order (what the others taught is in `seen`)."""
        self.accepted, self.offered = self.accepted[:, keep], self.offered[:, keep]
        self.unread = self.unread[keep]
        self.held = 0

    def acceptance(self, bound: str = "estimate") -> np.ndarray:
        """(S, B, K) each row's q by shape and depth. "estimate": the decayed counts with a prior
        whose mean is PRIOR at depth 1 and, deeper, the estimate one level up (capped at PRIOR), so
        a depth seldom reached is judged like the one above it, not by the prior alone, and whose
        weight fades as the counts grow (the decayed counts stay near 1 / (1 - DECAY): a prior of
        constant weight would keep q of drafts never accepted at 7%, which pays for a free draft
        on a flat curve); "upper":
        the estimate plus PLAUSIBLE standard errors (capped at 1), what q may plausibly be;
        "lower": as many below it (at least 0), what q is plausibly at least; "certain": 1, every
        draft accepted."""
        if bound == "certain":
            return np.ones_like(self.accepted)
        weight = PRIOR_WEIGHT / (1 + self.offered)  # the prior fades as evidence comes
        n = self.offered + weight
        q = np.empty_like(self.accepted)
        prior = np.full(q.shape[:2], PRIOR)                                                  # (S, B)
        for j in range(q.shape[2]):
            q[..., j] = (self.accepted[..., j] + prior * weight[..., j]) / n[..., j]
            prior = np.minimum(q[..., j], PRIOR)
        if bound == "estimate":
            return q
        spread = PLAUSIBLE * np.sqrt(q * (1 - q) / n)
        return np.clip(q + spread if bound == "upper" else q - spread, 0.0, 1.0)

    def rates(self, bound: str = "estimate", draft: np.ndarray | None = None) -> np.ndarray:
        """(S, K+1) predicted tokens per second of each option over the batch's rows, with q at
        `bound` (`acceptance`); draft: the draft seconds by depth (default `draft_estimates`)."""
        q = self.acceptance(bound)                                                           # (S, B, K)
        E = 1 + np.concatenate([np.zeros(q.shape[:2] + (1,)), np.cumprod(q, 2).cumsum(2)], 2)  # (S, B, K+1)
        if draft is None:
            draft = self.draft_estimates(q.shape[1], least=bound in ("upper", "certain"))
        return E.sum(1) / (self.forward_estimates(q.shape[1]) + draft + self.overhead_estimates())

    def forward_estimates(self, rows: int) -> np.ndarray:
        """(S, K+1) seconds of each option's target forward: the verify curve at the option's
        window, scaled by what the run's forwards took against the curve (plain and drafting steps
        apart: a draft's work between forwards, the features a drafter reads, or a busier machine
        than when the curve was measured slow them down); before any drafting step, drafting's
        forwards are scaled as the plain steps' (a machine slower than the curve's must not make an
        unmeasured draft look cheaper than plain decoding)."""
        drafting = self.forward_scale[1] if self.draft_measured.any() else self.forward_scale[0]
        scale = np.where(np.arange(self.depth + 1) == 0, self.forward_scale[0], drafting)
        return self.curve_at(rows, self.window) * scale

    def curve_at(self, rows: int, width):
        """The verify curve at `rows` rows, interpolated at `width` tokens per row (a number or an array)."""
        curve = self.curves(rows)
        points = sorted(curve.seconds)
        return np.interp(width, points, [curve.seconds[n] for n in points])

    def draft_estimates(self, rows: int, least: bool = False) -> np.ndarray:
        """(K+1,) draft seconds per step over `rows` rows by depth: a plain step's forward at that batch
        times the depth's share of one (`draft_share`: a draft model's forward grows with the batch as the
        target's does, so drafting priced at one client is priced anew at four), measured, else scaled
        from the nearest measured depth; before any is measured, `reading` a level (a draft model a third
        of the target's size drafts a level in about a third of its step). least: the fewest of a
        depth's latest samples, what its draft plausibly costs (a busy machine only ever adds seconds:
        a stolen time slice, an eviction), for the plausible bounds."""
        plain = self.plain_forward(rows)
        measured = np.flatnonzero(self.draft_measured)
        if measured.size == 0:
            return self.reading * np.arange(self.depth + 1) * plain
        shares = self.draft_share
        if least:
            shares = np.array([min(samples, default=x) for samples, x in zip(self.draft_samples, shares)])
        depths = np.arange(self.depth + 1)
        nearest = measured[np.abs(depths[:, None] - measured[None]).argmin(1)]
        return plain * np.where(self.draft_measured, shares, shares[nearest] * depths / nearest)

    def overhead_estimates(self) -> np.ndarray:
        """(K+1,) the engine's own seconds per step by depth (a sampled row's verification costs more
        the more tokens it verifies): measured, else a drafting depth takes the nearest measured
        drafting depth's; before any drafting step, a plain step's (a drafting step does at least its
        bookkeeping); else 0."""
        estimates = np.where(self.overhead_measured, self.overhead_seconds, 0.0)
        measured = np.flatnonzero(self.overhead_measured[1:]) + 1
        if measured.size:
            depths = np.arange(1, self.depth + 1)
            estimates[1:] = self.overhead_seconds[measured[np.abs(depths[:, None] - measured[None]).argmin(1)]]
        else:
            estimates[1:] = estimates[0]
        return estimates

    def choose(self, horizon: float = math.inf, tokens: float = math.inf) -> tuple[int, tuple[int, ...], int | float]:
        """The depth to draft next, the widths per depth to draft it with, and for how many steps
        (1 when drafting; plain decoding: up to the next probe). A drafting choice that pays on
        measured costs even at the plausible lower bounds of q holds for HOLD steps before the
        options are weighed again (between probes): weighing costs tens of microseconds, and the
        estimates move slowly; one made on the prior or on thin evidence is weighed again after
        its step and, after a plain stretch, doubles the next stretch as a probe would. While plain decoding wins, each probe that does
        not change the verdict doubles the next stretch: up to MAX_STRETCH, without a cap where no
        option would pay even at the plausible upper bounds of q (`acceptance`), and no probe at
        all (math.inf steps, until the batch changes) where none would pay with every draft
        accepted: then its costs alone decide, and a probe cannot change the verdict.
        horizon: the most steps the batch may still run (a closed batch: its rows' largest budget;
        math.inf where rows may still come, as in a server): a probe informs only the steps after
        it, so one the steps left cannot repay is not made. tokens: the most tokens the rows in hand
        may still emit (the sum of their budgets): a catch-up on their tokens serves them alone
        (`repays`), rows that join later bring their own prompts to read."""
        if self.confirm is not None:  # a draft priced only with its catch-up: drafted again, priced alone
            self.chosen, self.confirm = self.confirm, None
            return self.chosen[1], self.shapes[self.chosen[0]][:self.chosen[1]], 1
        if self.held and (self.steps + 1) % PROBE_EVERY:
            self.held -= 1
            return self.chosen[1], self.shapes[self.chosen[0]][:self.chosen[1]], 1
        rates, rows = self.rates(), self.accepted.shape[1]
        plain = rates[0, 0]
        self.predicted_sum += rates / plain
        self.evaluations += 1
        s, d = np.unravel_index(np.argmax(rates), rates.shape)
        tokens = min(tokens, rows * horizon)  # the tokens a catch-up now can serve
        if d and not self.repays(rates[s, d], plain, rows, tokens):
            s, d = 0, 0
        if d == 0 and self.episode is not None:  # plain decoding again: what the drafting since the probe lost
            running_mean(self.probe_cost, self.episode)
            if self.episode < 0:  # it gained: the probe changed the verdict, the stretches start short again
                self.stretch = PROBE_EVERY
            self.episode = None
        steps, cap, self.stopped, self.hopeless = 1, MAX_STRETCH, False, False
        probing = d == 0 or (self.steps + 1) % PROBE_EVERY == 0  # plain wins, or a probe deeper than the best
        if probing:
            probed = self.rates("upper")  # a probe's shapes: those that could plausibly pay
            self.hopeless = bool(d == 0 and probed[:, 1:].max() < plain)  # acceptance known too low
            if self.hopeless:
                cap, probed = math.inf, self.rates("certain")
                self.stopped = probed[:, 1:].max() < plain and self.priced()
        if not self.hopeless:  # once a draft could plausibly pay again, the stretches' cap holds again
            self.stretch = min(self.stretch, MAX_STRETCH)
        if rows >= self.verdict[0]:  # the verdict of the fullest batch, for the next run (`remember`)
            self.verdict = (rows, self.hopeless)
        lower = self.rates("lower")
        # a probe that costs less than CHEAP of the throughput at the plausible lower bounds of q (n-gram
        # lookup on a flat verify curve) comes after every plain step: such matches come in bursts; and
        # none comes before the steps it follows are enough for what probes lost so far to be CHEAP of them
        stretch = max(1 if lower[:, 1].max() >= (1 - CHEAP) * plain else self.stretch, self.least_stretch(rows))
        if self.stopped:
            steps = math.inf
        elif d == 0 and self.plain_run < stretch:
            steps = stretch - self.plain_run
        elif d == 0 and horizon < stretch:
            # a probe informs the steps after it, its cost amortised over the stretches on both sides
            # of it: none with fewer steps left than the stretch before it (a closed batch's last one)
            steps = horizon
        elif probing:
            s, d = self.probe(rates, probed, stretch)
            if self.repays(rates[s, 1:].max(), plain, rows, tokens):
                self.probes += 1
            else:  # the estimated acceptance does not repay the probe's catch-up within the rows in hand's budgets
                s, d, steps = 0, 0, self.stretch  # (a draft model reading the prompts of the rows that joined)
            if self.plain_run:
                self.stretch = min(2 * self.stretch, cap)
        elif self.draft_measured[d] and lower[s, d] >= plain:
            self.stretch, self.held = PROBE_EVERY, HOLD - 1
        elif self.plain_run:  # drafting on thin evidence after a plain stretch: for the stretches, a probe
            self.stretch = min(2 * self.stretch, cap)
        self.chosen = (int(s), int(d))
        return self.chosen[1], self.shapes[self.chosen[0]][:self.chosen[1]], steps

    def repays(self, rate: float, plain: float, rows: int, tokens: float) -> bool:
        """Whether drafting at `rate` tokens per second (plain decoding's: `plain`) over `rows` rows now
        repays the proposer's catch-up on the tokens it has not read (`unread`: the prompts of rows that
        joined, the steps of a plain stretch) at `catch_up` seconds a token: drafting must save more than
        that over the `tokens` the rows may still emit, so not in the last few steps of a batch whose rows
        thin out near its end. Those tokens are the sum of the rows' budgets: the rows times the largest
        overcounts a row near its end (at 4 HumanEval clients of the pair, catch-ups of 225-351 tokens,
        0.3-0.7 s, were judged repaid by 2 rows x 50 tokens)."""
        cost = self.catch_up_seconds() * self.unread.sum()
        if cost <= CHEAP * self.plain_seconds(rows):  # lookup's, or none pending while drafting goes on
            return True
        gain = 1 / plain - 1 / rate  # seconds saved per token
        return tokens * gain >= cost

    def catch_up_seconds(self) -> float:
        """Seconds the proposer takes to read a token it has not read: measured (`catch_up`), but at least
        `reading` times the target's seconds a token where its forward is bound by compute (`token_seconds`):
        a few tokens read at one row cost about what one does (the weights are read once), hundreds over
        eight rows cost each its arithmetic, which a price measured on the few does not show."""
        return float(max(self.catch_up[0], self.catch_up_prior))

    def priced(self) -> bool:
        """Whether every measured depth that could pay (`could_pay`) has its price from at least two
        steps without a catch-up: only such prices may end the probing (one step's seconds may be a
        stolen time slice)."""
        return all(self.draft_clean[d] and len(self.draft_samples[d]) >= 2
                   for d in np.flatnonzero(self.draft_measured & self.could_pay().any(0)))

    def plain_seconds(self, rows: int) -> float:
        """A plain step's predicted seconds over `rows` rows: its forward and the engine's overhead."""
        return self.plain_forward(rows) + float(self.overhead_estimates()[0])

    def plain_forward(self, rows: int) -> float:
        """A plain step's forward over `rows` rows (`forward_estimates`' first column, alone): the unit
        a draft's cost is kept in."""
        return float(self.curve_at(rows, 1)) * float(self.forward_scale[0])

    def least_stretch(self, rows: int) -> int:
        """The fewest plain steps before a probe: enough for what a probe loses against plain decoding
        to be at most CHEAP of their time: what probes lost on average (`probe_cost`, the confirming
        step included; 0 while they gained), and at least the proposer's catch-up on what it will
        not have read by then (`catch_up` seconds a token: the prompts, `rows` tokens a plain step),
        which grows with the stretch (unless a plain step's share of it alone is more than CHEAP of the
        step: then no probe is cheap)."""
        cheap = CHEAP * self.plain_seconds(rows)
        cost, probes = self.probe_cost
        least = math.ceil(cost / cheap) if probes and cost > 0 else 0
        per_token, switches = self.catch_up
        if not switches or per_token * rows >= cheap:  # not measured yet, or no probe is cheap
            return least
        more = (per_token * self.unread.sum() - cheap * self.plain_run) / (cheap - per_token * rows)
        return max(least, self.plain_run + math.ceil(max(more, 0.0)))

    def probe(self, rates: np.ndarray, probed: np.ndarray, stretch: int | float) -> tuple[int, int]:
        """The shape and depth of a probe: one level deeper than the shape's best, cycling through
        the shapes that could pay with q at the bound `probed` holds (the plausible upper bounds, or
        where none could pay at those, every draft accepted: a tree whose window costs more than
        its drafts could ever save at this batch size is not probed), but a probe after every plain
        step in the shape that pays best."""
        shapes = np.flatnonzero(probed[:, 1:].max(1) >= rates[0, 0])
        if shapes.size == 0:  # none pays even so, on prices not yet `priced`: probe to price a draft alone
            shapes = np.arange(len(self.shapes))
        s = shapes[self.probes % len(shapes)] if stretch > 1 else shapes[rates[shapes, 1].argmax()]
        return int(s), min(self.depth, int(rates[s].argmax()) + 1)

    def observe(self, limits: list[int], accepted: list[int], width: int, draft_seconds: float,
                step_seconds: float, forward_seconds: float, chain: list[int] | None = None) -> None:
        """What the chosen step did: per row the levels it allowed and the drafts accepted, the
        window the target verified, and the seconds spent drafting, in the whole step and in the
        target's forward. chain: for a tree, per row the drafts of its first children accepted
        (tree.chain_runs), which the chain would have had accepted at the same depth: the chain's
        counts learn from it too (a chain judged on a few unlucky first steps, then never drafted
        while a tree of the same drafter was, kept its low estimate: the 0.5B draft of a 1.5B target
        stayed at a tree of depth 1 where a chain of 3 paid more; docs/methods/auto.md)."""
        s, d = self.chosen
        rows = len(limits)
        first = self.steps == self.choices["plain"]  # the run's first drafting step
        self.steps += 1
        self.choices[self.label(s, d)] += 1
        limits, accepted = np.asarray(limits)[:, None], np.asarray(accepted)[:, None]  # (B, 1)
        self.count(s, limits, accepted)
        if chain is not None and self.chain not in (None, s):
            self.count(self.chain, limits, np.asarray(chain)[:, None])
        self.window[s, d] += SMOOTHING * (width - self.window[s, d])
        # robust to the spikes of a first step (lazy set-up, cold caches) or a busy machine: the
        # fewest seconds of up to 2 samples, the median of 3..5. A step after a plain stretch also fed
        # the proposer what the stretch committed (its catch-up, proposers/base.py), and the run's
        # first drafting step fed it the prompts (a draft model reads them lazily, hundreds of
        # tokens): such a step's seconds price a depth only until a step without a catch-up does,
        # which replaces them, and the next steps draft the same option again until two steps
        # without one priced it (`confirm`, `priced`); the first step's seconds leave the depth
        # unmeasured. Priced at a catch-up, a draft always accepted did not pay, and auto decoded
        # plainly from then on, never drafting to learn otherwise (docs/methods/auto.md)
        clean = not (self.plain_run or self.joined or first)
        self.joined = False
        unread = self.unread.sum()
        plain = self.plain_forward(rows)  # a plain step's forward at this batch: the draft's unit
        if not clean and self.draft_clean[d] and unread:  # catching up beyond the depth's price, per token
            self.price_catch_up(draft_seconds - self.draft_share[d] * plain, unread)
        self.unread[:] = 0
        samples = self.draft_samples[d]
        if clean and not self.draft_clean[d]:
            samples.clear()
        if clean or not self.draft_measured[d]:
            samples.append(draft_seconds / plain)
            # the mean, not a typical step: a hybrid's steps cost next to nothing where lookup drafts every row
            # and seconds where its model catches up on rows lookup drafted before; what drafting costs is their mean
            self.draft_share[d] = statistics.fmean(samples)
            self.draft_measured[d] |= not first
            self.draft_clean[d] |= clean
        if not (self.draft_clean[d] and len(samples) >= 2) and self.could_pay()[s, d]:
            self.confirm = (s, d)
        # what this step lost against plain decoding's steps for the same tokens, counted from a probe on
        lost = step_seconds - self.plain_seconds(rows) * (1 + accepted.sum() / rows)
        self.episode = lost if self.plain_run else None if self.episode is None else self.episode + lost
        self.plain_run = 0
        self.scale_forwards(1, forward_seconds / float(self.curve_at(rows, width)))
        other = step_seconds - forward_seconds - draft_seconds
        self.running_overhead(d, other)

    def price_catch_up(self, seconds: float, tokens: float) -> None:
        """A catch-up on `tokens` took `seconds` beyond its depth's price: the price a token is the catch-ups'
        seconds over their tokens, older ones fading by 1 - SMOOTHING each, so a large catch-up weighs by its
        tokens. (A running mean of each one's seconds per token let the many small catch-ups of a client's
        plain stretches, a few tokens in one forward, price the large ones: at 4 clients of the Qwen2.5-Coder
        pair the 0.5B read 500 prompt tokens at 1.8 ms each, priced at 0.7, and its probes cost 5-13% of
        plain serving; docs/methods/auto.md.)"""
        self.catch_ups = np.array([*(1 - SMOOTHING) * self.catch_ups[:2] + (seconds, tokens), self.catch_ups[2] + 1])

    @property
    def catch_up(self) -> tuple[float, int]:
        """(seconds per token not read, catch-ups measured): the measured catch-ups' seconds over their
        tokens (`price_catch_up`); (0, 0) before any."""
        seconds, tokens, measured = self.catch_ups
        return (seconds / tokens if measured else 0.0), int(measured)

    def count(self, s: int, limits: np.ndarray, accepted: np.ndarray) -> None:
        """Shape s's decayed counts after a step that allowed each row limits[b] levels (B, 1), of
        which accepted[b] were accepted: the levels judged are those up to the first rejection."""
        levels = np.arange(self.depth)[None]                                   # (1, K)
        judged = levels < np.minimum(limits, accepted + 1)
        hits = judged & (levels < accepted)
        self.offered[s] = np.where(judged, DECAY * self.offered[s] + 1, self.offered[s])
        self.accepted[s] = np.where(judged, DECAY * self.accepted[s] + hits, self.accepted[s])
        self.seen[:, s] += np.stack([hits.sum(0), judged.sum(0)])

    def could_pay(self) -> np.ndarray:
        """(S, K+1) which options would pay were every draft accepted and free: only for those does a
        depth's price without a catch-up matter (`confirm`, `priced`)."""
        return self.rates("certain", draft=np.zeros(self.depth + 1)) >= self.rates()[0, 0]

    def observe_plain(self, steps: int, seconds: float, forward_seconds: float) -> None:
        """A plain stretch of `steps` steps took `seconds`, `forward_seconds` of them in forwards. The
        text moved on: each row's acceptance drifts back to what every drafting step taught, as its
        older steps fade while drafting (DECAY a step), its weight of evidence kept. A row that went
        plain after a dip of its estimate (one over about ten drafts, each accepted 40% of the time
        independently, now and then falls below break-even) kept the dip's low point for every
        stretch after it (docs/methods/auto.md)."""
        mean, offered = self.learned()                                              # (S, K)
        fade = DECAY ** steps
        drifted = fade * self.accepted + (1 - fade) * self.offered * mean[:, None]  # (S, B, K)
        self.accepted = np.where((offered > 0)[:, None], drifted, self.accepted)
        self.steps += steps
        self.plain_run += steps
        self.unread += steps
        self.choices["plain"] += steps
        if steps:
            self.running_overhead(0, (seconds - forward_seconds) / steps)
            self.scale_forwards(0, forward_seconds / steps / float(self.curve_at(self.accepted.shape[1], 1)))

    def scale_forwards(self, drafting: int, scale: float) -> None:
        """A step's (or a plain stretch's) forwards took `scale` times the curve's: the scale of plain
        (0) or drafting (1) steps is the `typical` of the latest ones (a running mean took in one slow
        forward, a stolen time slice, and made EAGLE's drafts look dearer than plain decoding for the
        rest of a benchmark: plain steps do not re-price drafting's forwards; docs/methods/auto.md)."""
        samples = self.forward_samples[drafting]
        samples.append(scale)
        self.forward_scale[drafting] = typical(samples)

    def running_overhead(self, d: int, seconds: float) -> None:
        """The overhead at depth d: its first measurement, then a running mean."""
        if self.overhead_measured[d]:
            self.overhead_seconds[d] += SMOOTHING * (seconds - self.overhead_seconds[d])
        else:
            self.overhead_seconds[d], self.overhead_measured[d] = seconds, True

    def label(self, s: int, d: int) -> str:
        return "plain" if d == 0 else f"{self.names[s]}:{d}"

    def summary(self) -> dict:
        """What was chosen, how often, and each option's mean predicted speedup over plain decoding."""
        mean = self.predicted_sum / max(self.evaluations, 1)
        predicted = {self.label(s, d): round(float(mean[s, d]), 3)
                     for s in range(len(self.shapes)) for d in range(self.depth + 1) if d or s == 0}
        return {"shapes": dict(zip(self.names, self.shapes)), "choices": dict(self.choices),
                "predicted_speedup": predicted, "probe_every": PROBE_EVERY,
                "stopped_probing": bool(self.stopped), "note": self.note}


def token_seconds(curve: VerifyCurve) -> float:
    """The target's seconds a token where its forward is bound by compute (a prompt's, a wide window's):
    the curve's slope per row between its narrowest and its widest window; 0 from a one-point curve."""
    widest = max(curve.seconds)
    if widest == 1:
        return 0.0
    return max(curve.seconds[widest] - curve.seconds[1], 0.0) / (curve.batch_size * (widest - 1))


def typical(samples) -> float:
    """What a step's seconds typically are, robust to the spikes of a first step (lazy set-up, cold
    caches) or a busy machine: the fewest of up to 2 samples, the median of 3 or more."""
    return min(samples) if len(samples) < 3 else statistics.median(samples)


def running_mean(pair: np.ndarray, value: float) -> None:
    """Update pair = (running mean, samples) in place with `value`: the first sample, then SMOOTHING."""
    mean, n = pair
    pair[:] = (value if not n else mean + SMOOTHING * (value - mean), n + 1)


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
