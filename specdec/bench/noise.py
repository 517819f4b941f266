"""Noise checks: a measured figure whose repeats disagree too much, or a verify-cost curve that
cannot be true, is marked noisy (in bench.json and report.md, and by `simulate`) instead of being
reported as a result without a word.

- Spread: repeats of one configuration whose (max - min) / median exceeds SPREAD_LIMIT.
- Impossible verify curve: a forward over n tokens measured faster than CURVE_FLOOR times an
  earlier point m < n (more tokens cannot cost much less; t(n)/t(1) < 0.9 for n > 1 is the usual
  case), or a point dearer than SPIKE_LIMIT times every larger one (a stall in the middle).

This module knows nothing about models or decoding; it reads numbers.
"""
from __future__ import annotations

SPREAD_LIMIT = 0.25
CURVE_FLOOR = 0.9
SPIKE_LIMIT = 1.5


def relative_spread(s: dict) -> float:
    """(max - min) / median of a spread dict (conditions.spread)."""
    return (s["max"] - s["min"]) / s["median"] if s["median"] > 0 else float("inf")


def implausible_verify_points(seconds: dict[int, float]) -> list[tuple[int, float]]:
    """(n, t(n) / t(m)) for every point n cheaper than CURVE_FLOOR x the dearest plausible earlier
    point m, and every point dearer than SPIKE_LIMIT x all larger ones (a spike)."""
    points = sorted(seconds.items())
    found, dearest = [], None  # dearest: the largest earlier time not itself found implausible
    for i, (n, t) in enumerate(points):
        if dearest is not None and t < CURVE_FLOOR * dearest:
            found.append((n, t / dearest))
        elif i + 1 < len(points) and t > SPIKE_LIMIT * max(s for _, s in points[i + 1:]):
            found.append((n, t / max(s for _, s in points[i + 1:])))
        else:
            dearest = max(t, dearest or t)
    return found


def result_noise(tokens_per_s: dict, speedup: dict, curve_noisy: bool, predicted: bool) -> list[str]:
    """Why one configuration's figures are noisy (empty: they are not)."""
    reasons = []
    for name, s in (("tokens/s", tokens_per_s), ("speedup", speedup)):
        if s["n"] > 1 and relative_spread(s) > SPREAD_LIMIT:
            reasons.append(f"{name} repeats spread {100 * relative_spread(s):.0f}% of the median "
                           f"(limit {100 * SPREAD_LIMIT:.0f}%)")
    if curve_noisy and predicted:
        reasons.append("the verify-cost curve the prediction uses is implausible")
    return reasons
