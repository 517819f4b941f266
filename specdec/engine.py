"""Speculative decoding: prefill, then loop propose -> verify -> accept -> commit.

Every row of the batch keeps its own sequence, cache length, accepted counts and stop state. The
target's cache lags one token behind each sequence: the newest token ("last") opens the next
verification window [last, d_1..d_m], scored by ONE target forward pass for all rows. Tokens are
emitted through `Row.append` one at a time, so EOS, stop strings and max_new_tokens cut exactly
inside an accepted run; then each row's target cache is rolled back to the tokens it kept and the
proposer is told what was committed. k = 0 proposes nothing: one token per step, plain decoding.

A proposal may be a tree (tree.py; `widths` caps the drafts per depth): the window then carries
every node, with positions by depth and a tree attention mask, acceptance walks the tree, and the
cache keeps the accepted path's entries moved to follow each other (`KVCache.compact`).

k = "auto" chooses each step's depth (0: plain decoding) and shape from what pays (adaptive.py):
the controller is told what each step accepted and cost.

This module knows nothing about particular proposers (proposers/), acceptance rules (verify.py)
or model internals (lm.py).
"""
from __future__ import annotations

import time

import torch

from .adaptive import Adaptive
from .errors import SpecdecError
from .lm import causal_lm, context_length, next_positions, prefill_all_but_last
from .metrics import SpecMetrics
from .model import LlamaForCausalLM
from .proposers.base import Outcome, Proposal, Proposer
from .sampling import SamplingConfig, pick, probabilities
from .stopping import Row, StopRule
from .tree import levels_reached, path_columns, window_layout
from .verify import Verdict, greedy_accept, rejection_sample, tree_rejection_sample


@torch.inference_mode()
def speculative_generate(target, proposer: Proposer, prompts: list[list[int]], rule: StopRule,
                         sampling: SamplingConfig, k: int | str, generator: torch.Generator | None = None,
                         *, widths: tuple[int, ...] | None = None, sampled_verify=rejection_sample,
                         tree_verify=tree_rejection_sample) -> tuple[list[Row], SpecMetrics]:
    """k: drafts per step, or "auto" (adaptive.py). widths: the most drafts per depth (len k;
    default all ones, a chain; with "auto", the tree shape tried beside chains). `sampled_verify`
    and `tree_verify` are the acceptance rules used when sampling chains and trees (signatures of
    verify.rejection_sample and verify.tree_rejection_sample); tests replace them to show a wrong
    rule is detected."""
    target = causal_lm(target, role="target")
    context = context_length(target)
    adaptive = None
    if k == "auto":
        check_inputs(target, proposer, prompts, rule, 0, None, context)
        adaptive = Adaptive.for_run(target, proposer, len(prompts), widths)
        k, widths = adaptive.depth, adaptive.widest
    widths = check_inputs(target, proposer, prompts, rule, k, widths, context)
    verify = _verifier(sampling, sampled_verify, tree_verify, generator)
    metrics = SpecMetrics(k=k, batch_size=len(prompts))
    rows = [Row(rule) for _ in prompts]
    t0 = time.perf_counter()
    with metrics.timed("prefill_seconds"):
        max_len = max(map(len, prompts)) + rule.max_new_tokens  # the longest sequence a row can reach
        cache = target.new_cache(len(prompts), max_len + sum(widths))  # + room for padded windows
        state = proposer.start(prompts, prefill_all_but_last(target, cache, prompts), sampling, max_len, k)
        last = [p[-1] for p in prompts]                           # (B,) newest token, not in the cache
        cached = [len(p) - 1 for p in prompts]                    # (B,) the target cache's lengths
    clock = time.perf_counter
    while not all(row.done for row in rows):
        budgets = [row.budget for row in rows]                    # tokens each row may still emit
        active = [b > 0 for b in budgets]
        t_start = clock()
        depth, shape, stretch = adaptive.choose(active) if adaptive else (k, widths, None)
        if depth == 0:  # plain decoding for a stretch of steps; the proposer hears of them at its end
            last, cached, steps, forward = plain_stretch(target, proposer, state, cache, rows, last, cached, stretch,
                                                         context, sampling, generator, metrics)
            metrics.first_token_seconds = metrics.first_token_seconds or clock() - t0
            if adaptive:
                adaptive.observe_plain(steps, clock() - t_start, forward)
            continue
        limits = draft_limits(budgets, depth)
        proposal = proposer.propose(state, limits, shape, generator).trimmed()   # propose
        t_proposed = clock()
        drafts = proposal.tokens.tolist()                             # (B, m)
        window = torch.tensor([[token] + row for token, row in zip(last, drafts)])  # (B, 1+m)
        if proposal.parents is None:                                  # a chain: causal, default positions
            positions, tree = next_positions(cache, window.shape[1], context, longest=max(cached)), None
        else:
            positions, tree = window_layout(proposal.parents, proposal.lengths.tolist(), cached, context)
        t_window = clock()
        out = target(window, positions=positions, cache=cache, attention_mask=tree)
        t_forward = clock()
        verdict = verify(proposal, out.logits)                        # accept: logits (B, 1+m, V)
        t_accepted = clock()
        accepted = verdict.accepted.tolist()
        paths = verdict.paths or [range(n) for n in accepted]
        runs, counts = commit(rows, drafts, paths, verdict.next_token.tolist())  # (B, 1+m), (B,)
        # keep the window entries that predicted an emitted token: the root, then the accepted path
        if verdict.paths is not None:
            cache.compact(cached, verdict.paths)
        cached = [n + c for n, c in zip(cached, counts)]
        cache.rollback(cached)
        # the newest emitted token opens the next window (finished rows keep theirs)
        last = [run[n - 1] if n else old for run, n, old in zip(runs, counts, last)]
        t_committed = clock()
        hidden = out.hidden if verdict.paths is None else out.hidden.gather(
            1, path_columns(verdict.paths, window.shape[1])[..., None].expand_as(out.hidden))
        proposer.observe(state, Outcome(verdict.accepted, torch.tensor(runs), torch.tensor(counts), hidden,
                                        verdict.paths))
        t_observed = clock()
        lengths = proposal.lengths.tolist()
        metrics.record_step(active, lengths, accepted, counts, None if verdict.paths is None
                            else levels_reached(proposal.parents, lengths, verdict.paths))
        metrics.record_phases(t_start, t_proposed, t_window, t_forward, t_accepted, t_committed, t_observed, clock())
        metrics.first_token_seconds = metrics.first_token_seconds or t_committed - t0
        if adaptive:
            adaptive.observe(limits.tolist(), accepted, active, window.shape[1],
                             t_proposed - t_start + t_observed - t_committed, clock() - t_start, t_forward - t_window)
    metrics.other_seconds = time.perf_counter() - t0 - metrics.total_seconds
    if adaptive:
        adaptive.remember()
        metrics.adaptive = adaptive.summary()
    return rows, metrics


