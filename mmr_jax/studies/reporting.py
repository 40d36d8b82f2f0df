"""A study's aggregate: per-run accuracy and steps-to-threshold, per-variant spread, paired tests.

Pure functions on plain lists and dicts (the study's curves, `study.read_curve`, and each run's
metric rows); `markdown` renders the report. Conventions:

- final: the mean held-out pass@1 of a run's last FINAL_EVALS evaluations (None with fewer):
  the primary metric, as it does not reward a run for one lucky evaluation.
- peak: the highest held-out pass@1 of a run; its step the first step reaching it.
- AUC: the area under the pass@1 curve (trapezoids over the evaluated steps) divided by the
  steps it spans, i.e. the curve's mean height.
- steps to a fixed threshold: the first evaluated step with pass@1 >= t, for each t of the
  study's `fixed_thresholds` (default FIXED_THRESHOLDS); the same bar for every run.
- steps to a relative threshold: the first evaluated step with pass@1 >= threshold x reference
  (its own peak, or the best baseline's mean peak). A lower peak makes its own bar lower, so
  "sooner to its own peak" can be an artifact of peaking lower; the fixed thresholds are not.
- paired comparisons pair runs of two variants by seed; a seed where either run diverged or has
  no value is left out and named. Intervals: the paired t interval and the exact sign-flip p;
  a percentile bootstrap only from MIN_BOOTSTRAP_N pairs on (with 3 pairs its bounds are always
  the smallest and largest difference: a range, not evidence).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from mmr_jax.studies import run_curves
from mmr_jax.studies.paired_stats import EXACT_BOOTSTRAP_MAX_N, MIN_BOOTSTRAP_N, paired, spread

FINAL_EVALS = 5  # final accuracy: the mean of a run's last 5 evaluations
FIXED_THRESHOLDS = (0.6, 0.8)  # default fixed pass@1 bars for "steps to threshold"


def first_reaching(steps: Sequence[int], values: Sequence[float], target: float) -> int | None:
    """The first step whose value is >= target, or None."""
    return next((s for s, v in zip(steps, values, strict=True) if v >= target), None)


def final_accuracy(values: Sequence[float], last: int = FINAL_EVALS) -> float | None:
    """Mean of the last `last` values; None when there are fewer."""
    return float(np.mean(values[-last:])) if len(values) >= last else None


def curve_auc(steps: Sequence[int], values: Sequence[float]) -> float | None:
    """Trapezoidal area under the curve / the steps it spans (its mean height); None if < 2."""
    if len(steps) < 2:
        return None
    x, y = np.asarray(steps, float), np.asarray(values, float)
    return float(np.sum((y[1:] + y[:-1]) / 2 * np.diff(x)) / (x[-1] - x[0]))


def fixed_key(t: float) -> str:
    """The summary key of a fixed threshold: 0.6 -> 'step_to_60'."""
    return f"step_to_{round(100 * t)}"


def run_summary(
    curve: Mapping,
    threshold: float,
    reference_peak: float | None,
    fixed: Sequence[float] = FIXED_THRESHOLDS,
) -> dict:
    """final, auc, peak, peak_step, step_to_own (threshold x own peak), step_to_ref (x
    reference_peak), train_s at those two, and `fixed_key(t)` (first step with pass@1 >= t) for
    each fixed threshold, for one curve {'steps', 'values', 'train_s'}."""
    steps, values, train_s = curve["steps"], curve["values"], curve["train_s"]
    if not steps:
        return {
            "final": None, "auc": None, "peak": None, "peak_step": None, "step_to_own": None,
            "step_to_ref": None, **{fixed_key(t): None for t in fixed},
        }  # fmt: skip
    peak = max(values)
    seconds = dict(zip(steps, train_s, strict=True))
    own = first_reaching(steps, values, threshold * peak)
    ref = (
        None
        if reference_peak is None
        else first_reaching(steps, values, threshold * reference_peak)
    )
    return {
        "final": final_accuracy(values),
        "auc": curve_auc(steps, values),
        "peak": peak,
        "peak_step": first_reaching(steps, values, peak),
        "step_to_own": own,
        "train_s_to_own": seconds[own],
        "step_to_ref": ref,
        "train_s_to_ref": None if ref is None else seconds[ref],
        **{fixed_key(t): first_reaching(steps, values, t) for t in fixed},
    }


def summarise(runs: Sequence[Mapping], study: Mapping) -> dict:
    """Per-run and per-variant summaries and paired comparisons.

    runs: {'name', 'variant', 'seed', 'status', 'curve'} each; status 'finished' | 'diverged' |
      'incomplete' | 'pending'. study: 'run' (variants in order), 'baselines', 'compare' (pairs
      (a, b) reported as a - b), 'threshold', optional 'fixed_thresholds'.
    A diverged run keeps its curve and row but is left out of the means and pairs (named).
    """
    thr = study["threshold"]
    fixed = tuple(study.get("fixed_thresholds") or FIXED_THRESHOLDS)
    usable = {r["name"]: r["status"] == "finished" and r["curve"]["steps"] for r in runs}
    per_run = {r["name"]: run_summary(r["curve"], thr, None, fixed) for r in runs}

    def variant_peaks(v):
        return [per_run[r["name"]]["peak"] for r in runs if r["variant"] == v and usable[r["name"]]]

    baseline_means = {v: spread(variant_peaks(v))["mean"] for v in study["baselines"]}
    baseline_means = {v: m for v, m in baseline_means.items() if m is not None}
    best = max(baseline_means, key=baseline_means.get) if baseline_means else None
    ref_peak = baseline_means.get(best)
    per_run = {r["name"]: run_summary(r["curve"], thr, ref_peak, fixed) for r in runs}
    fixed_keys = tuple(fixed_key(t) for t in fixed)
    keys = ("final", "auc", "peak", "peak_step", *fixed_keys, "step_to_own", "train_s_to_own")
    keys += ("step_to_ref", "train_s_to_ref")
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
            "reached": {
                k: sum(per_run[r["name"]][k] is not None for r in ok)
                for k in (*fixed_keys, "step_to_ref")
            },
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

        compared = ("final", "peak", "auc", *fixed_keys, "step_to_own", "step_to_ref")
        comparisons.append(
            {"a": a, "b": b, **{k: paired(by_seed(a, k), by_seed(b, k)) for k in compared}}
        )
    return {
        "best_baseline": best,
        "reference_peak": ref_peak,
        "fixed_thresholds": list(fixed),
        "per_run": per_run,
        "variants": variants,
        "comparisons": comparisons,
    }


# --- Markdown ------------------------------------------------------------------------------------


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


def _step(x) -> str:
    return "not reached" if x is None else str(x)


def _labels(summary: Mapping, thr: int) -> dict[str, tuple[str, bool]]:
    """Summary key -> (label, is a pass@1 fraction) for the tables, in their order."""
    out = {
        "final": (f"final pass@1 (mean of last {FINAL_EVALS} evals, %)", True),
        "peak": ("peak pass@1 (%)", True),
        "auc": ("AUC of pass@1 (mean height, %)", True),
    }
    for t in summary["fixed_thresholds"]:
        out[fixed_key(t)] = (f"step to pass@1 >= {round(100 * t)}%", False)
    out["step_to_own"] = (f"step to {thr}% of own peak", False)
    out["step_to_ref"] = (f"step to {thr}% of best baseline peak", False)
    return out


def _paired_row(c: Mapping, key: str, label: str, pct: bool) -> str:
    p = c[key]
    if not p["n"]:
        return f"| {c['a']} - {c['b']} | {label} | 0 | - | - | - | - | - |"
    diffs = ", ".join(_fmt(d, pct) for d in p["diffs"])
    t = p["t"]
    t_text = "-" if t is None else f"[{_fmt(t['low'], pct)}, {_fmt(t['high'], pct)}]"
    b = p["bootstrap"]
    b_text = f"n < {MIN_BOOTSTRAP_N}: none" if b is None else f"[{_fmt(b['low'], pct)}, "
    b_text += "" if b is None else f"{_fmt(b['high'], pct)}]"
    left = f" (left out: seeds {p['left_out_seeds']})" if p["left_out_seeds"] else ""
    return (
        f"| {c['a']} - {c['b']} | {label} | {p['n']}{left} | {diffs} | {_fmt(p['mean'], pct)} "
        f"| {t_text} | {p['sign_flip_p']:.3g} | {b_text} |"
    )


def markdown(
    summary: Mapping,
    runs: Sequence[Mapping],
    study: Mapping,
    *,
    plot: str = "",
    mechanism: Mapping[str, Mapping] | None = None,
) -> str:
    """The report: per-variant table, paired comparisons, per-run table, mechanism and cost."""
    thr = round(100 * study["threshold"])
    ref = summary["reference_peak"]
    labels = _labels(summary, thr)
    lines = [
        f"# Study {study['name']}: held-out pass@1 along training",
        "",
        f"Base config `{study['base_config']}`; seeds {list(study['seeds'])}; "
        f"{study['total_steps']} steps per run; held-out pass@1 every {study['eval_every']} steps.",
        f"Best baseline: {summary['best_baseline'] or '-'} (mean peak {_fmt(ref, True)}%).",
        "",
        "## Per variant (mean ± sample std [min, max] over seeds; finished runs only)",
        "",
        "Steps to a threshold average the runs that reached it; how many did is in brackets.",
        "",
        "| variant | finished | " + " | ".join(lab for lab, _ in labels.values())
        + " | step of peak | train s (all steps) | diverged |",
        "|---|---|" + "---|" * (len(labels) + 3),
    ]  # fmt: skip
    for v, s in summary["variants"].items():
        div = ", ".join(
            f"seed {d['seed']} (last logged step {d['last_step']})" for d in s["diverged"]
        )
        if s["not_finished"]:
            div += (" " if div else "") + f"not finished: seeds {s['not_finished']}"
        cells = []
        for key, (_, pct) in labels.items():
            cell = _ms(s[key], pct)
            if key in s["reached"]:
                cell += f" ({s['reached'][key]}/{s['finished']} reached)"
            cells.append(cell)
        lines.append(
            f"| {v} | {s['finished']}/{s['runs']} | " + " | ".join(cells)
            + f" | {_ms(s['peak_step'])} | {_ms(s['train_s'], digits=0)} | {div or '-'} |"
        )  # fmt: skip
    lines += [
        "",
        "## Paired comparisons (a - b, paired by seed)",
        "",
        "| a - b | quantity | pairs | differences | mean | 95% paired t | exact sign-flip p "
        "| 95% bootstrap |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for c in summary["comparisons"]:
        lines += [_paired_row(c, key, label, pct) for key, (label, pct) in labels.items()]
    lines += [
        "",
        "pass@1 differences in points. The exact sign-flip p cannot go below 2/2^n (0.25 for 3 "
        "seeds, 0.031 for 6): a few seeds can show a large effect, never a small one. No "
        f"bootstrap interval below {MIN_BOOTSTRAP_N} pairs: with n pairs its percentile bounds "
        "come from only n^n resamples (27 for 3), and for 3 they are always the smallest and the "
        f"largest difference. From {MIN_BOOTSTRAP_N} pairs on it is exact over all n^n resamples "
        f"up to n = {EXACT_BOOTSTRAP_MAX_N}.",
        "",
        "## Runs",
        "",
        "| run | status | evaluated steps | " + " | ".join(lab for lab, _ in labels.values())
        + " | step of peak | train s |",
        "|---|---|---|" + "---|" * (len(labels) + 2),
    ]  # fmt: skip
    for r in runs:
        s = summary["per_run"][r["name"]]
        c = r["curve"]
        cells = [_fmt(s[k], True) if pct else _step(s[k]) for k, (_, pct) in labels.items()]
        lines.append(
            f"| {r['name']} | {r['status']} | {len(c['steps'])} (last step {c['last_step']}) | "
            + " | ".join(cells)
            + f" | {s['peak_step'] if s['peak_step'] is not None else '-'} "
            f"| {_fmt(c['train_s'][-1] if c['train_s'] else None, digits=0)} |"
        )
    if mechanism:
        lines += _arm_mechanism_lines(
            run_curves.arm_mechanism(runs, mechanism, list(summary["variants"]))
        )
        lines += _mechanism_lines(runs, mechanism)
    if plot:
        caption = (
            "held-out pass@1, training reward and completion length, mean over finished seeds, "
            "band min-max"
        )
        lines += ["", f"![{caption}]({plot})"]
    return "\n".join(lines) + "\n"


def _arm_mechanism_lines(arms: Mapping[str, Mapping]) -> list[str]:
    columns = run_curves.ARM_MECHANISM
    lines = [
        "",
        "## Mechanism and cost per variant (mean ± sample std [min, max] over finished runs)",
        "",
        "From each run's metrics, as in the per-run table below. Uniform groups: groups whose raw "
        "rewards are all equal, which GRPO gives advantage 0.",
        "",
        "| variant | runs | stalled | "
        + " | ".join(lab for lab, _, _ in run_curves.ARM_MECHANISM)
        + " |",
        "|---|---|---|" + "---|" * len(run_curves.ARM_MECHANISM),
    ]
    for v, a in arms.items():
        cells = [_ms(a[key], digits=d) for _, key, d in columns]
        lines.append(f"| {v} | {a['runs']} | {a['stalled']} | " + " | ".join(cells) + " |")
    return lines


def _mechanism_lines(runs: Sequence[Mapping], mechanism: Mapping[str, Mapping]) -> list[str]:
    lines = [
        "",
        "## Mechanism and cost per run (from each run's metrics)",
        "",
        "stalled from: the first step of the final stretch with grad_norm exactly 0 at every "
        "step (every group's rewards uniform: the run no longer learns), when that stretch "
        "covers at least the last quarter of the steps. Tail: mean over the "
        "last quarter of the steps. Times: medians over steps 2 on (step 1 compiles); the train "
        "step includes the asynchronous checkpoint save's competition where one ran.",
        "",
        "| run | stalled from | tail advantage abs mean | tail on uniform groups "
        "| tail zero-variance share "
        "| tail grad norm | tail completion tokens | train step s (median) | rollout s (median) "
        "| evaluation s [min, max] | evaluation total min | wall min |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        m = mechanism.get(r["name"])
        if not m:
            continue
        ev = "-" if m["eval_s"] is None else f"[{m['eval_s'][0]:.0f}, {m['eval_s'][1]:.0f}]"
        wall = r.get("wall_s")
        lines.append(
            f"| {r['name']} | {'-' if m['stalled_from'] is None else m['stalled_from']} "
            f"| {_fmt(m['tail_adv_abs_mean'], digits=2)} "
            f"| {_fmt(m['tail_uniform_adv_abs_mean'], digits=2)} "
            f"| {_fmt(m['tail_zero_variance_frac'], digits=2)} "
            f"| {_fmt(m['tail_grad_norm'], digits=2)} | {_fmt(m.get('tail_length_mean'))} "
            f"| {_fmt(m['train_s_median'])} "
            f"| {_fmt(m['rollout_s_median'])} | {ev} | {_fmt(m['eval_total_s'] / 60)} "
            f"| {_fmt(None if wall is None else wall / 60)} |"
        )
    return lines
