"""Speculative decoding as a step loop: propose -> verify -> accept -> commit -> observe, over a batch
of requests that join and leave between steps (continuous batching).

Every row is one request with its own sequence, sampling settings, generator, stop rule and stream.
The target's cache lags one token behind each sequence: the newest token ("last") opens the next
window [last, drafts], scored by ONE target forward for all rows (a tree's nodes with positions by
depth and a tree mask: tree.py). Tokens are emitted one at a time (`stopping.emit_runs`), so a stop
cuts exactly inside an accepted run; the cache rolls back to what was kept and the proposer hears
what was committed. Depth 0 is plain decoding in lean one-token steps (`plain_step`), as is a step
whose proposer found nothing. Each step's depth and shape come from a schedule (protocol.Schedule):
a fixed k's, or k = "auto"'s choice of what pays (adaptive.py). Between steps rows leave and join
through one seam (protocol.RowState: the cache, the proposer, the constraint guide, the schedule).
The host reads the device once per step where it can (syncs.py counts these points).

This module knows nothing about particular proposers (proposers/), acceptance rules (verify.py),
model internals (lm/) or serving (serve/).
"""
from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field
from functools import partial
from typing import Callable

import torch

from ..errors import SpecdecError
from ..lm.interface import Admitted, admit, body_size, declared_features, layer_request, prefill_joining
from ..lm.kv_cache import BLOCK, blocks_for
from .adaptive import Adaptive, curve_batches, options, widest
from .calibration import verify_curves
from .constraint import Compiled, FirstToken, masked
from .guided import Guide
from .metrics import Clock, SpecMetrics
from .protocol import Drafting, Fixed, Joining, NoDraft, Outcome, Proposal, Proposer, RowState
from .sampling import Draws, RowGenerators, SamplingConfig, pick_rows
from .stopping import Row, StopRule, emit, emit_runs
from .tree import chain_positions, chain_runs, levels_reached, path_columns, window_layout
from .verify import Verdict, by_kind, rejection_sample, tree_rejection_sample


@dataclass(eq=False)
class Request:
    """One sequence to generate. `on_tokens(request, tokens, drafted)` is called from the engine's
    thread after every step that emitted tokens for it (the first `drafted` of them were accepted
    drafts, the rest chosen by the target), and once with no tokens when it finishes without
    running; `cancelled` may be set from any thread: the row leaves at the next step."""
    prompt: list[int]
    rule: StopRule
    sampling: SamplingConfig = SamplingConfig()
    generator: torch.Generator | None = None
    on_tokens: Callable[["Request", list[int], int], None] | None = None
    constraint: Compiled | FirstToken | None = None  # structured output's grammar (guided.py), or a healed
    # prompt's rule for its first token (pipeline.py)
    cancelled: bool = False
    row: Row = field(init=False)
    steps: int = 0      # verifications of this row
    proposed: int = 0   # drafts proposed for it
    accepted: int = 0   # of which the target accepted

    def __post_init__(self):
        self.row = Row(self.rule)

    @property
    def finished(self) -> bool:
        return self.row.done or self.cancelled


def compacted(staying: list[bool]) -> list[int]:
    """The rows that stay, in the order that moves fewest of them in a cache's regroup (kv_cache.py):
    each keeps its place below the new row count, and the holes there are filled by the staying rows
    above it."""
    n = sum(staying)
    above = iter([b for b in range(n, len(staying)) if staying[b]])
    return [b if staying[b] else next(above) for b in range(n)]


