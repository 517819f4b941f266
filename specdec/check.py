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
the likely tokens.

The decision, in two stages so that a CI can gate on it: a first run of n tokens whose KS p-value
is at least FIRST_LEVEL passes; below it, a second run of n tokens with independent seeds decides,
failing when its p-value is below SECOND_LEVEL. A lossless pair (p-values uniform) thus fails with
probability FIRST_LEVEL x SECOND_LEVEL = 0.001, and pays the second run in 2% of checks only
(a single run at level 0.001 would need 30% more tokens for the same power). Power, stated with
every verdict: a departure whose distribution function of U is at least DETECTABLE / sqrt(n) from
the uniform one at some point is rejected by each run with probability >= Φ((DETECTABLE - c) /
0.5), c the KS critical value of its level (the empirical distribution function's standard
deviation is at most 0.5 / sqrt(n)), so by both with probability >= 0.9: the same power at the
same distance as one run at level 0.01 had, (1.628 + 0.641) / sqrt(n), at a tenth of its false
alarms. A check during which no draft was proposed tested plain sampling only: UNDECIDED.

Greedy: every prompt is decoded greedily by speculative decoding and by plain decoding; they must
be equal, except a divergence where the target's top-2 logits are closer than NEAR_TIE (the
floating-point rule of docs/design.md, "The lossless contract"), which is reported as such.