def plain_stretch(target, proposer: Proposer, state, cache, rows: list[Row], last: list[int], cached: list[int],
                  steps: int | None, context: int, sampling: SamplingConfig, generator,
                  metrics: SpecMetrics) -> tuple[list[int], list[int], int, float]:
    """Plain decoding, one token per row per forward, for `steps` steps (None: until every row is
    done), as lean as decoding without a proposer; the proposer then observes the whole stretch at
    once (no drafts, every token the target's). Returns the new `last` and `cached`, the steps
    taken and the seconds of their forwards."""
    B, clock = len(rows), time.perf_counter
    emitted, hidden, step, forward, last = [[] for _ in rows], [], 0, 0.0, list(last)
    t_start = clock()
    window = torch.tensor(last)[:, None]  # (B, 1)
    while not all(row.done for row in rows) and (steps is None or step < steps):
        active = [not row.done for row in rows]
        t_window = clock()
        out = target(window, positions=next_positions(cache, 1, context, longest=max(cached)), cache=cache)
        forward += clock() - t_window
        picked = pick(out.logits[:, -1], sampling, generator)  # (B,)
        counts = [emit(row, [token], 1) for row, token in zip(rows, picked.tolist())]
        for b, n in enumerate(counts):
            if n:
                last[b] = rows[b].tokens[-1]
                emitted[b].append(last[b])
        cached = [c + n for c, n in zip(cached, counts)]
        if not all(counts):
            cache.rollback(cached)  # rows already done keep their length
        hidden.append(out.hidden)
        window = picked[:, None]  # rows already done feed a token nobody reads
        metrics.record_step(active, [0] * B, [0] * B, counts)
        step += 1
    t_observe = clock()
    width = max(map(len, emitted))
    proposer.observe(state, Outcome(torch.zeros(B, dtype=torch.long),
                                    torch.tensor([e + [0] * (width - len(e)) for e in emitted]),
                                    torch.tensor([len(e) for e in emitted]), torch.cat(hidden, 1)))
    metrics.observe_seconds += clock() - t_observe
    metrics.forward_seconds += forward
    metrics.commit_seconds += t_observe - t_start - forward
    return last, cached, step, forward


def draft_limits(budgets: list[int], k: int) -> torch.Tensor:
    """Drafts each row may propose (B,): a step emits accepted + 1 tokens, so at most budget - 1;
    finished rows (budget 0) propose none. The context needs no separate clip: check_inputs
    ensured that prompt + max_new_tokens fits, and the budget bounds every row's sequence."""
    return torch.tensor([min(max(budget - 1, 0), k) for budget in budgets])


def commit(rows: list[Row], drafts: list[list[int]], paths: list, next_tokens: list[int]
           ) -> tuple[list[list[int]], list[int]]:
    """Emit each row's accepted drafts (the nodes of its path) and then its recovered/bonus token
    through Row.append, one at a time, so a stop inside the run cuts it. Returns each row's run
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
        row.append(run[i])
    return n


def _verifier(sampling: SamplingConfig, sampled_verify, tree_verify, generator):
    """The acceptance rule for these sampling settings, chosen once (chain or tree per proposal)."""
    if sampling.greedy:
        return lambda proposal, logits: greedy_accept(proposal.tokens, logits, proposal.lengths, proposal.parents)

    def sampled(proposal: Proposal, logits: torch.Tensor) -> Verdict:
        if proposal.parents is None:
            return sampled_verify(proposal.tokens, proposal.draft_probs, probabilities(logits, sampling),
                                  generator, proposal.lengths)
        return tree_verify(proposal.tokens, proposal.draft_probs, probabilities(logits, sampling),
                           proposal.parents, generator, proposal.lengths)
    return sampled


def check_inputs(target, proposer: Proposer, prompts: list[list[int]], rule: StopRule, k: int,
                 widths: tuple[int, ...] | None, context: int) -> tuple[int, ...]:
    """Refuse bad input with a message saying what to give instead; return the widths per depth."""
    if k < 0:
        raise SpecdecError(f"k (draft tokens per step) must be >= 0, got {k}")
    widths = (1,) * k if widths is None else tuple(widths)
    if len(widths) != k or any(w < 1 for w in widths):
        raise SpecdecError(f"a draft tree needs one width >= 1 per depth (k={k} depths), got {widths}")
    if max(widths, default=1) > 1 and not isinstance(target, LlamaForCausalLM):
        raise SpecdecError("draft trees need specdec's own LlamaForCausalLM as the target (its forward takes a "
                           "tree attention mask); use chains (widths of 1) with this target")
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
    return widths
