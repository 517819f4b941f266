"""The lossless check a user runs on their own target and draft (`specdec check`): is speculative
decoding of this pair, with these sampling settings, really the target's distribution, and is its
greedy output really plain decoding's?

Sampled: N continuations are drawn by speculative decoding. Then each is scored by the target
itself, one forward over prompt + continuation per sequence: for the token x drawn at position t,
under the target's processed distribution target_probs (temperature, top-k, top-p) given the
prefix, with the vocabulary ordered from the most likely token down, the randomized
probability-integral transform

    U = F(x-) + V · target_probs[x],   F(x-) = the mass of the tokens before x in that order,  V ~ U(0, 1)

is uniform on (0, 1) exactly when x was drawn from target_probs, and each U is independent of the
earlier ones (the conditional distributions of a sequence, one after another: Rosenblatt's
transform). So under a lossless verifier all U's are i.i.d. uniform, whatever the vocabulary
size, and a one-sample Kolmogorov-Smirnov test checks it. A token with target_probs[x] = 0 (outside
top-k or top-p) cannot come from the target at all and fails the check outright. Ordering by
probability makes the test sensitive to what wrong verifiers do: keep too many (or too few) of
the likely tokens. Power, stated with every verdict: with n = all sampled tokens, the test
rejects at level α = 0.01 with probability >= 0.9 any departure whose distribution function of U
is at least (1.628 + 0.641) / sqrt(n) from the uniform one at some point (KS critical value,
plus 1.28 standard deviations of the empirical distribution function, at most 0.5 / sqrt(n)).

Greedy: every prompt is decoded greedily by speculative decoding and by plain decoding; they must
be equal, except a divergence where the target's top-2 logits are closer than NEAR_TIE (the
floating-point rule of docs/design.md, "The lossless contract"), which is reported as such.

This module knows nothing about argument parsing; cli.py prints what `check` returns.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from .decoding.decode import plain_generate
from .decoding.engine import speculative_generate
from .decoding.sampling import SamplingConfig, probabilities
from .decoding.stopping import StopRule
from .decoding.verify import Verdict, rejection_sample
from .errors import SpecdecError
from .lm.device import placement
from .lm.interface import causal_lm
from .proposers import Proposer

LEVEL = 0.01               # the test's significance level: a lossless pair fails 1% of checks
KS_CRITICAL = 1.628        # sqrt(-log(LEVEL / 2) / 2): the asymptotic KS critical value at LEVEL
POWER_MARGIN = 0.641       # 1.2816 (the normal's 90% quantile) x 0.5: the empirical CDF's largest sd
NEAR_TIE = 1e-4            # greedy: a divergence is forgiven only where the top-2 logit gap is below this


def ks_p_value(statistic: float, n: int) -> float:
    """P(D_n >= statistic) for n i.i.d. uniforms: Kolmogorov's limit with Stephens' correction
    (accurate to about 1e-3 from n = 5 on)."""
    lam = (math.sqrt(n) + 0.12 + 0.11 / math.sqrt(n)) * statistic
    if lam < 0.2:
        return 1.0
    total = sum(2 * (-1) ** (j - 1) * math.exp(-2 * j * j * lam * lam) for j in range(1, 101))
    return min(1.0, max(0.0, total))


def ks_uniform(u: torch.Tensor) -> tuple[float, float]:
    """(D, p-value) of the one-sample KS test of u (n,) against U(0, 1)."""
    n = u.numel()
    s = u.double().sort().values
    i = torch.arange(1, n + 1, dtype=torch.float64)
    d = max(float((i / n - s).max()), float((s - (i - 1) / n).max()))
    return d, ks_p_value(d, n)


def detectable_distance(n: int) -> float:
    """The smallest CDF distance the test detects with power >= 0.9 at LEVEL (module docstring)."""
    return (KS_CRITICAL + POWER_MARGIN) / math.sqrt(n)


def randomized_pit(target_probs: torch.Tensor, tokens: torch.Tensor, generator: torch.Generator
                   ) -> tuple[torch.Tensor, int]:
    """target_probs (T, V) processed distributions, tokens (T,) drawn one from each -> (U (T,),
    the count of tokens the distribution gives probability 0). Order: most likely first, ties by id."""
    probs = target_probs.double()
    order = torch.sort(probs, dim=-1, descending=True, stable=True).indices        # (T, V)
    rank = torch.empty_like(order).scatter_(1, order, torch.arange(probs.shape[1]).expand_as(order))
    sorted_probs = probs.gather(1, order)                                           # (T, V)
    before = sorted_probs.cumsum(-1) - sorted_probs                                 # mass before each rank
    r = rank.gather(1, tokens[:, None])[:, 0]                                       # (T,)
    mass = probs.gather(1, tokens[:, None])[:, 0]
    v = torch.rand(tokens.shape[0], generator=generator, dtype=torch.float64)
    u = (before.gather(1, r[:, None])[:, 0] + v * mass).clamp(0, 1)
    return u, int((mass == 0).sum())


@dataclass
class CheckResult:
    passed: bool
    sampled: dict          # KS statistic, p-value, tokens, sequences, impossible tokens, detectable distance
    greedy: dict           # prompts, identical, divergences at near-ties, divergences beyond them
    conditions: dict = field(default_factory=dict)

    def verdict(self) -> str:
        s, g = self.sampled, self.greedy
        head = "PASS: lossless as far as this check sees" if self.passed else "FAIL: not lossless"
        sampled = (f"sampled: KS D = {s['ks_statistic']:.4f}, p = {s['p_value']:.3g} (fails below {LEVEL}) over "
                   f"{s['tokens']} tokens of {s['sequences']} sequences; impossible tokens (target probability 0): "
                   f"{s['impossible_tokens']}; detects a departure of the PIT's distribution function of "
                   f"{s['detectable_distance']:.4f} or more with power >= 0.9")
        greedy = (f"greedy: {g['identical']}/{g['prompts']} prompts identical to plain decoding"
                  + (f", {g['near_ties']} diverged at a near-tie (top-2 gap < {NEAR_TIE:g})" if g["near_ties"] else "")
                  + (f", {g['wrong']} diverged beyond a near-tie (first at prompt {g['first_wrong']})"
                     if g["wrong"] else ""))
        c = self.conditions
        cond = ", ".join(f"{k}={v}" for k, v in c.items())
        return "\n".join([head, sampled, greedy, f"conditions: {cond}"])


@torch.inference_mode()
def check(target, proposer: Proposer, prompts: list[list[int]], sampling: SamplingConfig, k: int | str = 3,
          sequences: int = 64, max_new_tokens: int = 32, batch_size: int = 16, seed: int = 0,
          widths: tuple[int, ...] | None = None, sampled_verify=rejection_sample) -> CheckResult:
    """The lossless check of `proposer` drafting for `target` (a model, as `speculative_generate`
    takes it): `sequences` continuations of `max_new_tokens` tokens (EOS does not stop them)
    sampled under `sampling` from the prompts in turn, `batch_size` at a time, then every prompt
    decoded greedily both ways. `sampled_verify`: the acceptance rule of sampled chains (only a
    test replaces it, with a wrong one the check must catch)."""
    if sampling.greedy:
        raise SpecdecError("the sampled check needs a temperature > 0 (greedy is checked as well, always)")
    if not prompts:
        raise SpecdecError("the check needs at least one prompt")
    if sequences < 1 or max_new_tokens < 1 or batch_size < 1:
        raise SpecdecError(f"sequences, max_new_tokens and batch_size must be >= 1, got {sequences}, "
                           f"{max_new_tokens}, {batch_size}")
    lm = causal_lm(target, role="target")
    context = lm.config.max_position_embeddings
    longest = max(map(len, prompts))
    if longest + max_new_tokens > context:
        raise SpecdecError(f"a prompt of {longest} tokens plus max_new_tokens={max_new_tokens} exceeds the "
                           f"target's context of {context}: shorten the prompts or lower max_new_tokens")
    t0 = time.perf_counter()
    device = placement(lm).device
    rule = StopRule(max_new_tokens)
    generator = torch.Generator(device).manual_seed(seed)
    pit_generator = torch.Generator().manual_seed(seed + 1)
    us, impossible, accepted, proposed = [], 0, 0, 0
    chosen = [prompts[i % len(prompts)] for i in range(sequences)]
    for start in range(0, sequences, batch_size):
        batch = chosen[start:start + batch_size]
        rows, metrics = speculative_generate(lm, proposer, batch, rule, sampling, k, generator, widths=widths,
                                             sampled_verify=sampled_verify)
        accepted, proposed = accepted + metrics.accepted, proposed + metrics.proposed
        for prompt, row in zip(batch, rows):
            ids = torch.tensor([prompt + row.tokens], device=device)                # (1, P + n)
            logits = lm(ids).logits[0, len(prompt) - 1:-1]                           # (n, V)
            u, bad = randomized_pit(probabilities(logits, sampling).cpu(), torch.tensor(row.tokens), pit_generator)
            us.append(u)
            impossible += bad
    u = torch.cat(us)
    d, p_value = ks_uniform(u)
    greedy = greedy_check(lm, proposer, prompts, rule, k, widths)
    passed = p_value >= LEVEL and impossible == 0 and greedy["wrong"] == 0
    sampled = {"ks_statistic": d, "p_value": p_value, "level": LEVEL, "tokens": u.numel(), "sequences": sequences,
               "impossible_tokens": impossible, "detectable_distance": detectable_distance(u.numel()),
               "acceptance_rate": accepted / proposed if proposed else None}
    conditions = {"method": getattr(proposer, "name", type(proposer).__name__), "k": k,
                  "tree": ",".join(map(str, widths)) if widths else "none",
                  "temperature": sampling.temperature, "top_k": sampling.top_k, "top_p": sampling.top_p,
                  "seed": seed, "prompts": len(prompts), "max_new_tokens": max_new_tokens, "batch_size": batch_size,
                  "eos": "does not stop", "acceptance_rate": None if not proposed else round(accepted / proposed, 3),
                  "seconds": round(time.perf_counter() - t0, 1)}
    return CheckResult(passed, sampled, greedy, conditions)


def greedy_check(lm, proposer: Proposer, prompts: list[list[int]], rule: StopRule, k: int | str,
                 widths: tuple[int, ...] | None) -> dict:
    """Greedy speculative decoding of each prompt against plain decoding, one prompt at a time."""
    greedy, identical, near, wrong, first_wrong = SamplingConfig(), 0, 0, 0, None
    for i, prompt in enumerate(prompts):
        spec, _ = speculative_generate(lm, proposer, [prompt], rule, greedy, k, widths=widths)
        plain, _ = plain_generate(lm, [prompt], rule, greedy)
        got, expected = spec[0].tokens, plain[0].tokens
        if got == expected:
            identical += 1
            continue
        j = next((t for t, (a, b) in enumerate(zip(got, expected)) if a != b), min(len(got), len(expected)))
        logits = lm(torch.tensor([prompt + expected[:j]], device=placement(lm).device)).logits[0, -1].float()
        top2 = logits.topk(2).values
        if float(top2[0] - top2[1]) < NEAR_TIE:
            near += 1
        else:
            wrong += 1
            first_wrong = i if first_wrong is None else first_wrong
    return {"prompts": len(prompts), "identical": identical, "near_ties": near, "wrong": wrong,
            "first_wrong": first_wrong}


def accept_always(draft_tokens, draft_probs, target_probs, generator=None, draft_lengths=None) -> Verdict:
    """A deliberately wrong verifier: keeps every draft, then a bonus token from the target (what
    `specdec check --wrong-verifier` runs, to show the check fails on this pair when it should)."""
    B, k = draft_tokens.shape
    lengths = draft_lengths if draft_lengths is not None else torch.full((B,), k, device=draft_tokens.device)
    rows = torch.arange(B, device=draft_tokens.device)
    bonus = torch.multinomial(target_probs[rows, lengths], 1, generator=generator)[:, 0]
    return Verdict(lengths, bonus)


WRONG_VERIFIERS = {"accept-always": accept_always}
