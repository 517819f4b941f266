"""Speculative decoding as a step loop: propose -> verify -> accept -> commit, over a batch of
requests that join and leave between steps (continuous batching).

Every row of the batch is one request with its own sequence, cache length, sampling settings,
random generator, stop rule and stream. The target's cache lags one token behind each sequence:
the newest token ("last") opens the next verification window [last, d_1..d_m], scored by ONE
target forward pass for all rows. Tokens are emitted through `Row.append` one at a time, so EOS,
stop strings and max_new_tokens cut exactly inside an accepted run; then each row's target cache
is rolled back to the tokens it kept and the proposer is told what was committed. k = 0 proposes
nothing: one token per step, plain decoding.

Between steps (`Engine.regroup`) finished or cancelled rows leave and waiting requests join: the
joining prompts are prefilled, and the target's cache and the proposer's state regroup their
rows; caches are allocated once, for `capacity` rows. `speculative_generate` is the engine run
on one closed batch.

This module knows nothing about particular proposers (proposers/), acceptance rules (verify.py),
model internals (lm.py) or serving (serve/).
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import torch

from .errors import SpecdecError
from .lm import causal_lm, context_length, next_positions, prefill_joining
from .metrics import SpecMetrics
from .proposers.base import Outcome, Proposal, Proposer
from .sampling import RowGenerators, SamplingConfig, row_probabilities
from .stopping import Row, StopRule
from .verify import Verdict, greedy_accept, rejection_sample


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


class Engine:
    def __init__(self, target, proposer: Proposer, k: int, capacity: int, max_len: int,
                 *, sampled_verify=rejection_sample):
        """capacity: the most rows in the batch; max_len: the longest sequence (prompt +
        generated) a row may reach. `sampled_verify` is the acceptance rule of sampled rows
        (signature of verify.rejection_sample); tests replace it to show a wrong rule is detected."""
        self.target = causal_lm(target, role="target")
        self.context = context_length(self.target)
        check_setup(self.target, proposer, k)
        self.proposer, self.k, self.capacity, self.max_len = proposer, k, capacity, max_len
        self.sampled_verify = sampled_verify
        self.cache = self.target.new_cache(capacity, max_len + k)  # + k: room for padded windows
        self.cache.regroup([])
        no_hidden = torch.zeros(0, 0, self.target.config.hidden_size)
        self.state = proposer.start([], no_hidden, [], max_len, k, capacity=capacity)
        self.requests: list[Request] = []  # (B,) the rows, in cache order
        self.last: list[int] = []          # (B,) newest token of each row, not in the cache
        self.cached: list[int] = []        # (B,) the target cache's lengths
        self.waiting: deque[Request] = deque()
        self.metrics = SpecMetrics(k=k, batch_size=capacity)
        self.started = time.perf_counter()

    def submit(self, request: Request) -> None:
        """Queue a request (any thread); it joins the batch at the next step with room."""
        check_prompt(request.prompt, request.rule, self.target.config.vocab_size,
                     min(self.context, self.max_len), "the prompt")
        self.waiting.append(request)

    @property
    def busy(self) -> bool:
        return bool(self.requests or self.waiting)

    @torch.inference_mode()
    def step(self) -> None:
        """Regroup, then advance every row by one verification."""
        self.regroup()
        if not self.requests:
            return
        proposer, state, cache, metrics, clock = self.proposer, self.state, self.cache, self.metrics, time.perf_counter
        budgets = [r.row.budget for r in self.requests]               # tokens each row may still emit
        t_start = clock()
        proposal = proposer.propose(state, draft_limits(budgets, self.k), self.generator()).trimmed()  # propose
        t_proposed = clock()
        drafts = proposal.tokens.tolist()                             # (B, m)
        window = torch.tensor([[token] + row for token, row in zip(self.last, drafts)])  # (B, 1+m)
        positions = next_positions(cache, window.shape[1], self.context, longest=max(self.cached))
        t_window = clock()
        out = self.target(window, positions=positions, cache=cache)
        t_forward = clock()
        verdict = self.verify(proposal, out.logits)                   # accept: logits (B, 1+m, V)
        t_accepted = clock()
        accepted = verdict.accepted.tolist()
        runs, counts = commit([r.row for r in self.requests], drafts, accepted, verdict.next_token.tolist())
        # roll back: keep the window positions that predicted an emitted token
        self.cached = [n + c for n, c in zip(self.cached, counts)]
        cache.rollback(self.cached)
        # the newest emitted token opens the next window
        self.last = [run[n - 1] if n else old for run, n, old in zip(runs, counts, self.last)]
        t_committed = clock()
        proposer.observe(state, Outcome(verdict.accepted, torch.tensor(runs), torch.tensor(counts), out.hidden))
        t_observed = clock()
        lengths = proposal.lengths.tolist()
        metrics.record_step([True] * len(budgets), lengths, accepted, counts)
        metrics.record_phases(t_start, t_proposed, t_window, t_forward, t_accepted, t_committed, t_observed, clock())
        metrics.first_token_seconds = metrics.first_token_seconds or t_committed - self.started
        stream(self.requests, runs, counts, lengths, accepted)

    def regroup(self) -> None:
        """Finished and cancelled rows leave; waiting requests join while there is room."""
        keep = [b for b, r in enumerate(self.requests) if not r.finished]
        if len(keep) < len(self.requests):
            self.cache.regroup(keep)
            self.proposer.leave(self.state, keep)
            self.requests, self.last, self.cached = ([rows[b] for b in keep] for rows in (
                self.requests, self.last, self.cached))
        joining = []
        while self.waiting and len(self.requests) + len(joining) < self.capacity:
            request = self.waiting.popleft()
            if not request.finished:
                joining.append(request)
            elif request.on_tokens is not None:  # max_new_tokens 0, or cancelled while it waited
                request.on_tokens(request, [], 0)
        if joining:
            prompts = [r.prompt for r in joining]
            with self.metrics.timed("prefill_seconds"):
                hidden = prefill_joining(self.target, self.cache, prompts)
                self.proposer.join(self.state, prompts, hidden, [r.sampling for r in joining])
            self.requests += joining
            self.last += [p[-1] for p in prompts]
            self.cached += [len(p) - 1 for p in prompts]

    def generator(self):
        """The rows' random generators: their common one, or one per row."""
        generators = [r.generator for r in self.requests]
        if all(g is generators[0] for g in generators):
            return generators[0]
        return RowGenerators(generators)

    def verify(self, proposal: Proposal, logits: torch.Tensor) -> Verdict:
        """Greedy rows by greedy acceptance, sampled rows by `sampled_verify` on their own
        sampling settings' probabilities (logits (B, 1+m, V)); one call for each kind present."""
        greedy = [b for b, r in enumerate(self.requests) if r.sampling.greedy]
        if len(greedy) == len(self.requests):
            return greedy_accept(proposal.tokens, logits, proposal.lengths)
        sampled = [b for b, r in enumerate(self.requests) if not r.sampling.greedy]
        generator = self.generator()
        if not greedy:
            return self.sampled_verify(proposal.tokens, proposal.draft_probs,
                                       row_probabilities(logits, [r.sampling for r in self.requests]),
                                       generator, proposal.lengths)
        g, s = torch.tensor(greedy), torch.tensor(sampled)
        by_greedy = greedy_accept(proposal.tokens[g], logits[g], proposal.lengths[g])
        by_sampling = self.sampled_verify(
            proposal.tokens[s], None if proposal.draft_probs is None else proposal.draft_probs[s],
            row_probabilities(logits[s], [self.requests[b].sampling for b in sampled]),
            generator.select(sampled) if isinstance(generator, RowGenerators) else generator, proposal.lengths[s])
        accepted, next_token = (torch.empty(len(self.requests), dtype=torch.long) for _ in range(2))
        accepted[g], next_token[g] = by_greedy
        accepted[s], next_token[s] = by_sampling
        return Verdict(accepted, next_token)


