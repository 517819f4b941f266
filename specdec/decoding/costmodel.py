"""The cost model of speculative decoding (docs/design.md, "The cost model"): what speedup to expect from the
acceptance, the draft's cost and the target's measured verify-cost curve, and why MoE targets and
large batches erase the gain.

A step drafts k tokens and verifies [last, d_1..d_k] in one target forward of k + 1 tokens; it
emits on average E tokens (accepted drafts plus the recovered or bonus token), so

    predicted speedup = E × t_verify(1) / (t_draft + t_verify(k + 1) + overhead)

where t_verify(n) is the *measured* time of a target forward over n new tokens per row (never the
ideal "n tokens cost as much as one"), t_draft the proposer's time per step and overhead the
engine's own bookkeeping per step. Batch B: one forward carries B × (k + 1) tokens; with a curve
measured at batch 1, B rows of n tokens are costed as one row of B × n tokens (the same matrix
shapes), so speculation pays only while t_verify(B (k + 1)) / t_verify(B) stays below E.

This module is pure arithmetic; it knows nothing about models or timing (bench/ measures).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import SpecdecError


def expected_tokens_iid(alpha: float, k: int) -> float:
    """E for a chain of k drafts each accepted with probability α, independently:
    (1 - α^(k+1)) / (1 - α); k + 1 when α = 1."""
    if not 0 <= alpha <= 1:
        raise SpecdecError(f"an acceptance rate is a probability in [0, 1], got {alpha}")
    if k < 0:
        raise SpecdecError(f"k (draft tokens per step) must be >= 0, got {k}")
    return float(k + 1) if alpha == 1 else (1 - alpha ** (k + 1)) / (1 - alpha)


def expected_tokens(alpha_per_position: list[float | None]) -> float:
    """E = 1 + Σ_i Π_{j<=i} α_j from per-position acceptance α_1..α_k (metrics.acceptance_per_position).
    A position never reached (None) contributes nothing: no earlier draft survived to it."""
    total, survive = 1.0, 1.0
    for a in alpha_per_position:
        if a is not None and not 0 <= a <= 1:
            raise SpecdecError(f"per-position acceptance must lie in [0, 1], got {a}")
        survive *= a or 0.0
        total += survive
    return total


@dataclass(frozen=True)
class VerifyCurve:
    """Measured seconds of one target forward over n new tokens per row, at one batch size.
    Between measured points the time is interpolated linearly; beyond them it is not guessed."""
    seconds: dict[int, float]   # tokens per row -> median seconds
    batch_size: int = 1

    def __post_init__(self):
        if 1 not in self.seconds:
            raise SpecdecError("a verify-cost curve needs the 1-token forward (the plain decoding step)")
        if any(n < 1 or s <= 0 for n, s in self.seconds.items()):
            raise SpecdecError(f"verify-cost points must be (tokens >= 1, seconds > 0), got {self.seconds}")

    def at(self, n: float) -> float:
        points = sorted(self.seconds)
        if not points[0] <= n <= points[-1]:
            raise SpecdecError(f"the verify-cost curve was measured for {points[0]}..{points[-1]} tokens, "
                               f"not {n}: measure it up to the tokens one forward carries (batch × (k + 1))")
        hi = next(p for p in points if p >= n)
        lo = max(p for p in points if p <= n)
        if hi == lo:
            return self.seconds[lo]
        w = (n - lo) / (hi - lo)
        return (1 - w) * self.seconds[lo] + w * self.seconds[hi]

    def relative(self) -> dict[int, float]:
        """t(n) / t(1) per measured n."""
        return {n: s / self.seconds[1] for n, s in sorted(self.seconds.items())}


def predicted_speedup(alpha_per_position: list[float | None], draft_seconds: float, curve: VerifyCurve,
                      overhead_seconds: float = 0.0, batch_size: int = 1,
                      proposal_rate_per_position: list[float | None] | None = None,
                      mean_drafts: float | None = None, prefill_seconds_per_token: float = 0.0) -> float:
    """Predicted speedup over plain decoding with a chain of up to k = len(alpha_per_position) drafts.

    A proposer that does not always draft k tokens (n-gram lookup drafts only what it finds) is
    described by p_i (metrics.proposal_rate_per_position: the chance draft i is proposed once
    reachable) and its mean drafts per step: then E = 1 + Σ_i Π_{j<=i} p_j α_j and a step verifies
    1 + mean_drafts tokens. Both default to a proposer that always drafts k.

    draft_seconds and overhead_seconds are per step (one forward over the whole batch). With
    batch_size B > 1 on a batch-1 curve, B rows of n tokens are costed as B × n tokens of one row;
    pass a curve measured at that batch size (curve.batch_size == B) to use it as it is.

    prefill_seconds_per_token: the prompt's prefill spread over the tokens a generation emits
    (the same for both decoders), for a speedup measured on whole generations: then
    S = (t_plain + p) / (t_spec + p) per emitted token, which a long prompt pulls towards 1."""
    if batch_size < 1:
        raise SpecdecError(f"batch size must be >= 1, got {batch_size}")
    k = len(alpha_per_position)
    rates = proposal_rate_per_position or [1.0] * k
    if len(rates) != k:
        raise SpecdecError(f"{len(rates)} proposal rates for {k} acceptance rates")
    drafts = k if mean_drafts is None else mean_drafts
    rows = batch_size if curve.batch_size == 1 else 1
    if curve.batch_size not in (1, batch_size):
        raise SpecdecError(f"the verify-cost curve was measured at batch {curve.batch_size}, not {batch_size}")
    plain_step = curve.at(rows)
    spec_step = draft_seconds + curve.at(rows * (1 + drafts)) + overhead_seconds
    reached = [None if a is None or p is None else a * p for a, p in zip(alpha_per_position, rates)]
    per_row = rows if curve.batch_size == 1 else batch_size  # tokens a plain step emits
    plain_token = plain_step / per_row
    spec_token = spec_step / (expected_tokens(reached) * per_row)
    return (plain_token + prefill_seconds_per_token) / (spec_token + prefill_seconds_per_token)


def speedup_limit(tau: float, k: int, curve: VerifyCurve, mean_drafts: float | None = None) -> float:
    """S_limit = τ × t(1) / t(1 + d): the speedup with a free draft and no overhead, d the mean
    drafts verified per step (k for a proposer that always drafts k)."""
    return tau * curve.at(1) / curve.at(1 + (k if mean_drafts is None else mean_drafts))


def moe_distinct_experts(num_experts: int, top_k: int, n_tokens: int) -> float:
    """Expected distinct experts a layer touches for n tokens, each routed to top_k of num_experts
    uniformly at random: E × (1 - (1 - r/E)^n). Dense models: always all of their (one) MLP."""
    if not 1 <= top_k <= num_experts:
        raise SpecdecError(f"MoE routing needs 1 <= top_k <= experts, got top_k={top_k}, experts={num_experts}")
    if n_tokens < 0:
        raise SpecdecError(f"token count must be >= 0, got {n_tokens}")
    return num_experts * (1 - (1 - top_k / num_experts) ** n_tokens)


def moe_verify_ratio(n_tokens: int, num_experts: int, top_k: int, expert_fraction: float) -> float:
    """Bandwidth-bound estimate of t(n) / t(1) for an MoE target: the weight bytes read grow with
    the distinct experts touched. expert_fraction: share of the bytes a 1-token forward reads that
    are expert weights (top_k experts per layer); the rest (attention, embeddings, router) is read
    once whatever n is. A dense model is expert_fraction = 0: ratio 1 at any n."""
    if not 0 <= expert_fraction <= 1:
        raise SpecdecError(f"expert_fraction is a share of bytes in [0, 1], got {expert_fraction}")
    touched = moe_distinct_experts(num_experts, top_k, n_tokens) / top_k
    return (1 - expert_fraction) + expert_fraction * touched


def moe_curve(curve: VerifyCurve, num_experts: int, top_k: int, expert_fraction: float) -> VerifyCurve:
    """A dense verify-cost curve turned into an MoE estimate: at each n the larger of the measured
    time and the bandwidth-bound time t(1) × moe_verify_ratio(n) (the expert bytes n tokens read)."""
    return VerifyCurve({n: max(s, curve.seconds[1] * moe_verify_ratio(n, num_experts, top_k, expert_fraction))
                        for n, s in curve.seconds.items()}, curve.batch_size)


def break_even_alpha(k: int, cost_ratio: float) -> float | None:
    """The i.i.d. acceptance α at which E(α, k) equals cost_ratio = (t_draft + t_verify(k+1)) / t_verify(1):
    below it speculation loses. None when even α = 1 cannot pay (cost_ratio > k + 1)."""
    if cost_ratio <= 1:
        return 0.0
    if cost_ratio > k + 1:
        return None
    lo, hi = 0.0, 1.0
    for _ in range(60):  # bisection: E is increasing in α
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_tokens_iid(mid, k) < cost_ratio else (lo, mid)
    return (lo + hi) / 2


@dataclass(frozen=True)
class Prediction:
    """The cost model's figures for one chain of k drafts (a row of `specdec simulate`)."""
    k: int
    tokens_per_step: float       # E
    verify_ratio: float          # t_verify(B (k + 1)) / t_verify(B)
    draft_ratio: float           # the draft's seconds per step / t_verify(B)
    speedup: float               # predicted
    limit: float                 # S_limit: the speedup with a free draft, E / verify_ratio
    break_even: float | None     # the i.i.d. α below which this chain loses (None: it never pays)


def predictions(chains: list[list[float]], draft_cost: float, curve: VerifyCurve, batch_size: int = 1
                ) -> list[Prediction]:
    """A Prediction for each chain's α_1..α_k, its draft costing `draft_cost` x t_verify(1 token)
    per drafted token, at `batch_size` rows."""
    rows = batch_size if curve.batch_size == 1 else 1  # a batch-1 curve costs B rows as B x n tokens of one
    t1 = curve.at(rows)
    out = []
    for alphas in chains:
        k = len(alphas)
        draft = draft_cost * k * t1
        E = expected_tokens(alphas)
        ratio = curve.at(rows * (k + 1)) / t1
        out.append(Prediction(k, E, ratio, draft / t1, predicted_speedup(alphas, draft, curve, batch_size=batch_size),
                              E / ratio, break_even_alpha(k, ratio + draft / t1)))
    return out
