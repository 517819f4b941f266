"""Speculative decoding as a step loop: propose -> verify -> accept -> commit, over a batch of
requests that join and leave between steps (continuous batching).

Every row of the batch is one request with its own sequence, cache length, sampling settings,
random generator, stop rule and stream. The target's cache lags one token behind each sequence:
the newest token ("last") opens the next verification window [last, d_1..d_m], scored by ONE
target forward pass for all rows. Tokens are emitted through `Row.emit` one at a time, so EOS,
stop strings and max_new_tokens cut exactly inside an accepted run; then each row's target cache
is rolled back to the tokens it kept and the proposer is told what was committed.

A proposal may be a tree (tree.py; `widths` caps the drafts per depth): the window then carries
every node, with positions by depth and a tree attention mask, acceptance walks the tree, and the
cache keeps the accepted path's entries moved to follow each other (`KVCache.compact`).

Depth 0 is plain decoding, lean one-token steps (`Engine.plain_step`); a stretch of them is told to
the proposer once, at its end. An engine without a proposer (`NoDraft`, k = 0) is plain decoding
itself: the one fast plain decoder (`plain_generate`; reference.py stays the simple oracle). k = "auto" chooses each step's depth (0 included) and shape
from what pays (adaptive.py); the controller is told what each step accepted and cost.

Everything the engine creates lives on the target's device. The host keeps the bookkeeping (each
row's tokens, cache length and budget) and reads the device once per step where it can: what the
target accepted, with the drafts, in one copy (syncs.py counts these points).

Between steps (`Engine.regroup`) finished or cancelled rows leave and waiting requests join: the
joining prompts are prefilled, and the target's cache, the proposer's state and the controller
regroup their rows; caches are allocated once, for `capacity` rows. `Engine.run` runs one closed
batch of requests; `speculative_generate` and `plain_generate` are it for token ids under one
setting. Requests from text come through pipeline.py (encode, heal, stop rule, stream).

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
from ..lm.interface import Admitted, admit, declared_features, layer_request, prefill_joining
from ..lm.kv_cache import BLOCK, blocks_for
from .adaptive import Adaptive, curve_batches, options, window
from .calibration import verify_curves
from .constraint import Compiled, FirstToken, masked
from .guided import Guide
from .metrics import SpecMetrics
from .protocol import Outcome, Proposal, Proposer
from .sampling import Draws, RowGenerators, SamplingConfig, of_rows, perturbed, pick_rows, row_probabilities
from .stopping import Row, StopRule
from .tree import chain_positions, chain_runs, depths, levels_reached, path_columns, window_layout
from .verify import Verdict, greedy_accept, rejection_sample, tree_rejection_sample


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
        """admitted: the target as admitted at load (lm.interface.admit); proposer None: plain
        decoding (k must be 0; `NoDraft`).
        k: drafts per step, or "auto" (adaptive.py); widths: the most drafts per depth (len k;
        default all ones, a chain; with "auto", the tree tried beside chains). capacity: the most
        rows in the batch; max_len: the longest sequence (prompt + generated) a row may reach.
        `sampled_verify` and `tree_verify` are the acceptance rules of sampled rows for chains and
        trees (signatures of verify.rejection_sample and verify.tree_rejection_sample); tests
        replace them to show a wrong rule is detected. forced_drafts: constrained rows propose the
        tokens their grammar forces in place of the drafter's (guided.py; needs k >= 1). kv_dtype: the
        target's KV cache dtype (default its compute dtype; bfloat16 halves what a batched step's
        attention reads, the keys and values rounded to it). kv_tokens: the positions its pool holds
        (default every row's max_len): a request joins when its worst case fits beside the rows'
        (`promise`), else it waits. share_prefixes: joining prompts map the blocks of leading tokens
        already in the cache (lm/kv_cache.py) where the proposer does not read prompt features.
        With "auto" the target's verify curves at every batch size up to `capacity` are read, or
        measured now and stored (calibration.verify_curves: said on stderr with `name`), so that no
        step pays for them; `verify_curve_seconds` says how long measuring took (0: they were stored)."""
        self.started = time.perf_counter()  # first_token_seconds and other_seconds count from here
        self.admitted = admitted
        self.model, self.context = admitted.model, admitted.context
        if proposer is None:
            if k != 0:
                raise SpecdecError(f"plain decoding (no proposer) drafts nothing: k must be 0, got {k!r}; "
                                   "give a proposer to draft")
            proposer = NoDraft()
        self.adaptive, self.verify_curve_seconds = None, 0.0
        if k == "auto":
            check_setup(self.model, proposer, 0, None)
            curves, self.verify_curve_seconds = verify_curves(admitted, curve_batches(capacity),
                                                              window(options(proposer, widths)[0]), name)
            self.adaptive = Adaptive.for_run(curves, proposer, widths)
            k, widths = self.adaptive.depth, self.adaptive.widest
        self.widths = check_setup(self.model, proposer, k, widths)
        self.proposer, self.k, self.capacity, self.max_len = proposer, k, capacity, max_len
        self.device = self.admitted.device
        self.sampled_verify, self.tree_verify = sampled_verify, tree_verify
        self.features = getattr(proposer, "features", ())  # target layers it reads: () = final hidden states
        nodes = sum(self.widths)
        self.window_room = nodes  # beyond prompt + max_new_tokens: a verification window past the committed entries
        self.cache = self.model.new_cache(capacity, max_len + nodes, kv_dtype, tokens=kv_tokens)
        self.cache.regroup([])
        self.share = (share_prefixes and self.cache.pool is not None
                      and not getattr(proposer, "prompt_features", True))
        if getattr(proposer, "reads_target_cache", False):  # a draft of the target's own shapes (protocol.py)
            self.state = proposer.start(max_len, k, capacity, nodes, target_cache=self.cache)
        else:
            self.state = proposer.start(max_len, k, capacity, nodes)
        self.requests: list[Request] = []  # (B,) the rows, in cache order
        self.last: list[int] = []          # (B,) newest token of each row, not in the cache
        self.cached: list[int] = []        # (B,) the target cache's lengths
        self.next_window: torch.Tensor | None = None  # (B, 1) `last` on the device, where a plain step left it
        self.waiting: deque[Request] = deque()
        self.plain_left = 0  # steps left in the current stretch of plain decoding (inf: k = 0)
        self.plain = PlainStretch([])
        self.closed = False  # a closed batch (`run`): no request comes after those given, so auto knows the steps left
        self.metrics = SpecMetrics(k=k, batch_size=capacity)
        self.forced_drafts = forced_drafts
        self.guide: Guide | None = None  # made when the first constrained request joins (`join_guide`)

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
        if self.adaptive:
            self.adaptive.remember()
            metrics.adaptive = self.adaptive.summary()
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
        guide = self.constrained
        limit = draft_limits([r.row.budget for r in self.requests], depth)
        limits, last = torch.tensor([limit, self.last], device=self.device)  # (B,) each, one copy
        self.next_window = None
        # a seeded row's first draft: position cached + 1; constrained rows draft under their grammars
        draws = Draws(self.generator(), [c + 1 for c in self.cached], guide and guide.drafting())
        proposal = self.proposer.propose(self.state, limits, shape, draws).trimmed()  # propose
        if guide:  # forced runs in place of drafts; chains cut where they leave the grammar
            proposal = guide.propose(proposal, limit, [proposal.draft_probs is None or r.sampling.greedy
                                                            or r.sampling.seeded for r in self.requests]).trimmed()
        clock.mark("proposed")
        if self.adaptive and not proposal.tokens.shape[1]:  # nothing found (n-gram lookup): a plain step
            self.plain_left = 1
            self.plain_step()
            return
        window = torch.cat([last[:, None], proposal.tokens], 1)                 # (B, 1+m): [last, drafts]
        forced = guide is not None and guide.forced_only(proposal)  # every draft forced: certain, only the column after them decides
        out = self.verify_forward(window, proposal, clock, proposal.lengths[:, None] if forced else None)  # verify
        verdict = (self.after_forced(proposal, out.logits) if forced                     # accept: logits (B, 1, V)
                   else self.verify(proposal, self.masked(out.logits, proposal)))        # or (B, 1+m, V)
        # what the host needs of the step, read from the device at once: (B, 3 + m)
        read = torch.cat([verdict.accepted[:, None], verdict.next_token[:, None], proposal.lengths[:, None],
                          proposal.tokens], 1).tolist()
        accepted, next_tokens, lengths = ([row[i] for row in read] for i in range(3))
        clock.mark("accepted")
        outcome = self.commit([row[3:] for row in read], accepted, verdict, next_tokens, out)  # commit
        if guide:
            guide.commit(outcome.tokens, outcome.counts)
            outcome = guide.outcome(outcome)  # what the drafter hears of forced runs
            self.metrics.forced = guide.forced
        clock.mark("committed")
        self.proposer.observe(self.state, outcome)                                             # observe
        clock.mark("observed")
        self.metrics.record_step(lengths, accepted, outcome.counts, None if verdict.paths is None
                                 else levels_reached(proposal.parents, lengths, verdict.paths))
        self.metrics.record_phases(clock)
        self.metrics.first_token_seconds = self.metrics.first_token_seconds or clock["committed"] - self.started
        stream(self.requests, outcome.tokens, outcome.counts, lengths, accepted)
        if self.adaptive:
            chain = None if verdict.paths is None else chain_runs(proposal.parents, verdict.paths)
            self.adaptive.observe(limit, accepted, window.shape[1], clock.drafting, clock.total, clock.forward, chain)

    def choose(self) -> tuple[int, tuple[int, ...]]:
        """This step's depth and shape (k="auto": the controller's choice; a depth of 0 starts a
        stretch of plain steps)."""
        if self.plain_left:
            return 0, ()
        if self.adaptive:  # a closed batch with nobody waiting ends within its rows' largest budget
            horizon = max(r.row.budget for r in self.requests) if self.closed and not self.waiting else math.inf
            depth, shape, stretch = self.adaptive.choose(horizon)
        else:
            depth, shape, stretch = self.k, self.widths, None
        if depth == 0:
            self.plain_left = stretch or math.inf
        return depth, shape

    def plain_stretch(self) -> None:
        """Plain steps: one, or, when nobody streams from the rows and nobody waits (a closed batch:
        speculative_generate), the whole stretch without returning to the caller for every token."""
        self.plain_step()
        while self.plain_left and not self.waiting and not any(
                r.on_tokens is not None or r.finished for r in self.requests):
            self.plain_step()

    def verify_forward(self, window: torch.Tensor, proposal: Proposal, clock: "Clock",
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
               out) -> Outcome:
        """Emit each row's run (emit_runs), keep what the target computed along what was emitted: its
        cache entries (a tree's accepted path moved to follow the root) and, for the proposer, its
        features in the verify forward `out`; open the next window with the newest token. Returns
        the step's Outcome: the runs, the counts emitted and those features."""
        paths = verdict.paths or [range(n) for n in accepted]
        runs, counts = emit_runs([r.row for r in self.requests], drafts, paths, next_tokens)
        if verdict.paths is not None:  # keep the window entries that predicted an emitted token
            self.cache.compact(self.cached, verdict.paths)
        self.cached = [n + c for n, c in zip(self.cached, counts)]
        self.cache.rollback(self.cached)
        self.last = [run[n - 1] if n else old for run, n, old in zip(runs, counts, self.last)]
        return Outcome(accepted, runs, counts, self.features_along(out, verdict), verdict.paths)

    def features_along(self, out, verdict: Verdict) -> torch.Tensor:
        """The declared features (B, 1+m, ...) of the verify forward, along a tree's accepted path."""
        hidden = declared_features(out, self.features)
        if verdict.paths is None:
            return hidden
        return hidden.gather(1, path_columns(verdict.paths, hidden.shape[1], self.device)[..., None]
                             .expand_as(hidden))

    def plain_step(self) -> None:
        """One step of plain decoding, one token per row, as lean as decoding without a proposer.
        With k="auto" the tokens and hidden states are kept for the proposer, which hears of the
        whole stretch of plain steps at once when it ends (`end_plain`); with k = 0 it never drafts
        and hears nothing."""
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
        if self.adaptive:
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
        if self.adaptive:
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
        self.proposer.observe(self.state, Outcome([0] * B, [t + [0] * (width - len(t)) for t in plain.tokens],
                                                  list(map(len, plain.tokens)), torch.cat(plain.hidden, 1)))
        observe = time.perf_counter() - t_start
        self.metrics.observe_seconds += observe
        self.adaptive.observe_plain(plain.steps, plain.seconds + observe, plain.forward_seconds)

    def regroup(self) -> None:
        """Finished and cancelled rows leave (the others keep their places where they can, so that
        the caches copy few rows); waiting requests join while there is room."""
        keep = compacted([not r.finished for r in self.requests])
        if len(keep) < len(self.requests) or self.waiting:
            self.next_window = None
        if self.adaptive and (len(keep) < len(self.requests) or self.waiting):
            self.end_plain()  # the proposer's rows must be up to date before they regroup
        if len(keep) < len(self.requests):
            self.cache.regroup(keep)
            if self.guide:
                self.guide.leave(keep)
            self.proposer.leave(self.state, keep)
            if self.adaptive:
                self.adaptive.leave(keep)
            self.requests, self.last, self.cached = ([rows[b] for b in keep] for rows in (
                self.requests, self.last, self.cached))
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
        if joining:
            prompts = [r.prompt for r in joining]
            with self.metrics.timed("prefill_seconds"):
                hidden = prefill_joining(self.model, self.cache, prompts, self.features, promises, self.share)
                self.proposer.join(self.state, prompts, hidden, [r.sampling for r in joining])
            if self.adaptive:
                self.adaptive.join(len(joining), [len(p) for p in prompts])
            self.join_guide([r.constraint for r in joining])
            self.requests += joining
            self.last += [p[-1] for p in prompts]
            self.cached += [len(p) - 1 for p in prompts]

    def join_guide(self, constraints: list[Compiled | FirstToken | None]) -> None:
        """The joining rows' constraints to the guide (guided.py), made with the first constrained
        row, the rows already there unconstrained: until then no step spends anything on grammars."""
        if self.guide is None:
            if all(c is None for c in constraints):
                return
            self.guide = Guide(self.model.config.vocab_size, self.forced_drafts)
            self.guide.join([None] * len(self.requests))
        self.guide.join(constraints)

    @property
    def constrained(self) -> Guide | None:
        """The guide while a row of the batch is constrained, else None."""
        return self.guide if self.guide is not None and self.guide.active else None

    def generator(self):
        """The rows' random generators: their common one, or one per row."""
        generators = [r.generator for r in self.requests]
        if all(g is generators[0] for g in generators):
            return generators[0]
        return RowGenerators(generators)

    def pick(self, logits: torch.Tensor) -> torch.Tensor:
        """(B, V) logits -> (B,) each row's next token under its own sampling settings (sampling.pick_rows;
        a seeded row's noise is that of its next position)."""
        return pick_rows(logits, [r.sampling for r in self.requests], self.generator(),
                         [n + 1 for n in self.cached])

    def verify(self, proposal: Proposal, logits: torch.Tensor) -> Verdict:
        """Greedy rows by greedy acceptance; seeded rows by greedy acceptance on their perturbed
        log-probabilities (sampling.perturbed: the noise of each window column's position); other
        sampled rows by `sampled_verify` (chains) or `tree_verify` (trees) on their own sampling
        settings' probabilities (logits (B, 1+m, V)); one call for each kind present."""
        kinds = {"greedy": [], "seeded": [], "sampled": []}
        for b, r in enumerate(self.requests):
            kinds["greedy" if r.sampling.greedy else "seeded" if r.sampling.seeded else "sampled"].append(b)
        parents = proposal.parents
        generator = self.generator()

        def by_greedy(rows, index, row_logits):
            return greedy_accept(proposal.tokens[index], row_logits, proposal.lengths[index],
                                 None if parents is None else parents[index])

        def by_seed(rows, index, row_logits):
            columns = row_logits.shape[1]
            if parents is None:
                depth = [list(range(columns))] * len(rows)
            else:
                lengths = proposal.lengths[index].tolist()
                depth = [[0] + depths([p if i < n else -1 for i, p in enumerate(row)])
                         for row, n in zip(parents[index].tolist(), lengths)]
            positions = [[self.cached[b] + 1 + d for d in row] for b, row in zip(rows, depth)]
            noisy = perturbed(row_logits, [self.requests[b].sampling for b in rows], positions)
            return by_greedy(rows, index, noisy)

        def by_sampling(rows, index, row_logits):
            tokens, lengths = proposal.tokens[index], proposal.lengths[index]
            draft_probs = None if proposal.draft_probs is None else proposal.draft_probs[index]
            target_probs = row_probabilities(row_logits, [self.requests[b].sampling for b in rows])
            g = of_rows(generator, rows)
            if parents is None:
                return self.sampled_verify(tokens, draft_probs, target_probs, g, lengths)
            return self.tree_verify(tokens, draft_probs, target_probs, parents[index], g, lengths)

        rules = {"greedy": by_greedy, "seeded": by_seed, "sampled": by_sampling}
        present = [(kind, rows) for kind, rows in kinds.items() if rows]
        if len(present) == 1:
            kind, rows = present[0]
            return rules[kind](rows, slice(None), logits)
        accepted, next_token = (torch.empty(len(self.requests), dtype=torch.long, device=self.device) for _ in range(2))
        paths = None if parents is None else [None] * len(self.requests)
        for kind, rows in present:
            index = torch.tensor(rows, device=self.device)
            verdict = rules[kind](rows, index, logits[index])
            accepted[index], next_token[index] = verdict.accepted, verdict.next_token
            if paths is not None:
                for b, path in zip(rows, verdict.paths):
                    paths[b] = path
        return Verdict(accepted, next_token, paths)


class NoDraft:
    """The proposer of plain decoding (`Engine(target, None, 0, ...)`): it proposes nothing and
    keeps no state, so every step is a plain step of the target."""
    name = "plain"
    vocab_size = None
    trees = False
    max_depth = 0
    features = ()
    prompt_features = False

    def start(self, max_len: int, k: int, capacity: int, nodes: int | None = None) -> None:
        return None

    def join(self, state: None, prompts: list[list[int]], prompt_hidden: torch.Tensor,
             samplings: list[SamplingConfig]) -> None:
        return None

    def leave(self, state: None, keep: list[int]) -> None:
        return None

    def propose(self, state: None, limits: torch.Tensor, widths: tuple[int, ...],
                generator: torch.Generator | None) -> Proposal:
        return Proposal.empty(limits.shape[0], limits.device)

    def observe(self, state: None, outcome: Outcome) -> None:
        return None


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


@dataclass
class PlainStretch:
    """What the plain steps since the proposer last heard have emitted and cost (k="auto")."""
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


def emit_runs(rows: list[Row], drafts: list[list[int]], paths: list, next_tokens: list[int]
              ) -> tuple[list[list[int]], list[int]]:
    """Emit each row's accepted drafts (the nodes of its path) and then its recovered/bonus token
    through Row.emit, one at a time, so a stop inside the run cuts it. Returns each row's run
    (the path's drafts, the recovered or bonus token, zeros up to 1+m) and the counts emitted:
    accepted + 1, fewer where the row finished, 0 for rows already finished."""
    runs = [[row_drafts[i] for i in path] + [token] + [0] * (len(row_drafts) - len(path))
            for row_drafts, path, token in zip(drafts, paths, next_tokens)]
    return runs, [emit(row, run, len(path) + 1) for row, run, path in zip(rows, runs, paths)]


def emit(row: Row, run: list[int], n: int) -> int:
    """Append run[:n] one token at a time until the row finishes; return how many it took."""
    for i in range(n):
        if row.done:
            return i
        row.emit(run[i])
    return n


def check_setup(target, proposer: Proposer, k: int, widths: tuple[int, ...] | None) -> tuple[int, ...]:
    """Refuse a bad setup with a message saying what to give instead; return the widths per depth."""
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