@torch.inference_mode()
def speculative_generate(target, proposer: Proposer, prompts: list[list[int]], rule: StopRule,
                         sampling: SamplingConfig, k: int, generator: torch.Generator | None = None,
                         *, sampled_verify=rejection_sample) -> tuple[list[Row], SpecMetrics]:
    """One closed batch through the engine: every prompt under the same settings, one generator."""
    t0 = time.perf_counter()
    target = causal_lm(target, role="target")
    check_inputs(target, proposer, prompts, rule, k, context_length(target))
    max_len = max(map(len, prompts)) + rule.max_new_tokens  # the longest sequence a row can reach
    engine = Engine(target, proposer, k, len(prompts), max_len, sampled_verify=sampled_verify)
    requests = [Request(p, rule, sampling, generator) for p in prompts]
    for request in requests:
        engine.submit(request)
    while engine.busy:
        engine.step()
    metrics = engine.metrics
    metrics.batch_size = len(prompts)
    metrics.other_seconds = time.perf_counter() - t0 - metrics.total_seconds
    return [r.row for r in requests], metrics


def stream(requests: list[Request], runs: list[list[int]], counts: list[int], lengths: list[int],
           accepted: list[int]) -> None:
    """Count each request's step and hand it the tokens it took."""
    for request, run, n, proposed, took in zip(requests, runs, counts, lengths, accepted):
        request.steps += 1
        request.proposed += proposed
        request.accepted += took
        if n and request.on_tokens is not None:
            request.on_tokens(request, run[:n], min(took, n))


