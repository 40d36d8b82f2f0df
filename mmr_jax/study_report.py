"""A study's aggregate: per-run peak and steps-to-threshold, per-variant spread, paired tests.

Pure functions on plain lists and dicts (the study's curves, `study.read_curve`); `markdown`
renders the report. Conventions:

- peak: the highest held-out pass@1 of a run; its step the first step reaching it.
- steps to threshold: the first evaluated step whose accuracy is >= threshold x reference (its
  own peak, or the best baseline's mean peak); None when never reached.
- paired comparisons pair runs of two variants by seed; a seed where either run diverged or has
  no value is left out and named.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence

import numpy as np

EXACT_BOOTSTRAP_MAX_N = 8  # up to 8^8 = 16.8M resamples are enumerated exactly (the mean's law)


def first_reaching(steps: Sequence[int], values: Sequence[float], target: float) -> int | None:
    """The first step whose value is >= target, or None."""
    return next((s for s, v in zip(steps, values, strict=True) if v >= target), None)


def run_summary(curve: Mapping, threshold: float, reference_peak: float | None) -> dict:
    """peak, peak_step, step_to_own (threshold x own peak), step_to_ref (x reference_peak), and
    train_s at those steps, for one curve {'steps', 'values', 'train_s'}."""
    steps, values, train_s = curve["steps"], curve["values"], curve["train_s"]
    if not steps:
        return {"peak": None, "peak_step": None, "step_to_own": None, "step_to_ref": None}
    peak = max(values)
    seconds = dict(zip(steps, train_s, strict=True))
    own = first_reaching(steps, values, threshold * peak)
    ref = (
        None
        if reference_peak is None
        else first_reaching(steps, values, threshold * reference_peak)
    )
    return {
        "peak": peak,
        "peak_step": first_reaching(steps, values, peak),
        "step_to_own": own,
        "train_s_to_own": seconds[own],
        "step_to_ref": ref,
        "train_s_to_ref": None if ref is None else seconds[ref],
    }


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
    """a - b paired by seed: the differences, their mean, intervals and sign-flip p."""
    seeds = sorted(s for s in set(a) & set(b) if a[s] is not None and b[s] is not None)
    left_out = sorted((set(a) | set(b)) - set(seeds))
    out = {"seeds": seeds, "left_out_seeds": left_out, "n": len(seeds)}
    if not seeds:
        return out
    diffs = [a[s] - b[s] for s in seeds]
    out.update(
        diffs=diffs,
        mean=float(np.mean(diffs)),
        bootstrap=bootstrap_interval(diffs, level),
        t=t_interval(diffs, level),
        sign_flip_p=sign_flip_p(diffs),
    )
    return out


def summarise(runs: Sequence[Mapping], study: Mapping) -> dict:
    """Per-run and per-variant summaries and paired comparisons.

    runs: {'name', 'variant', 'seed', 'status', 'curve'} each; status 'finished' | 'diverged' |
      'incomplete' | 'pending'. study: 'run' (variants in order), 'baselines', 'compare' (pairs
      (a, b) reported as a - b), 'threshold'.
    A diverged run keeps its curve and row but is left out of the means and pairs (named).
    """
    thr = study["threshold"]
    usable = {r["name"]: r["status"] == "finished" and r["curve"]["steps"] for r in runs}
    per_run = {r["name"]: run_summary(r["curve"], thr, None) for r in runs}

    def variant_peaks(v):
        return [per_run[r["name"]]["peak"] for r in runs if r["variant"] == v and usable[r["name"]]]

    baseline_means = {v: spread(variant_peaks(v))["mean"] for v in study["baselines"]}
    baseline_means = {v: m for v, m in baseline_means.items() if m is not None}
    best = max(baseline_means, key=baseline_means.get) if baseline_means else None
    ref_peak = baseline_means.get(best)
    per_run = {r["name"]: run_summary(r["curve"], thr, ref_peak) for r in runs}
    keys = ("peak", "peak_step", "step_to_own", "train_s_to_own", "step_to_ref", "train_s_to_ref")
    variants = {}
    for v in study["run"]:
        rows = [r for r in runs if r["variant"] == v]
        ok = [r for r in rows if usable[r["name"]]]
        variants[v] = {
            "runs": len(rows),
            "finished": len(ok),
            "diverged": [
                {"seed": r["seed"], "last_step": r["curve"]["last_step"], "error": r.get("error")}
                for r in rows
                if r["status"] == "diverged"
            ],
            "not_finished": [r["seed"] for r in rows if r["status"] in ("incomplete", "pending")],
            "reached_ref": sum(per_run[r["name"]]["step_to_ref"] is not None for r in ok),
            "train_s": spread([r["curve"]["train_s"][-1] for r in ok if r["curve"]["train_s"]]),
            **{k: spread([per_run[r["name"]].get(k) for r in ok]) for k in keys},
        }
    comparisons = []
    for a, b in study["compare"]:

        def by_seed(v, key):
            return {
                r["seed"]: per_run[r["name"]].get(key) if usable[r["name"]] else None
                for r in runs
                if r["variant"] == v
            }

        comparisons.append(
            {
                "a": a,
                "b": b,
                **{k: paired(by_seed(a, k), by_seed(b, k)) for k in ("peak", "step_to_own")},
                "step_to_ref": paired(by_seed(a, "step_to_ref"), by_seed(b, "step_to_ref")),
            }
        )
    return {
        "best_baseline": best,
        "reference_peak": ref_peak,
        "per_run": per_run,
        "variants": variants,
        "comparisons": comparisons,
    }


def _fmt(x, pct=False, digits=1) -> str:
    if x is None:
        return "-"
    return f"{100 * x:.{digits}f}" if pct else f"{x:.{digits}f}"


def _ms(s: Mapping, pct=False, digits=1) -> str:
    """'mean ± std [min, max] (n)' of a spread."""
    if not s["n"]:
        return "-"
    text = _fmt(s["mean"], pct, digits)
    if s["std"] is not None:
        text += f" ± {_fmt(s['std'], pct, digits)} [{_fmt(s['min'], pct, digits)}, "
        text += f"{_fmt(s['max'], pct, digits)}]"
    return f"{text} (n={s['n']})"


def markdown(summary: Mapping, runs: Sequence[Mapping], study: Mapping, *, plot: str = "") -> str:
    """The report: per-variant table, per-run table, paired comparisons, caveats."""
    thr = round(100 * study["threshold"])
    ref = summary["reference_peak"]
    lines = [
        f"# Study {study['name']}: held-out pass@1 along training",
        "",
        f"Base config `{study['base_config']}`; seeds {list(study['seeds'])}; "
        f"{study['total_steps']} steps per run; held-out pass@1 every {study['eval_every']} steps.",
        f"Best baseline: {summary['best_baseline'] or '-'} (mean peak {_fmt(ref, True)}%).",
        "",
        "## Per variant (mean ± sample std [min, max] over seeds; finished runs only)",
        "",
        f"| variant | finished | peak pass@1 (%) | step of peak | step to {thr}% of own peak "
        f"| step to {thr}% of best baseline peak (reached) | train s to {thr}% own peak "
        "| train s (all steps) | diverged |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for v, s in summary["variants"].items():
        div = ", ".join(
            f"seed {d['seed']} (last logged step {d['last_step']})" for d in s["diverged"]
        )
        if s["not_finished"]:
            div += (" " if div else "") + f"not finished: seeds {s['not_finished']}"
        lines.append(
            f"| {v} | {s['finished']}/{s['runs']} | {_ms(s['peak'], True)} | {_ms(s['peak_step'])} "
            f"| {_ms(s['step_to_own'])} | {_ms(s['step_to_ref'])} ({s['reached_ref']}) "
            f"| {_ms(s['train_s_to_own'], digits=0)} | {_ms(s['train_s'], digits=0)} "
            f"| {div or '-'} |"
        )
    lines += [
        "",
        "## Paired comparisons (a - b, paired by seed)",
        "",
        "| a - b | quantity | pairs | differences | mean | 95% bootstrap | 95% paired t "
        "| sign-flip p |",
        "|---|---|---|---|---|---|---|---|",
    ]
    names = {"peak": "peak pass@1 (pts)", "step_to_own": f"step to {thr}% own peak"}
    names["step_to_ref"] = f"step to {thr}% best baseline peak"
    for c in summary["comparisons"]:
        for key, label in names.items():
            p = c[key]
            pct = key == "peak"
            if not p["n"]:
                lines.append(f"| {c['a']} - {c['b']} | {label} | 0 | - | - | - | - | - |")
                continue
            diffs = ", ".join(_fmt(d, pct) for d in p["diffs"])
            t = p["t"]
            t_text = "-" if t is None else f"[{_fmt(t['low'], pct)}, {_fmt(t['high'], pct)}]"
            b = p["bootstrap"]
            lines.append(
                f"| {c['a']} - {c['b']} | {label} | {p['n']} | {diffs} | {_fmt(p['mean'], pct)} "
                f"| [{_fmt(b['low'], pct)}, {_fmt(b['high'], pct)}] | {t_text} "
                f"| {p['sign_flip_p']:.3g} |"
            )
    lines += [
        "",
        "Bootstrap: percentile interval of the mean difference, exact over all n^n resamples for "
        f"n <= {EXACT_BOOTSTRAP_MAX_N}. With n seeds the exact sign-flip p-value cannot go below "
        "2/2^n (0.25 for 3 seeds): a few seeds can show a large effect, never a small one.",
        "",
        "## Runs",
        "",
        "| run | status | evaluated steps | peak (%) | step of peak | step to own "
        f"{thr}% | step to baseline {thr}% | train s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        s = summary["per_run"][r["name"]]
        c = r["curve"]
        lines.append(
            f"| {r['name']} | {r['status']} | {len(c['steps'])} (last step {c['last_step']}) "
            f"| {_fmt(s['peak'], True)} | {s['peak_step'] if s['peak_step'] is not None else '-'} "
            f"| {s['step_to_own'] if s['step_to_own'] is not None else '-'} "
            f"| {s['step_to_ref'] if s['step_to_ref'] is not None else 'not reached'} "
            f"| {_fmt(c['train_s'][-1] if c['train_s'] else None, digits=0)} |"
        )
    if plot:
        caption = "held-out pass@1 and training reward, mean over finished seeds, band min-max"
        lines += ["", f"![{caption}]({plot})"]
    return "\n".join(lines) + "\n"