class Engine:
    def __init__(self, admitted: Admitted, proposer: Proposer | None, k: int | str, capacity: int, max_len: int,
                 *, widths: tuple[int, ...] | None = None, sampled_verify=rejection_sample,
                 tree_verify=tree_rejection_sample, forced_drafts: bool = True, name: str = "the target",
                 kv_dtype: torch.dtype | None = None, kv_tokens: int | None = None, share_prefixes: bool = True):
        """admitted: the target as admitted at load (lm.interface.admit); proposer None: plain decoding
        (k must be 0; `NoDraft`). k: drafts per step, or "auto" (adaptive.py: the target's verify curves
        at every batch size up to `capacity` are read, or measured now and stored, said on stderr with
        `name`; `verify_curve_seconds` says how long that took); widths: the most drafts per depth (len k;
        default a chain; with "auto", the tree tried beside chains). capacity: the most rows in the batch;
        max_len: the longest sequence (prompt + generated) a row may reach. `sampled_verify` and
        `tree_verify`: the acceptance rules of sampled rows for chains and trees (tests replace them to
        show a wrong rule is detected). forced_drafts: constrained rows propose the tokens their grammar
        forces in place of the drafter's (guided.py; needs k >= 1). kv_dtype: the target's KV cache dtype
        (default its compute dtype); kv_tokens: the positions its pool holds (default every row's
        worst case, `blocks_needed` of max_len + 1 positions): a request joins when its worst case fits
        beside the rows' (`promise`), else it waits.
        share_prefixes: joining prompts map the blocks of leading tokens already in the cache
        (lm/kv_cache.py) where the proposer does not read prompt features."""
        self.started = time.perf_counter()  # first_token_seconds and other_seconds count from here
        self.admitted = admitted
        self.model, self.context = admitted.model, admitted.context
        if proposer is None:
            if k != 0:
                raise SpecdecError(f"plain decoding (no proposer) drafts nothing: k must be 0, got {k!r}; "
                                   "give a proposer to draft")
            proposer = NoDraft()
        self.widths = check_setup(self.model, proposer, k, widths)  # auto's: checked before the curves are measured
        self.schedule, self.verify_curve_seconds = Fixed(self.widths), 0.0
        if k == "auto":  # verify windows up to the widest shape's, at every batch size up to capacity
            batches = curve_batches(capacity)
            curves, self.verify_curve_seconds = verify_curves(admitted, batches, 1 + sum(self.widths), name)
            self.schedule = Adaptive.for_run(curves, proposer, widths, body_size(self.model))
        self.proposer, self.k, self.capacity, self.max_len = proposer, self.schedule.depth, capacity, max_len
        self.device = self.admitted.device
        self.sampled_verify, self.tree_verify = sampled_verify, tree_verify
        self.features = getattr(proposer, "features", ())  # target layers it reads: () = final hidden states
        nodes = sum(self.widths)
        self.window_room = nodes  # beyond prompt + max_new_tokens: a verification window past the committed entries
        if kv_tokens is None:  # every row's worst case (blocks_needed)
            kv_tokens = capacity * blocks_for(max_len + 1 + nodes) * BLOCK
        self.cache = self.model.new_cache(capacity, max_len + nodes, kv_dtype, tokens=kv_tokens)
        self.cache.regroup([])
        self.share = (share_prefixes and self.cache.pool is not None
                      and not getattr(proposer, "prompt_features", True))
        # a draft of the target's own shapes reads the target's cache (protocol.py)
        shared = {"target_cache": self.cache} if getattr(proposer, "reads_target_cache", False) else {}
        self.drafting = Drafting(proposer, proposer.start(max_len, self.k, capacity, nodes, **shared))
        self.guide = Guide(self.model.config.vocab_size, forced_drafts)  # constrained rows (guided.py)
        # what keeps state per row beside the lists below, joining in this order (protocol.RowState)
        self.holders: list[RowState] = [TargetRows(self.model, self.cache, self.features, self.share),
                                         self.drafting, self.guide, self.schedule]
        self.requests: list[Request] = []  # (B,) the rows, in cache order
        self.last: list[int] = []          # (B,) newest token of each row, not in the cache
        self.cached: list[int] = []        # (B,) the target cache's lengths
        self.next_window: torch.Tensor | None = None  # (B, 1) `last` on the device, where a plain step left it
        self.waiting: deque[Request] = deque()
        self.plain_left = 0  # steps left in the current stretch of plain decoding (inf: until the batch changes)
        self.plain = PlainStretch([])
        self.closed = False  # a closed batch (`run`): no request comes after those given, so auto knows the steps left
        self.metrics = SpecMetrics(k=self.k, batch_size=capacity)

    def submit(self, request: Request) -> None:
        """Queue a request (any thread); it joins the batch at the next step with room."""
        check_prompt(request.prompt, request.rule, self.model.config.vocab_size,
                     min(self.context, self.max_len), "the prompt")
        self.check_memory(len(request.prompt), request.rule.max_new_tokens)
        self.waiting.append(request)

    def blocks_needed(self, prompt: int, max_new_tokens: int) -> int:
        """The most blocks a row may hold: its prompt, every new token, a verification window."""
        return blocks_for(prompt + max_new_tokens + self.window_room)

    def check_memory(self, prompt: int, max_new_tokens: int, budget: str = "max_new_tokens") -> None:
        """Refuse a request whose row could never fit the target's KV cache, even alone (any thread)."""
        pool, needed = self.cache.pool, self.blocks_needed(prompt, max_new_tokens)
        if pool is not None and needed > pool.blocks:
            raise SpecdecError(
                f"the prompt ({prompt} tokens) with {budget}={max_new_tokens} needs {needed * BLOCK} positions of "
                f"KV cache but the whole cache holds {pool.blocks * BLOCK}: lower {budget} or shorten the prompt "
                "(a server: give it a larger --kv-budget)")

    def promise(self, request: Request) -> int | None:
        """Set the blocks of a request's worst case aside in the target's pool, less those of a prefix it
        will share; None: they are not free now (it waits)."""
        pool = self.cache.pool
        if pool is None:
            return 0
        found = pool.lookup(request.prompt[:-1]) if self.share else []
        need = self.blocks_needed(len(request.prompt), request.rule.max_new_tokens) - len(found)
        return need if pool.promise(need, taken=sum(pool.refs[b] == 0 for b in found)) else None

    @property
    def busy(self) -> bool:
        return bool(self.requests or self.waiting)

    def run(self, requests: list[Request]) -> SpecMetrics:
        """A closed batch: submit the requests, step until every one is done; the run's metrics
        (other_seconds: the time since the engine was made not spent in a counted phase)."""
        for request in requests:
            self.submit(request)
        self.closed = True
        while self.busy:
            self.step()
        metrics = self.metrics
        metrics.batch_size = len(requests)
        metrics.other_seconds = time.perf_counter() - self.started - metrics.total_seconds
        metrics.adaptive = self.schedule.finish()
        return metrics

    @torch.inference_mode()
    def step(self) -> None:
        """Regroup, then advance every row by one verification (or one step of plain decoding)."""
        self.regroup()
        if not self.requests:
            return
        clock = Clock()
        depth, shape = self.choose()
        if self.plain_left:
            self.plain_stretch()
            return
        clock.mark("chosen")
        guide = self.constrained  # this step's, though its rows may go free as they commit
        limit = draft_limits([r.row.budget for r in self.requests], depth)
        limits, last = torch.tensor([limit, self.last], device=self.device)  # (B,) each, one copy
        self.next_window = None
        proposal = self.propose(limits, limit, shape, guide)                                  # propose
        clock.mark("proposed")
        if not proposal.tokens.shape[1]:  # nothing found (n-gram lookup): a plain step
            self.plain_left = 1
            self.plain_step()
            return
        window = torch.cat([last[:, None], proposal.tokens], 1)                 # (B, 1+m): [last, drafts]
        forced = guide is not None and guide.forced_only(proposal)  # every draft forced: certain, only the column after them decides
        out = self.verify_forward(window, proposal, clock, proposal.lengths[:, None] if forced else None)  # verify
        verdict = (self.after_forced(proposal, out.logits) if forced                     # accept: logits (B, 1, V)
                   else self.accept(proposal, self.masked(out.logits, proposal)))        # or (B, 1+m, V)
        # what the host needs of the step, read from the device at once: (B, 3 + m)
        read = torch.cat([verdict.accepted[:, None], verdict.next_token[:, None], proposal.lengths[:, None],
                          proposal.tokens], 1).tolist()
        accepted, next_tokens, lengths = ([row[i] for row in read] for i in range(3))
        clock.mark("accepted")
        outcome = self.commit([row[3:] for row in read], accepted, verdict, next_tokens, out, guide)  # commit
        clock.mark("committed")
        self.observe(outcome, guide)                                                           # observe
        clock.mark("observed")
        self.metrics.record_step(lengths, accepted, outcome.counts, None if verdict.paths is None
                                 else levels_reached(proposal.parents, lengths, verdict.paths))
        self.metrics.record_phases(clock)
        self.metrics.first_token_seconds = self.metrics.first_token_seconds or clock["committed"] - self.started
        stream(self.requests, outcome.tokens, outcome.counts, lengths, accepted)
        chain = None if verdict.paths is None else chain_runs(proposal.parents, verdict.paths)
        self.schedule.observe(limit, accepted, window.shape[1], clock.drafting, clock.total, clock.forward, chain)

    def propose(self, limits: torch.Tensor, limit: list[int], shape: tuple[int, ...], guide: Guide | None
                ) -> Proposal:
        """The proposer's drafts, at most limits[b] (B,; on the host: limit) levels per row in `shape`;
        with constrained rows, drafted under their grammars, forced runs in place of drafts and chains
        cut where they leave the grammar (guided.py). A seeded row's first draft: position cached + 1."""
        draws = Draws(self.generator(), [c + 1 for c in self.cached], guide and guide.drafting())
        proposal = self.drafting.propose(limits, shape, draws).trimmed()
        if guide:
            cut = [proposal.draft_probs is None or r.sampling.greedy or r.sampling.seeded for r in self.requests]
            proposal = guide.propose(proposal, limit, cut).trimmed()
        return proposal

    def choose(self) -> tuple[int, tuple[int, ...]]:
        """This step's depth and shape, the schedule's choice (a depth of 0 starts a stretch of plain steps)."""
        if self.plain_left:
            return 0, ()
        budgets = [r.row.budget for r in self.requests]  # the rows in hand end within the largest, and so
        self.schedule.read(self.drafting.unread())        # does a closed batch with nobody waiting
        depth, shape, stretch = self.schedule.choose(max(budgets) if self.closed and not self.waiting else math.inf,
                                                     sum(budgets))
        if depth == 0:
            self.plain_left = stretch
        return depth, shape

    def plain_stretch(self) -> None:
        """Plain steps: one, or, when nobody streams from the rows and nobody waits (a closed batch:
        speculative_generate), the whole stretch without returning to the caller for every token."""
        self.plain_step()
        while self.plain_left and not self.waiting and not any(
                r.on_tokens is not None or r.finished for r in self.requests):
            self.plain_step()

    def verify_forward(self, window: torch.Tensor, proposal: Proposal, clock: Clock,
                       logits_index: torch.Tensor | None = None):
        """The target's forward over [last, drafts] (B, 1+m): a chain at the default positions, a tree
        with positions by depth and its attention mask; the declared layers come back with it.
        logits_index (B, N): the columns whose logits are computed (default all)."""
        positions, tree = self.layout(window.shape[1], proposal)
        clock.mark("window")
        out = self.model(window, positions=positions, cache=self.cache, attention_mask=tree,
                         logits_index=logits_index, **layer_request(self.features))
        clock.mark("forward")
        return out

    def layout(self, width: int, proposal: Proposal | None = None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The positions (B, width) and tree attention mask of the next window after each row's cached
        tokens (tree.py): a chain's, or a plain step's (proposal None), at the model's default positions
        (None, no mask) but near the context's end; a tree's by depth, with its mask."""
        if proposal is None or proposal.parents is None:
            return chain_positions(self.cached, width, self.context, self.device), None
        return window_layout(proposal.parents, proposal.lengths.tolist(), self.cached, self.context)

    def masked(self, logits: torch.Tensor, proposal: Proposal) -> torch.Tensor:
        """logits (B, 1+m, V) with the tokens each constrained row's grammar refuses at each window
        column set to -inf (guided.py), so that every acceptance rule sees the masked target."""
        guide = self.constrained
        return logits if guide is None else masked(logits, guide.window_masks(proposal))

    def after_forced(self, proposal: Proposal, logits: torch.Tensor) -> Verdict:
        """The verdict on a window of forced drafts alone (guided.py): each is the one token its row's
        grammar allows, so every acceptance rule accepts it (its masked probability is 1); the token
        after them is picked, as in a plain step, from the logits (B, 1, V) of the column after each
        row's drafts, masked (a seeded row's noise: that column's position)."""
        lengths = proposal.lengths.tolist()
        masks = self.guide.after_masks(proposal)  # (B, W)
        picked = pick_rows(masked(logits[:, 0], masks), [r.sampling for r in self.requests], self.generator(),
                           [c + 1 + n for c, n in zip(self.cached, lengths)])
        return Verdict(proposal.lengths, picked.to(self.device))

    def commit(self, drafts: list[list[int]], accepted: list[int], verdict: Verdict, next_tokens: list[int],
               out, guide: Guide | None) -> Outcome:
        """Emit each row's run (emit_runs), keep what the target computed along what was emitted: its
        cache entries (a tree's accepted path moved to follow the root) and, for the proposer, its
        features in the verify forward `out`; open the next window with the newest token; the constrained
        rows' grammars move on. Returns the step's Outcome: the runs, the counts emitted and those features."""
        paths = verdict.paths or [range(n) for n in accepted]
        runs, counts = emit_runs([r.row for r in self.requests], drafts, paths, next_tokens)
        if verdict.paths is not None:  # keep the window entries that predicted an emitted token
            self.cache.compact(self.cached, verdict.paths)
        self.cached = [n + c for n, c in zip(self.cached, counts)]
        self.cache.rollback(self.cached)
        self.last = [run[n - 1] if n else old for run, n, old in zip(runs, counts, self.last)]
        if guide:
            guide.commit(runs, counts)
            self.metrics.forced = guide.forced
        return Outcome(accepted, runs, counts, self.features_along(out, verdict), verdict.paths)

    def observe(self, outcome: Outcome, guide: Guide | None) -> None:
        """The proposer learns what was committed (of a forced run, that none of its drafts was accepted)."""
        self.drafting.observe(guide.outcome(outcome) if guide else outcome)

    def features_along(self, out, verdict: Verdict) -> torch.Tensor:
        """The declared features (B, 1+m, ...) of the verify forward, along a tree's accepted path."""
        hidden = declared_features(out, self.features)
        if verdict.paths is None:
            return hidden
        return hidden.gather(1, path_columns(verdict.paths, hidden.shape[1], self.device)[..., None]
                             .expand_as(hidden))

    def plain_step(self) -> None:
        """One step of plain decoding, one token per row, as lean as decoding without a proposer.
        The tokens and hidden states are kept for the proposer, which hears of the whole stretch of
        plain steps at once when it ends (`end_plain`); with k = 0 it never drafts and hears nothing."""
        B, clock, metrics = len(self.requests), time.perf_counter, self.metrics
        t_start = clock()
        window = self.next_window
        if window is None:
            window = torch.tensor(self.last, device=self.device)[:, None]
        out = self.model(window, cache=self.cache, positions=self.layout(1)[0], **layer_request(self.features))
        t_forward = clock()
        guide = self.constrained
        logits, masks = out.logits[:, -1], guide and guide.next_masks()  # (B, V); masks (B, W): None without constraints
        picked = self.pick(logits if masks is None else masked(logits, masks))
        tokens = picked.tolist()
        counts = [emit(r.row, [token], 1) for r, token in zip(self.requests, tokens)]
        if masks is not None:
            guide.commit([[t] for t in tokens], counts)
            metrics.forced = guide.forced
        self.next_window = picked[:, None] if all(counts) else None
        self.last = [token if n else old for token, n, old in zip(tokens, counts, self.last)]
        self.cached = [c + n for c, n in zip(self.cached, counts)]
        if not all(counts):
            self.cache.rollback(self.cached)  # rows already done keep their length
        if self.k:  # the proposer drafts again after the stretch: it will read these tokens
            plain = self.plain
            if not plain.steps:
                plain.tokens = [[] for _ in range(B)]
            for row, token, n in zip(plain.tokens, tokens, counts):
                row += [token] * n
            plain.hidden.append(declared_features(out, self.features))
            plain.steps += 1
        metrics.record_step([0] * B, [0] * B, counts)
        metrics.first_token_seconds = metrics.first_token_seconds or clock() - self.started
        stream(self.requests, [[t] for t in tokens], counts, [0] * B, [0] * B)
        self.plain_left -= 1
        metrics.forward_seconds += t_forward - t_start
        metrics.commit_seconds += clock() - t_forward
        self.plain.forward_seconds += t_forward - t_start
        self.plain.seconds += clock() - t_start
        if not self.plain_left:
            self.end_plain()

    def end_plain(self) -> None:
        """The proposer observes the plain steps since the last (no drafts: every token the
        target's) and the controller learns what they cost."""
        plain, B = self.plain, len(self.requests)
        self.plain, self.plain_left = PlainStretch([]), 0
        if not plain.steps:
            return
        t_start = time.perf_counter()
        width = max(map(len, plain.tokens))
        self.drafting.observe(Outcome([0] * B, [t + [0] * (width - len(t)) for t in plain.tokens],
                                      list(map(len, plain.tokens)), torch.cat(plain.hidden, 1)))
        observe = time.perf_counter() - t_start
        self.metrics.observe_seconds += observe
        self.schedule.observe_plain(plain.steps, plain.seconds + observe, plain.forward_seconds)

    def regroup(self) -> None:
        """Finished and cancelled rows leave (the others keep their places where they can, so that
        the caches copy few rows); waiting requests join while there is room: every holder of rows
        hears of both (protocol.RowState)."""
        keep = compacted([not r.finished for r in self.requests])
        leaving = len(keep) < len(self.requests)
        if leaving or self.waiting:
            self.next_window = None
            self.end_plain()  # the proposer's rows must be up to date before they regroup
        if leaving:
            for holder in self.holders:
                holder.leave(keep)
            self.requests, self.last, self.cached = ([rows[b] for b in keep] for rows in (
                self.requests, self.last, self.cached))
        joining, promises = self.admit()
        if joining:
            prompts = [r.prompt for r in joining]
            news = Joining(prompts, [r.sampling for r in joining], [r.constraint for r in joining], promises)
            with self.metrics.timed("prefill_seconds"):
                for holder in self.holders:
                    holder.join(news)
            self.requests += joining
            self.last += [p[-1] for p in prompts]
            self.cached += [len(p) - 1 for p in prompts]

    def admit(self) -> tuple[list[Request], list[int]]:
        """The waiting requests that join now, first in line first, while there is room in the batch and
        their worst case can be promised (else the first waits), and the blocks promised to each."""
        joining, promises = [], []
        while self.waiting and len(self.requests) + len(joining) < self.capacity:
            request = self.waiting[0]
            if request.finished:  # max_new_tokens 0, or cancelled while it waited
                self.waiting.popleft()
                if request.on_tokens is not None:
                    request.on_tokens(request, [], 0)
                continue
            promise = self.promise(request)
            if promise is None:  # not enough memory before rows leave: it waits, first in line
                break
            joining.append(self.waiting.popleft())
            promises.append(promise)
        return joining, promises

    @property
    def constrained(self) -> Guide | None:
        """The guide while a row of the batch is constrained, else None."""
        return self.guide if self.guide.active else None

    def generator(self):
        """The rows' random generators: their common one, or one per row."""
        generators = [r.generator for r in self.requests]
        if all(g is generators[0] for g in generators):
            return generators[0]
        return RowGenerators(generators)

    def accept(self, proposal: Proposal, logits: torch.Tensor) -> Verdict:
        """Each row's verdict on the proposal from the target's logits (B, 1+m, V), under its own sampling
        settings (verify.by_kind)."""
        return by_kind(proposal, logits, [r.sampling for r in self.requests], self.cached, self.generator(),
                       self.sampled_verify, self.tree_verify)

    def pick(self, logits: torch.Tensor) -> torch.Tensor:
        """(B, V) logits -> (B,) each row's next token under its own sampling settings (sampling.pick_rows;
        a seeded row's noise is that of its next position)."""
        return pick_rows(logits, [r.sampling for r in self.requests], self.generator(),
                         [n + 1 for n in self.cached])


@dataclass
class TargetRows:
    """The target's KV cache as a holder of rows: joining prompts prefilled (their features handed on to
    the holders after it), leaving rows' blocks given back."""
    model: object
    cache: object
    features: tuple[int, ...]
    share: bool  # map the cached blocks of a prompt's leading tokens (lm/kv_cache.py)

    def join(self, joining: Joining) -> None:
        joining.hidden = prefill_joining(self.model, self.cache, joining.prompts, self.features, joining.promises,
                                         self.share)

    def leave(self, keep: list[int]) -> None:
        self.cache.regroup(keep)


@dataclass
class PlainStretch:
    """What the plain steps since the proposer last heard have emitted and cost."""
    tokens: list[list[int]]                                  # per row, the tokens emitted
    hidden: list[torch.Tensor] = field(default_factory=list)  # per step (B, 1, C)
    steps: int = 0
    seconds: float = 0.0
    forward_seconds: float = 0.0


@torch.inference_mode()
def speculative_generate(target, proposer: Proposer | None, prompts: list[list[int]], rule: StopRule,
                         sampling: SamplingConfig, k: int | str, generator: torch.Generator | None = None,
                         *, widths: tuple[int, ...] | None = None, sampled_verify=rejection_sample,
                         tree_verify=tree_rejection_sample, on_tokens: Callable[[int, list[int]], None] | None = None,
                         constraint: Compiled | None = None, forced_drafts: bool = True
                         ) -> tuple[list[Row], SpecMetrics]:
    """One closed batch of token ids through the engine: every prompt under the same settings, one
    generator (proposer None, k = 0: plain decoding). k, widths, sampled_verify, tree_verify,
    forced_drafts: as `Engine`; on_tokens(i, tokens): prompt i's tokens of each step, as they are
    committed (a stream); constraint: the grammar every row's tokens must match (constraint.py), or None."""
    admitted = admit(target, role="target")
    check_inputs(admitted.model, prompts, rule, admitted.context)
    max_len = max(map(len, prompts)) + rule.max_new_tokens  # the longest sequence a row can reach
    engine = Engine(admitted, proposer, k, len(prompts), max_len, widths=widths, sampled_verify=sampled_verify,
                    tree_verify=tree_verify, forced_drafts=forced_drafts)
    requests = [Request(p, rule, sampling, generator, None if on_tokens is None else partial(stream_to, on_tokens, i),
                        constraint) for i, p in enumerate(prompts)]
    return [r.row for r in requests], engine.run(requests)


def plain_generate(target, prompts: list[list[int]], rule: StopRule, sampling: SamplingConfig,
                   generator: torch.Generator | None = None,
                   on_tokens: Callable[[int, list[int]], None] | None = None) -> tuple[list[Row], SpecMetrics]:
    """Plain decoding of a closed batch: the engine without a proposer (one token per row per step)."""
    return speculative_generate(target, None, prompts, rule, sampling, 0, generator, on_tokens=on_tokens)


def stream_to(on_tokens: Callable[[int, list[int]], None], i: int, request: Request, tokens: list[int],
              drafted: int) -> None:
    """A Request's on_tokens that hands the tokens on as prompt i's."""
    on_tokens(i, tokens)


def stream(requests: list[Request], runs: list[list[int]], counts: list[int], lengths: list[int],
           accepted: list[int]) -> None:
    """Count each request's step and hand it the tokens it took."""
    for request, run, n, proposed, took in zip(requests, runs, counts, lengths, accepted):
        request.steps += 1
        request.proposed += proposed
        request.accepted += took
        if n and request.on_tokens is not None:
            request.on_tokens(request, run[:n], min(took, n))


def draft_limits(budgets: list[int], k: int) -> list[int]:
    """Drafts each row may propose (B,): a step emits accepted + 1 tokens, so at most budget - 1.
    The context needs no separate clip: check_prompt ensured that prompt + max_new_tokens fits,
    and the budget bounds every row's sequence."""
    return [min(max(budget - 1, 0), k) for budget in budgets]


def check_prompt(prompt: list[int], rule: StopRule, vocab: int, context: int, name: str) -> None:
    if not prompt:
        raise SpecdecError(f"{name} needs at least one token")
    if max(prompt) >= vocab or min(prompt) < 0:
        raise SpecdecError(f"{name} holds token ids outside the target's vocabulary (0..{vocab - 1})")
    check_fits(len(prompt), rule.max_new_tokens, context, name)


def check_fits(length: int, max_new_tokens: int, context: int, name: str, budget: str = "max_new_tokens") -> None:
    """The one context rule: a row of `length` prompt tokens needs length + max_new_tokens - 1
    positions in the cache (every generated token but the last is fed back), at most `context`.
    budget: what the caller names max_new_tokens (a server request's max_tokens)."""
    needed = length + max_new_tokens - 1
    if needed > context:
        raise SpecdecError(f"{name} has {length} tokens; with {budget}={max_new_tokens} it needs {needed} positions "
                           f"but the model's context is {context}: shorten the prompt or lower {budget}")


def check_inputs(target, prompts: list[list[int]], rule: StopRule, context: int) -> None:
    if not prompts or any(len(p) == 0 for p in prompts):
        raise SpecdecError("every prompt needs at least one token (and at least one prompt is needed)")
    for b, p in enumerate(prompts):
        check_prompt(p, rule, target.config.vocab_size, context, f"prompt {b}")


def check_setup(target, proposer: Proposer, k: int | str, widths: tuple[int, ...] | None) -> tuple[int, ...]:
    """Refuse a bad setup with a message saying what to give instead; return the widths per depth
    (k "auto": the most nodes per depth its shapes draft, adaptive.options)."""
    if k == "auto":
        widths = widest(options(proposer, widths)[0])
        k = len(widths)
    if k < 0:
        raise SpecdecError(f"k (draft tokens per step) must be >= 0, got {k}")
    widths = (1,) * k if widths is None else tuple(widths)
    if len(widths) != k or any(w < 1 for w in widths):
        raise SpecdecError(f"a draft tree needs one width >= 1 per depth (k={k} depths), got {widths}")
    if max(widths, default=1) > 1 and not target.abilities.trees:
        raise SpecdecError("draft trees need specdec's own LlamaForCausalLM as the target (its forward takes a "
                           "tree attention mask); use chains (widths of 1) with this target")
    vocab = target.config.vocab_size
    if proposer.vocab_size is not None and proposer.vocab_size != vocab:
        raise SpecdecError(f"the {proposer.name} proposer has a vocabulary of {proposer.vocab_size} tokens "
                           f"but the target has {vocab}: draft and target must share one tokenizer")
    return widths