def draft_limits(budgets: list[int], k: int) -> torch.Tensor:
    """Drafts each row may propose (B,): a step emits accepted + 1 tokens, so at most budget - 1.
    The context needs no separate clip: check_prompt ensured that prompt + max_new_tokens fits,
    and the budget bounds every row's sequence."""
    return torch.tensor([min(max(budget - 1, 0), k) for budget in budgets])


def commit(rows: list[Row], drafts: list[list[int]], accepted: list[int],
           next_tokens: list[int]) -> tuple[list[list[int]], list[int]]:
    """Emit each row's accepted drafts and then its recovered/bonus token through Row.append, one
    at a time, so a stop inside the run cuts it. Returns each row's run (its m drafts with the
    recovered token at the first rejection, then the recovered or bonus token: 1+m) and the counts
    emitted: accepted + 1, fewer where the row finished, 0 for rows already finished."""
    runs = [row_drafts + [token] for row_drafts, token in zip(drafts, next_tokens)]
    for run, n, token in zip(runs, accepted, next_tokens):
        run[n] = token  # the recovered token replaces the first rejected draft
    return runs, [emit(row, run, n + 1) for row, run, n in zip(rows, runs, accepted)]


def emit(row: Row, run: list[int], n: int) -> int:
    """Append run[:n] one token at a time until the row finishes; return how many it took."""
    for i in range(n):
        if row.done:
            return i
        row.append(run[i])
    return n


def check_setup(target, proposer: Proposer, k: int) -> None:
    if k < 0:
        raise SpecdecError(f"k (draft tokens per step) must be >= 0, got {k}")
    vocab = target.config.vocab_size
    if proposer.vocab_size is not None and proposer.vocab_size != vocab:
        raise SpecdecError(f"the {proposer.name} proposer has a vocabulary of {proposer.vocab_size} tokens "
                           f"but the target has {vocab}: draft and target must share one tokenizer")


def check_prompt(prompt: list[int], rule: StopRule, vocab: int, context: int, name: str) -> None:
    if not prompt:
        raise SpecdecError(f"{name} needs at least one token")
    if max(prompt) >= vocab or min(prompt) < 0:
        raise SpecdecError(f"{name} holds token ids outside the target's vocabulary (0..{vocab - 1})")
    if len(prompt) + rule.max_new_tokens - 1 > context:
        raise SpecdecError(f"{name} has {len(prompt)} tokens; with max_new_tokens={rule.max_new_tokens} "
                           f"it needs {len(prompt) + rule.max_new_tokens - 1} positions but the target's "
                           f"context is {context}: shorten the prompt or lower max_new_tokens")


def check_inputs(target, proposer: Proposer, prompts: list[list[int]], rule: StopRule, k: int,
                 context: int) -> None:
    check_setup(target, proposer, k)
    if not prompts or any(len(p) == 0 for p in prompts):
        raise SpecdecError("every prompt needs at least one token (and at least one prompt is needed)")
    for b, p in enumerate(prompts):
        check_prompt(p, rule, target.config.vocab_size, context, f"prompt {b}")