This module knows nothing about argument parsing; the command (cli/check.py) prints what `check` returns.
"""
from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from .decoding.engine import check_fits, plain_generate, speculative_generate
from .decoding.sampling import SamplingConfig, probabilities
from .decoding.stopping import StopRule
from .decoding.verify import Verdict, rejection_sample
from .errors import SpecdecError, counted
from .lm.interface import Admitted, admit
from .proposers import Proposer

FIRST_LEVEL = 0.02         # a first run with a p-value below this is followed by a second one
SECOND_LEVEL = 0.05        # which fails the check when its p-value is below this
FALSE_ALARM = FIRST_LEVEL * SECOND_LEVEL  # 0.001: a lossless pair fails 1 check in 1,000
POWER = 0.9
DETECTABLE = 2.265         # Φ((2.265 - 1.517) / 0.5) x Φ((2.265 - 1.358) / 0.5) >= POWER (module docstring)
NEAR_TIE = 1e-4            # greedy: a divergence is forgiven only where the top-2 logit gap is below this
SECOND_RUN_SEED = 1_000_003  # the second run's seeds are the first's plus this (the generators keep 32 bits)
PASS, FAIL, UNDECIDED = "PASS", "FAIL", "UNDECIDED"


def ks_p_value(statistic: float, n: int) -> float:
    """P(D_n >= statistic) for n i.i.d. uniforms: Kolmogorov's limit with Stephens' correction
    (accurate to about 1e-3 from n = 5 on)."""
    lam = (math.sqrt(n) + 0.12 + 0.11 / math.sqrt(n)) * statistic
    if lam < 0.2:
        return 1.0
    total = sum(2 * (-1) ** (j - 1) * math.exp(-2 * j * j * lam * lam) for j in range(1, 101))
    return min(1.0, max(0.0, total))


def ks_critical(level: float) -> float:
    """sqrt(n) x the KS statistic a level-`level` test rejects from (asymptotically): sqrt(-log(level / 2) / 2)."""
    return math.sqrt(-math.log(level / 2) / 2)


def ks_uniform(u: torch.Tensor) -> tuple[float, float]:
    """(D, p-value) of the one-sample KS test of u (n,) against U(0, 1)."""
    n = u.numel()
    s = u.double().sort().values
    i = torch.arange(1, n + 1, dtype=torch.float64)
    d = max(float((i / n - s).max()), float((s - (i - 1) / n).max()))
    return d, ks_p_value(d, n)


def detectable_distance(n: int) -> float:
    """The smallest CDF distance the two-stage test detects with power >= POWER (module docstring)."""
    return DETECTABLE / math.sqrt(n)


def decide(p_values: list[float], impossible: int) -> str | None:
    """The sampled check's verdict from the p-values of the runs so far: PASS, FAIL, or None when
    a second run must decide (the first run's p-value is below FIRST_LEVEL)."""
    if impossible:
        return FAIL
    if p_values[0] >= FIRST_LEVEL:
        return PASS
    if len(p_values) == 1:
        return None
    return FAIL if p_values[1] < SECOND_LEVEL else PASS


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
    status: str            # PASS, FAIL or UNDECIDED
    sampled: dict          # runs (KS statistic, p-value, seed each), tokens per run, impossible tokens, test figures
    greedy: dict           # prompts, identical, divergences at near-ties, divergences beyond them
    conditions: dict = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return self.status == PASS

    def verdict(self) -> str:
        s, g = self.sampled, self.greedy
        head = {PASS: "PASS: lossless as far as this check sees", FAIL: "FAIL: not lossless",
                UNDECIDED: "UNDECIDED: no draft token was proposed, so the check saw plain sampling only; give "
                           "prompts this drafter drafts for, or more --sequences"}[self.status]
        runs = "; ".join(f"run {i + 1}: KS D = {r['ks_statistic']:.4f}, p = {r['p_value']:.3g}"
                         for i, r in enumerate(s["runs"]))
        sampled = (f"sampled: {runs} (each over {counted(s['tokens'], 'token')} of "
                   f"{counted(s['sequences'], 'sequence')}); impossible tokens (target probability 0): "
                   f"{s['impossible_tokens']}")
        test = (f"test: false-alarm rate {s['false_alarm_rate']:.1%} (a second, independent run follows a p below "
                f"{FIRST_LEVEL}; FAIL needs its p below {SECOND_LEVEL} too), power >= {s['power']} against a "
                f"departure of the PIT's distribution function of {s['detectable_distance']:.4f} or more")
        greedy = (f"greedy: {g['identical']}/{counted(g['prompts'], 'prompt')} identical to plain decoding"
                  + (f", {g['near_ties']} diverged at a near-tie (top-2 gap < {NEAR_TIE:g})" if g["near_ties"] else "")
                  + (f", {g['wrong']} diverged beyond a near-tie (first at prompt {g['first_wrong']})"
                     if g["wrong"] else ""))
        c = self.conditions
        cond = ", ".join(f"{k}={v}" for k, v in c.items())
        return "\n".join([head, sampled, test, greedy, f"conditions: {cond}"])


@torch.inference_mode()
def check(target, proposer: Proposer, prompts: list[list[int]], sampling: SamplingConfig, k: int | str = 3,
          sequences: int = 64, max_new_tokens: int = 32, batch_size: int = 16, seed: int = 0,
          widths: tuple[int, ...] | None = None, sampled_verify=rejection_sample) -> CheckResult:
    """The lossless check of `proposer` drafting for `target` (a model, as `speculative_generate`
    takes it): `sequences` continuations of `max_new_tokens` tokens (EOS does not stop them)
    sampled under `sampling` from the prompts in turn, `batch_size` at a time (a second such run
    when the first one's p-value asks for it), then every prompt decoded greedily both ways.
    `sampled_verify`: the acceptance rule of sampled chains (only a test replaces it, with a wrong
    one the check must catch). Progress bars on stderr."""
    if sampling.greedy:
        raise SpecdecError("the sampled check needs a temperature > 0 (greedy is checked as well, always)")
    if not prompts:
        raise SpecdecError("the check needs at least one prompt")
    if sequences < 1 or max_new_tokens < 1 or batch_size < 1:
        raise SpecdecError(f"sequences, max_new_tokens and batch_size must be >= 1, got {sequences}, "
                           f"{max_new_tokens}, {batch_size}")
    admitted = admit(target, role="target")
    check_fits(max(map(len, prompts)), max_new_tokens, admitted.context, "the longest prompt")
    t0 = time.perf_counter()
    chosen = [prompts[i % len(prompts)] for i in range(sequences)]
    runs, status = [], None
    while status is None:
        run_seed = seed + SECOND_RUN_SEED * len(runs)  # the second run's seeds: independent of the first's
        runs.append(sampled_run(admitted, proposer, chosen, sampling, k, max_new_tokens, batch_size, run_seed, widths,
                                sampled_verify, f"check: sampled run {len(runs) + 1}"))
        status = decide([r["p_value"] for r in runs], sum(r["impossible_tokens"] for r in runs))
    greedy = greedy_check(admitted, proposer, prompts, StopRule(max_new_tokens), k, widths)
    accepted, proposed = sum(r.pop("accepted") for r in runs), sum(r.pop("proposed") for r in runs)
    if greedy["wrong"]:
        status = FAIL
    elif status == PASS and not proposed:
        status = UNDECIDED
    tokens = sequences * max_new_tokens
    sampled = {"runs": runs, "tokens": tokens, "sequences": sequences,
               "impossible_tokens": sum(r["impossible_tokens"] for r in runs), "first_level": FIRST_LEVEL,
               "second_level": SECOND_LEVEL, "false_alarm_rate": FALSE_ALARM, "power": POWER,
               "detectable_distance": detectable_distance(tokens),
               "acceptance_rate": accepted / proposed if proposed else None}
    conditions = {"method": getattr(proposer, "name", type(proposer).__name__), "k": k,
                  "tree": ",".join(map(str, widths)) if widths else "none",
                  "temperature": sampling.temperature, "top_k": sampling.top_k, "top_p": sampling.top_p,
                  "seed": seed, "prompts": len(prompts), "max_new_tokens": max_new_tokens, "batch_size": batch_size,
                  "eos": "does not stop", "acceptance_rate": None if not proposed else round(accepted / proposed, 3),
                  "seconds": round(time.perf_counter() - t0, 1)}
    return CheckResult(status, sampled, greedy, conditions)


def sampled_run(admitted: Admitted, proposer: Proposer, prompts: list[list[int]], sampling: SamplingConfig,
                k: int | str, max_new_tokens: int, batch_size: int, seed: int, widths: tuple[int, ...] | None,
                sampled_verify, label: str) -> dict:
    """One run of the sampled check: a continuation of each prompt by speculative decoding (seed
    `seed`), each token's randomized PIT under the target (seed `seed` + 1), their KS test."""
    device = admitted.device
    rule = StopRule(max_new_tokens)
    generator = torch.Generator(device).manual_seed(seed)
    pit_generator = torch.Generator().manual_seed(seed + 1)
    us, impossible, accepted, proposed = [], 0, 0, 0
    with tqdm(total=len(prompts), desc=label, unit="seq", leave=False, file=sys.stderr) as bar:
        for start in range(0, len(prompts), batch_size):
            batch = prompts[start:start + batch_size]
            rows, metrics = speculative_generate(admitted, proposer, batch, rule, sampling, k, generator, widths=widths,
                                                 sampled_verify=sampled_verify)
            accepted, proposed = accepted + metrics.accepted, proposed + metrics.proposed
            for prompt, row in zip(batch, rows):
                ids = torch.tensor([prompt + row.tokens], device=device)                # (1, P + n)
                logits = admitted.model(ids).logits[0, len(prompt) - 1:-1]                        # (n, V)
                u, bad = randomized_pit(probabilities(logits, sampling).cpu(), torch.tensor(row.tokens),
                                        pit_generator)
                us.append(u)
                impossible += bad
            bar.update(len(batch))
    d, p_value = ks_uniform(torch.cat(us))
    return {"ks_statistic": d, "p_value": p_value, "seed": seed, "impossible_tokens": impossible,
            "accepted": accepted, "proposed": proposed}


def greedy_check(admitted: Admitted, proposer: Proposer, prompts: list[list[int]], rule: StopRule, k: int | str,
                 widths: tuple[int, ...] | None) -> dict:
    """Greedy speculative decoding of each prompt against plain decoding, one prompt at a time."""
    greedy, identical, near, wrong, first_wrong = SamplingConfig(), 0, 0, 0, None
    for i, prompt in enumerate(tqdm(prompts, desc="check: greedy", unit="prompt", leave=False, file=sys.stderr)):
        spec, _ = speculative_generate(admitted, proposer, [prompt], rule, greedy, k, widths=widths)
        plain, _ = plain_generate(admitted, [prompt], rule, greedy)
        got, expected = spec[0].tokens, plain[0].tokens
        if got == expected:
            identical += 1
            continue
        j = next((t for t, (a, b) in enumerate(zip(got, expected)) if a != b), min(len(got), len(expected)))
        logits = admitted.model(torch.tensor([prompt + expected[:j]], device=admitted.device)).logits[0, -1].float()
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
