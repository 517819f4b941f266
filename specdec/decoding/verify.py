"""Verification of draft tokens against the target: pure tensor functions, no models, no state.

Vocabulary (docs/design.md, "Vocabulary"). A row proposes draft tokens d_1..d_L (L = its draft length, at
most k; shorter rows are right-padded to k). The target scored the window [last, d_1..d_k] in one
forward pass, so position i of `target_logits` / `target_probs` (B, k+1, V) is its distribution of
the token that follows d_i (position 0: the token after `last`).

- accepted tokens: the longest prefix of drafts the target agrees with, n per row (0 <= n <= L);
- recovered token: when n < L, the target's token at position n, in place of the rejected d_{n+1};
- bonus token: when n == L, the target's token at position L, after the last draft.

Each step thus emits n + 1 tokens per row. `Verdict.next_token` is the recovered or bonus token.

Greedy: a draft is accepted iff it is the target's argmax. Sampling (Leviathan et al. 2023, Chen et
al. 2023): d_i is accepted with probability min(1, target_probs[d_i] / draft_probs[d_i]); at the
first rejection the recovered token is drawn from the residual max(0, target_probs - draft_probs)
normalised. The emitted token is then distributed exactly as target_probs. Deterministic proposers
(n-gram lookup) pass draft_probs=None, meaning one-hot on the drafted token: acceptance with
probability target_probs[d_i] and the residual is target_probs without d_i, which stays lossless.

Trees (tree.py): the drafts may branch, each naming its parent. Acceptance walks from the root:
greedy follows the child whose token is the target's argmax; sampling (multi-draft speculative
sampling, SpecInfer / EAGLE-2) tries the children of the current node in order, accepting child c
with probability min(1, p(d_c) / q_c(d_c)) where p is the target's distribution there, and after
each rejection replaces p by the residual max(0, p - q_c) normalised; when every child is
rejected, the next token is drawn from what is left of p. Each child's q_c is the distribution it
was drawn from given the siblings tried before it (one-hot for a deterministic draft), so the
emitted token is still distributed as the target's. The accepted drafts are then a path of nodes
(`Verdict.paths`); for a chain, its first n nodes.

The sampled rules take probabilities already processed by the same temperature / top-k / top-p
transform for target and draft (sampling.probabilities); this module knows nothing about models,
caches or stopping.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from .sampling import of_rows, perturbed, row_probabilities
from .tree import depths

from .sampling import argmax, sample, uniform
from .tree import children


class Verdict(NamedTuple):
    accepted: torch.Tensor    # (B,) long, number of drafts accepted per row
    next_token: torch.Tensor  # (B,) long, the recovered token (after a rejection) or the bonus token
    paths: list[list[int]] | None = None  # per row, the accepted nodes of a tree; None: a chain's first n


def _draft_lengths(draft_tokens: torch.Tensor, draft_lengths: torch.Tensor | None) -> torch.Tensor:
    B, k = draft_tokens.shape
    if draft_lengths is None:
        return torch.full((B,), k, dtype=torch.long, device=draft_tokens.device)
    return draft_lengths


def _prefix_length(ok: torch.Tensor) -> torch.Tensor:
    """(B, k) bool -> (B,) length of the leading run of True."""
    return ok.long().cumprod(1).sum(1)


def greedy_accept(draft_tokens: torch.Tensor, target_logits: torch.Tensor,
                  draft_lengths: torch.Tensor | None = None, parents: torch.Tensor | None = None) -> Verdict:
    """draft_tokens (B, m); target_logits (B, m+1, V); draft_lengths (B,) real drafts per row
    (default m); parents (B, m) the tree (tree.py), None for a chain. A draft is accepted while it
    is the target's argmax after its accepted parent.

    Only an argmax over the vocabulary; on the CPU the walk runs over at most m ids per row on the
    host, which costs less than the dozen tiny tensor operations it would take; on a GPU a chain is
    judged by those operations instead, without waiting for the device."""
    device = draft_tokens.device
    if parents is None and device.type != "cpu":
        target = target_logits.argmax(-1)                                                   # (B, m+1)
        m = draft_tokens.shape[1]
        lengths = _draft_lengths(draft_tokens, draft_lengths)
        ok = (draft_tokens == target[:, :m]) & (torch.arange(m, device=device)[None] < lengths[:, None])
        accepted = _prefix_length(ok)
        return Verdict(accepted, target.gather(1, accepted[:, None])[:, 0])
    target_tokens = argmax(target_logits).tolist()  # (B, m+1)
    lengths = _draft_lengths(draft_tokens, draft_lengths).tolist()
    drafts = draft_tokens.tolist()
    if parents is None:
        accepted, next_token = [], []
        for row, target, n_drafts in zip(drafts, target_tokens, lengths):
            n = 0
            while n < n_drafts and row[n] == target[n]:
                n += 1
            accepted.append(n)
            next_token.append(target[n])
        return Verdict(torch.tensor(accepted, device=device), torch.tensor(next_token, device=device))
    paths, next_token = [], []
    for row, target, n_drafts, row_parents in zip(drafts, target_tokens, lengths, parents.tolist()):
        kids, node, path = children(row_parents, n_drafts), -1, []
        while True:
            want = target[node + 1]
            node = next((c for c in kids.get(node, ()) if row[c] == want), None)
            if node is None:
                break
            path.append(node)
        paths.append(path)
        next_token.append(want)
    return Verdict(torch.tensor([len(p) for p in paths], device=device), torch.tensor(next_token, device=device),
                   paths)


def residual(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """(B, V), (B, V) -> (B, V): max(0, target_probs - draft_probs), normalised.

    Where the mass is zero (target and draft equal up to rounding, so a rejection there has
    probability zero) the target's distribution is returned instead, to keep the sampler defined.
    """
    excess = (target_probs - draft_probs).clamp(min=0)
    mass = excess.sum(-1, keepdim=True)
    return torch.where(mass > 0, excess / mass.clamp(min=torch.finfo(excess.dtype).tiny), target_probs)


def rejection_sample(draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
                     target_probs: torch.Tensor, generator: torch.Generator | None = None,
                     draft_lengths: torch.Tensor | None = None) -> Verdict:
    """draft_tokens (B, k); draft_probs (B, k, V) the distributions the drafts were sampled from,
    or None for deterministic drafts; target_probs (B, k+1, V); draft_lengths (B,) (default k);
    generator: one for all rows, or one per row (sampling.RowGenerators).

    Accept d_i with probability min(1, target/draft), then emit a recovered token from the
    residual at the first rejection, or a bonus token from target_probs after the last draft.
    """
    B, k = draft_tokens.shape
    rows = torch.arange(B, device=draft_tokens.device)
    lengths = _draft_lengths(draft_tokens, draft_lengths)
    proposed = torch.arange(k, device=draft_tokens.device)[None] < lengths[:, None]  # (B, k)
    target_p = target_probs[:, :k].gather(2, draft_tokens[..., None]).squeeze(2)     # (B, k)
    if draft_probs is None:
        draft_p = torch.ones_like(target_p)
    else:
        draft_p = draft_probs.gather(2, draft_tokens[..., None]).squeeze(2)          # (B, k)
    u = uniform(B, k, generator, device=target_p.device)
    # u < target/draft, written without the division (draft_p > 0 for any sampled draft)
    accepted = _prefix_length((u * draft_p < target_p) & proposed)                    # (B,)

    at = target_probs[rows, accepted]                                                 # (B, V)
    rejected = accepted < lengths
    if k > 0:
        pos = accepted.clamp(max=k - 1)
        if draft_probs is None:
            draft_at = torch.nn.functional.one_hot(draft_tokens[rows, pos], at.shape[-1]).to(at.dtype)
        else:
            draft_at = draft_probs[rows, pos]                                         # (B, V)
        at = torch.where(rejected[:, None], residual(at, draft_at), at)
    next_token = sample(at, generator)
    return Verdict(accepted, next_token)


def tree_rejection_sample(draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
                          target_probs: torch.Tensor, parents: torch.Tensor,
                          generator: torch.Generator | None = None,
                          draft_lengths: torch.Tensor | None = None, residual_rule=None) -> Verdict:
    """Multi-draft verification of a tree: draft_tokens (B, m), draft_probs (B, m, V) the
    distribution each node was drawn from given the siblings tried before it (one-hot rows for
    deterministic nodes; None: every node deterministic), target_probs (B, m+1, V), parents (B, m)
    (tree.py), draft_lengths (B,) (default m).

    From the root, try the current node's children in order: accept child c with probability
    min(1, p(d_c) / q_c(d_c)) and move to it; after a rejection p becomes the residual
    max(0, p - q_c) normalised. When every child is rejected (or there is none) the next token is
    drawn from p. `residual_rule` replaces `residual` (tests show a wrong one is detected)."""
    rule = residual if residual_rule is None else residual_rule
    B, m = draft_tokens.shape
    lengths = _draft_lengths(draft_tokens, draft_lengths).tolist()
    u = uniform(B, m, generator, device=draft_tokens.device).tolist()  # one per node: each is tried at most once
    tokens, rows_parents = draft_tokens.tolist(), parents.tolist()
    paths, last_probs = [], []
    for b in range(B):
        kids, node, path = children(rows_parents[b], lengths[b]), -1, []
        p = target_probs[b, 0]
        while True:
            for c in kids.get(node, ()):
                x = tokens[b][c]
                q = None if draft_probs is None else draft_probs[b, c]
                if u[b][c] * (1.0 if q is None else float(q[x])) < float(p[x]):
                    break
                if q is None:
                    q = torch.zeros_like(p)
                    q[x] = 1.0
                p = rule(p[None], q[None])[0]
            else:
                break  # every child rejected: the next token comes from what is left of p
            path.append(c)
            node = c
            p = target_probs[b, c + 1]
        paths.append(path)
        last_probs.append(p)
    next_token = sample(torch.stack(last_probs), generator)
    return Verdict(torch.tensor([len(p) for p in paths], device=draft_tokens.device), next_token, paths)


def by_kind(proposal, logits: torch.Tensor, samplings: list, cached: list[int], generator, sampled_verify,
            tree_verify) -> Verdict:
    """The verdict of a batch whose rows sample differently (one call per kind present): greedy rows by
    greedy acceptance; seeded rows by greedy acceptance on their perturbed log-probabilities
    (sampling.perturbed: the noise of each window column's position, after each row's `cached` tokens);
    other sampled rows by `sampled_verify` (chains) or `tree_verify` (trees) on their own settings'
    probabilities. proposal: protocol.Proposal; logits (B, 1+m, V); samplings (B,) SamplingConfig;
    generator: the rows' (one, or sampling.RowGenerators)."""
    kinds = {"greedy": [], "seeded": [], "sampled": []}
    for b, sampling in enumerate(samplings):
        kinds["greedy" if sampling.greedy else "seeded" if sampling.seeded else "sampled"].append(b)
    parents = proposal.parents

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
        positions = [[cached[b] + 1 + d for d in row] for b, row in zip(rows, depth)]
        return by_greedy(rows, index, perturbed(row_logits, [samplings[b] for b in rows], positions))

    def by_sampling(rows, index, row_logits):
        tokens, lengths = proposal.tokens[index], proposal.lengths[index]
        draft_probs = None if proposal.draft_probs is None else proposal.draft_probs[index]
        target_probs = row_probabilities(row_logits, [samplings[b] for b in rows])
        g = of_rows(generator, rows)
        if parents is None:
            return sampled_verify(tokens, draft_probs, target_probs, g, lengths)
        return tree_verify(tokens, draft_probs, target_probs, parents[index], g, lengths)

    rules = {"greedy": by_greedy, "seeded": by_seed, "sampled": by_sampling}
    present = [(kind, rows) for kind, rows in kinds.items() if rows]
    if len(present) == 1:
        kind, rows = present[0]
        return rules[kind](rows, slice(None), logits)
    device = logits.device
    accepted, next_token = (torch.empty(len(samplings), dtype=torch.long, device=device) for _ in range(2))
    paths = None if parents is None else [None] * len(samplings)
    for kind, rows in present:
        index = torch.tensor(rows, device=device)
        verdict = rules[kind](rows, index, logits[index])
        accepted[index], next_token[index] = verdict.accepted, verdict.next_token
        if paths is not None:
            for b, path in zip(rows, verdict.paths):
                paths[b] = path
    return Verdict(accepted, next_token, paths)
