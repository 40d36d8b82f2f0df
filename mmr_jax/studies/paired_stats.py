"""Paired comparisons of two arms by seed: differences, t interval, exact sign-flip p, bootstrap.

Pure functions on plain numbers (`reporting` builds its tables on them). With few seeds: the
paired t interval and the exact sign-flip p-value over all 2^n sign patterns; a percentile
bootstrap only from MIN_BOOTSTRAP_N pairs on (with 3 pairs its bounds are always the smallest and
largest difference: a range, not evidence), enumerated exactly up to EXACT_BOOTSTRAP_MAX_N pairs.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence

import numpy as np

EXACT_BOOTSTRAP_MAX_N = 8  # up to 8^8 = 16.8M resamples are enumerated exactly (the mean's law)
MIN_BOOTSTRAP_N = 5  # below this the percentile bounds are the extreme differences themselves


def spread(values: Sequence[float]) -> dict:
    """n, mean, sample std (ddof 1; None for n < 2), min, max of the non-None values."""
    xs = np.array([v for v in values if v is not None], float)
    if not len(xs):
        return {"n": 0, "mean": None, "std": None, "min": None, "max": None}
    return {
        "n": int(len(xs)),
        "mean": float(xs.mean()),
        "std": float(xs.std(ddof=1)) if len(xs) > 1 else None,
        "min": float(xs.min()),
        "max": float(xs.max()),
    }


def _quantile_of_law(support: np.ndarray, probs: np.ndarray, q: float) -> float:
    """The smallest v with P(X <= v) >= q, for a discrete law (support sorted ascending)."""
    cdf = np.cumsum(probs)
    return float(support[np.searchsorted(cdf, q - 1e-12)])


def bootstrap_interval(diffs: Sequence[float], level: float = 0.95, *, seed: int = 0) -> dict:
    """Percentile bootstrap interval of the mean of paired differences.

    n <= EXACT_BOOTSTRAP_MAX_N: the bootstrap law of the mean is enumerated exactly (all n^n
    resamples, so no seed and no Monte-Carlo error); else 20000 resamples with `seed`.
    Bounds: the smallest v with P(mean* <= v) >= (1-level)/2, resp. >= (1+level)/2.
    """
    d = np.asarray(diffs, float)
    n = len(d)
    if n == 0:
        raise ValueError("bootstrap of no pairs")
    if n <= EXACT_BOOTSTRAP_MAX_N:
        # The law of the resample sum: n convolutions with the uniform law on d, merging equal
        # sums after each (rounded, so float noise does not split atoms).
        support, counts = np.array([0.0]), np.array([1], np.int64)
        for _ in range(n):
            sums = np.round((support[:, None] + d[None, :]).ravel(), 9)
            support, inverse = np.unique(sums, return_inverse=True)
            counts = np.bincount(inverse, weights=np.repeat(counts, n)).astype(np.int64)
        support = support / n
        probs = counts / counts.sum()
        method = f"exact ({n}^{n} resamples)"
    else:
        rng = np.random.default_rng(seed)
        means = d[rng.integers(0, n, size=(20_000, n))].mean(axis=1)
        support, counts = np.unique(means, return_counts=True)
        probs = counts / counts.sum()
        method = f"monte-carlo (20000 resamples, seed {seed})"
    lo = _quantile_of_law(support, probs, (1 - level) / 2)
    hi = _quantile_of_law(support, probs, (1 + level) / 2)
    return {"low": lo, "high": hi, "level": level, "method": method}


def t_interval(diffs: Sequence[float], level: float = 0.95) -> dict | None:
    """Paired t interval mean +- t_{(1+level)/2, n-1} * sd / sqrt(n); None for n < 2."""
    from scipy import stats

    d = np.asarray(diffs, float)
    n = len(d)
    if n < 2:
        return None
    half = float(stats.t.ppf((1 + level) / 2, n - 1)) * float(d.std(ddof=1)) / math.sqrt(n)
    return {"low": float(d.mean()) - half, "high": float(d.mean()) + half, "level": level}


def sign_flip_p(diffs: Sequence[float]) -> float:
    """Exact two-sided sign-flip (paired permutation) p-value of mean(diffs) = 0.

    The fraction of the 2^n sign patterns whose |mean| >= the observed |mean|; its smallest
    possible value is 2 / 2^n (0.25 with 3 seeds), whatever the effect.
    """
    d = np.asarray(diffs, float)
    if not len(d):
        raise ValueError("sign-flip test of no pairs")
    observed = abs(d.mean())
    signs = np.array(list(itertools.product((1.0, -1.0), repeat=len(d))))
    means = np.abs((signs * d).mean(axis=1))
    return float(np.mean(means >= observed - 1e-12))


def paired(a: Mapping[int, float | None], b: Mapping[int, float | None], level=0.95) -> dict:
    """a - b paired by seed: the differences, their mean, the t interval, the exact sign-flip p,
    and a bootstrap interval only from MIN_BOOTSTRAP_N pairs on (else None)."""
    seeds = sorted(s for s in set(a) & set(b) if a[s] is not None and b[s] is not None)
    left_out = sorted((set(a) | set(b)) - set(seeds))
    out = {"seeds": seeds, "left_out_seeds": left_out, "n": len(seeds)}
    if not seeds:
        return out
    diffs = [a[s] - b[s] for s in seeds]
    out.update(
        diffs=diffs,
        mean=float(np.mean(diffs)),
        bootstrap=bootstrap_interval(diffs, level) if len(diffs) >= MIN_BOOTSTRAP_N else None,
        t=t_interval(diffs, level),
        sign_flip_p=sign_flip_p(diffs),
    )
    return out
