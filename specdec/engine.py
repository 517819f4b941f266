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
from .lm import causal_lm, context_length, declared_features, layer_request, next_positions, prefill_all_but_last
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
        features = getattr(proposer, "features", ())              # target layers it reads: () = final hidden
        state = proposer.start(prompts, prefill_all_but_last(target, cache, prompts, features), sampling, max_len, k)
        last = [p[-1] for p in prompts]                           # (B,) newest token, not in the cache
        cached = [len(p) - 1 for p in prompts]                    # (B,) the target cache's lengths
    clock = time.perf_counter
    while not all(row.done for row in rows):
        budgets = [row.budget for row in rows]                    # tokens each row may still emit
        t_start = clock()
        proposal = proposer.propose(state, draft_limits(budgets, k), generator).trimmed()   # propose
        t_proposed = clock()
        drafts = proposal.tokens.tolist()                             # (B, m)
        window = torch.tensor([[token] + row for token, row in zip(last, drafts)])  # (B, 1+m)
        width = window.shape[1]
        positions = next_positions(cache, width, context, longest=max(cached))
        t_window = clock()
        out = target(window, positions=positions, cache=cache, **layer_request(features))
        t_forward = clock()
        verdict = verify(proposal, out.logits)                        # accept: logits (B, 1+m, V)
        t_accepted = clock()
        accepted = verdict.accepted.tolist()
        runs, counts = commit(rows, drafts, accepted, verdict.next_token.tolist())  # (B, 1+m), (B,)
        # roll back: keep the window positions that predicted an emitted token
        cached = [n + c for n, c in zip(cached, counts)]
        cache.rollback(cached)
        # the newest emitted token opens the next window (finished rows keep theirs)
        last = [run[n - 1] if n else old for run, n, old in zip(runs, counts, last)]
        t_committed = clock()
        proposer.observe(state, Outcome(verdict.accepted, torch.tensor(runs), torch.tensor(counts),
                                        declared_features(out, features)))
        t_observed = clock()
        metrics.record_step([b > 0 for b in budgets], proposal.lengths.tolist(), accepted, counts)
        metrics.record_phases(t_start, t_proposed, t_window, t_forward, t_accepted, t_committed, t_observed, clock())
        metrics.first_token_seconds = metrics.first_token_seconds or t_committed - t0
    metrics.other_seconds = time.perf_counter() - t0 - metrics.total_seconds
    return rows, metrics


def draft_limits(budgets: list[int], k: int) -> torch.Tensor:
    """Drafts each row may propose (B,): a step emits accepted + 1 tokens, so at most budget - 1;
    finished rows (budget 0) propose none. The context needs no separate clip: check_inputs
    ensured that prompt + max_new_tokens fits, and the budget bounds every row's sequence."""
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
