"""Speculative decoding: prefill, then loop propose -> verify -> accept -> commit.

Every row of the batch keeps its own sequence, cache length, accepted counts and stop state. The
target's cache lags one token behind each sequence: the newest token ("last") opens the next
verification window [last, d_1..d_m], scored by ONE target forward pass for all rows. Tokens are
emitted through `Row.append` one at a time, so EOS, stop strings and max_new_tokens cut exactly
inside an accepted run; then each row's target cache is rolled back to the tokens it kept and the
proposer is told what was committed. k = 0 proposes nothing: one token per step, plain decoding.

This module knows nothing about particular proposers (proposers/), acceptance rules (verify.py)
or model internals (lm.py).
"""
from __future__ import annotations

import time

import torch

from .errors import SpecdecError
from .lm import causal_lm, context_length, next_positions, prefill_all_but_last
from .metrics import SpecMetrics
from .proposers.base import Outcome, Proposal, Proposer
from .sampling import SamplingConfig, probabilities
from .stopping import Row, StopRule
from .verify import Verdict, greedy_accept, rejection_sample


@torch.inference_mode()
def speculative_generate(target, proposer: Proposer, prompts: list[list[int]], rule: StopRule,
                         sampling: SamplingConfig, k: int, generator: torch.Generator | None = None,
                         *, sampled_verify=rejection_sample) -> tuple[list[Row], SpecMetrics]:
    """`sampled_verify` is the acceptance rule used when sampling (signature of
    verify.rejection_sample); tests replace it to show a wrong rule is detected."""
    target = causal_lm(target, role="target")
    context = context_length(target)
    check_inputs(target, proposer, prompts, rule, k, context)
    verify = _verifier(sampling, sampled_verify, generator)
    metrics = SpecMetrics(k=k, batch_size=len(prompts))
    rows = [Row(rule) for _ in prompts]
    t0 = time.perf_counter()
    with metrics.timed("prefill_seconds"):
        max_len = max(map(len, prompts)) + rule.max_new_tokens  # the longest sequence a row can reach
        cache = target.new_cache(len(prompts), max_len + k)       # + k: room for padded windows
        state = proposer.start(prompts, prefill_all_but_last(target, cache, prompts), sampling, max_len, k)
        last = torch.tensor([p[-1] for p in prompts])             # (B,) newest token, not in the cache
    while not all(row.done for row in rows):
        budgets = torch.tensor([row.budget for row in rows])     # (B,) tokens each row may still emit
        with metrics.timed("draft_seconds"):                      # propose
            proposal = proposer.propose(state, draft_limits(budgets, k), generator).trimmed()
        with metrics.timed("verify_seconds"):                     # verify: one forward for all rows
            window = torch.cat([last[:, None], proposal.tokens], 1)  # (B, 1+m)
            out = target(window, positions=next_positions(cache, window.shape[1], context), cache=cache)
            verdict = verify(proposal, out.logits)                   # accept: logits (B, 1+m, V)
        committed, counts = commit(rows, proposal, verdict)          # (B, 1+m), (B,) emitted
        metrics.first_token_seconds = metrics.first_token_seconds or time.perf_counter() - t0
        # roll back: keep the window positions that predicted an emitted token
        cache.rollback(cache.lengths - window.shape[1] + counts)
        # the newest emitted token opens the next window (finished rows keep theirs)
        last = torch.where(counts > 0, committed.gather(1, (counts - 1).clamp(min=0)[:, None])[:, 0], last)
        with metrics.timed("draft_seconds"):
            proposer.observe(state, Outcome(verdict.accepted, committed, counts, out.hidden))
        metrics.record_step(budgets > 0, proposal.lengths, verdict.accepted, counts)
    metrics.other_seconds = time.perf_counter() - t0 - metrics.total_seconds
    return rows, metrics


def draft_limits(budgets: torch.Tensor, k: int) -> torch.Tensor:
    """Drafts each row may propose (B,): a step emits accepted + 1 tokens, so at most budget - 1;
    finished rows (budget 0) propose none. The context needs no separate clip: check_inputs
    ensured that prompt + max_new_tokens fits, and the budget bounds every row's sequence."""
    return (budgets - 1).clamp(min=0, max=k)


def commit(rows: list[Row], proposal: Proposal, verdict: Verdict) -> tuple[torch.Tensor, torch.Tensor]:
    """Emit each row's accepted drafts and then its recovered/bonus token through Row.append, one
    at a time, so a stop inside the run cuts it. Returns the run (B, 1+m) and the counts emitted
    (B,): accepted + 1, fewer where the row finished, 0 for rows already finished."""
    runs = torch.cat([proposal.tokens, verdict.next_token[:, None]], 1).scatter(
        1, verdict.accepted[:, None], verdict.next_token[:, None])  # (B, 1+m)
    counts = [emit(row, run, n + 1) for row, run, n in zip(rows, runs.tolist(), verdict.accepted.tolist())]
    return runs, torch.tensor(counts, dtype=torch.long)


def emit(row: Row, run: list[int], n: int) -> int:
    """Append run[:n] one token at a time until the row finishes; return how many it took."""
    for i in range(n):
        if row.done:
            return i
        row.append(run[i])
    return n


def _verifier(sampling: SamplingConfig, sampled_verify, generator):
    """The acceptance rule for these sampling settings, chosen once."""
    if sampling.greedy:
        return lambda proposal, logits: greedy_accept(proposal.tokens, logits, proposal.lengths)

    def sampled(proposal: Proposal, logits: torch.Tensor) -> Verdict:
        return sampled_verify(proposal.tokens, proposal.draft_probs, probabilities(logits, sampling),
                              generator, proposal.lengths)
    return sampled


def check_inputs(target, proposer: Proposer, prompts: list[list[int]], rule: StopRule, k: int,
                 context: int) -> None:
    if k < 0:
        raise SpecdecError(f"k (draft tokens per step) must be >= 0, got {k}")
    if not prompts or any(len(p) == 0 for p in prompts):
        raise SpecdecError("every prompt needs at least one token (and at least one prompt is needed)")
    vocab = target.config.vocab_size
    if proposer.vocab_size is not None and proposer.vocab_size != vocab:
        raise SpecdecError(f"the {proposer.name} proposer has a vocabulary of {proposer.vocab_size} tokens "
                           f"but the target has {vocab}: draft and target must share one tokenizer")
    for b, p in enumerate(prompts):
        if max(p) >= vocab or min(p) < 0:
            raise SpecdecError(f"prompt {b} holds token ids outside the target's vocabulary (0..{vocab - 1})")
        if len(p) + rule.max_new_tokens - 1 > context:
            raise SpecdecError(f"prompt {b} has {len(p)} tokens; with max_new_tokens={rule.max_new_tokens} "
                               f"it needs {len(p) + rule.max_new_tokens - 1} positions but the target's "
                               f"context is {context}: shorten the prompt or lower max_new_tokens")
