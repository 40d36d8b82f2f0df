"""Sizing a paired study before it runs: power of the paired t test, seeds needed, prompt filter.

Pure functions on plain numbers. The paired t test of n seed pairs (two-sided, level alpha) rejects
when |mean(d)| / (sd(d) / sqrt(n)) > t_{1-alpha/2, n-1}; for a true mean difference `effect` and a
population std of the differences `sd_diff`, the statistic follows a noncentral t with n - 1
degrees of freedom and noncentrality effect / sd_diff * sqrt(n) (Cohen, 1988, ch. 2).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

from scipy import stats


def paired_t_power(n: int, *, effect: float, sd_diff: float, alpha: float = 0.05) -> float:
    """Probability that the two-sided paired t test of n pairs rejects, for a true `effect`."""
    if n < 2:
        raise ValueError(f"a paired t test needs n >= 2 pairs, got {n}")
    if not sd_diff > 0 or not math.isfinite(sd_diff):
        raise ValueError(f"sd_diff must be a positive finite number, got {sd_diff}")
    df = n - 1
    crit = stats.t.ppf(1 - alpha / 2, df)
    nc = effect / sd_diff * math.sqrt(n)
    return float(stats.nct.sf(crit, df, nc) + stats.nct.cdf(-crit, df, nc))


def seeds_for_power(
    *, effect: float, sd_diff: float, alpha: float = 0.05, power: float = 0.8, max_n: int = 200
) -> int | None:
    """The smallest n with paired_t_power >= power, or None if even max_n pairs fall short."""
    for n in range(2, max_n + 1):
        if paired_t_power(n, effect=effect, sd_diff=sd_diff, alpha=alpha) >= power:
            return n
    return None


def detectable_effect(n: int, *, sd_diff: float, alpha: float = 0.05, power: float = 0.8) -> float:
    """The smallest true effect that n pairs detect with the given power (bisection)."""
    lo, hi = 0.0, sd_diff
    while paired_t_power(n, effect=hi, sd_diff=sd_diff, alpha=alpha) < power:
        hi *= 2
    for _ in range(60):
        mid = (lo + hi) / 2
        if paired_t_power(n, effect=mid, sd_diff=sd_diff, alpha=alpha) < power:
            lo = mid
        else:
            hi = mid
    return hi


def pass_counts(records: Iterable[Mapping]) -> dict[str, int]:
    """Problem id -> number of correct samples, from evaluation records (`correct`: [n] bools)."""
    return {str(r["id"]): int(sum(bool(c) for c in r["correct"])) for r in records}


def select_by_pass_rate(counts: Mapping[str, int], *, n: int, low: int, high: int) -> list[str]:
    """Ids whose pass count over n samples lies in [low, high]: sometimes right, sometimes not.

    A prompt that the starting policy solves in 0 or n of its n samples gives a uniform group, whose
    GRPO advantage is 0: it spends a step's compute and teaches nothing.
    """
    if not 0 <= low <= high <= n:
        raise ValueError(f"need 0 <= low <= high <= n, got low={low}, high={high}, n={n}")
    bad = {k: c for k, c in counts.items() if not 0 <= c <= n}
    if bad:
        raise ValueError(f"pass counts outside [0, {n}]: {dict(list(bad.items())[:3])}")
    return [k for k, c in counts.items() if low <= c <= high]


def seeds_from_pilot(
    finals: Iterable[float],
    *,
    effect: float,
    confidence: float = 0.8,
    alpha: float = 0.05,
    power: float = 0.8,
    max_n: int = 200,
) -> dict:
    """Seeds a paired study needs, sized from a pilot's spread of one arm's final metric.

    The pilot runs one arm only, so the spread of the paired differences is bounded from it: the
    pilot's sample std s (ddof 1) is raised to its one-sided `confidence` upper bound
    s * sqrt(df / chi2_{1-confidence, df}) (a 3-seed std is itself very uncertain), then
    sd_diff = sqrt(2) * that bound: the std of a difference of two independent runs. Pairing by
    seed (same data order) can only lower it when the arms' runs are positively correlated.
    """
    xs = [float(x) for x in finals]
    if len(xs) < 2:
        raise ValueError(f"a pilot needs at least 2 runs to give a spread, got {len(xs)}")
    df = len(xs) - 1
    mean = sum(xs) / len(xs)
    s = math.sqrt(sum((x - mean) ** 2 for x in xs) / df)
    s_upper = s * math.sqrt(df / stats.chi2.ppf(1 - confidence, df))
    sd_diff = math.sqrt(2) * s_upper
    n = seeds_for_power(effect=effect, sd_diff=sd_diff, alpha=alpha, power=power, max_n=max_n)
    return {"pilot_std": s, "std_upper": s_upper, "sd_diff": sd_diff, "seeds": n}
