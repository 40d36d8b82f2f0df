"""How a run learnt and what it cost, from its metric rows: stalls, tail means, step times.

Pure functions on plain lists and dicts (each run's metrics.jsonl rows); `reporting.markdown`
renders their tables.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from mmr_jax.studies.paired_stats import spread


def _mean_over(by_step: Mapping[int, Mapping], key: str, steps: Sequence[int]) -> float | None:
    xs = [by_step[s][key] for s in steps if isinstance(by_step[s].get(key), int | float)]
    return float(np.mean(xs)) if xs else None


def run_mechanism(rows: Sequence[Mapping], *, tail: float = 0.25) -> dict:
    """What a run's metrics say about how it learnt and what it cost.

    rows: the run's metrics.jsonl rows ({'step', key: value}; rows of one step merged, the last
    value wins). Returns:
      stalled_from: the first step of the final stretch in which grad_norm is exactly 0 at every
        step (every group uniform: no gradient at all), when that stretch spans at least the
        last `tail` fraction of the training steps; None otherwise. With 4 prompts a step, a
        few all-uniform steps in a row happen to a learning run too (the first study's GRPO
        seeds 1 and 2 stalled for their last 14 and 12 steps).
      tail_*: means over the last `tail` fraction of the training steps of advantage/abs_mean,
        advantage/uniform_abs_mean (the advantage size on groups of uniform raw rewards; None
        where the run did not log it), groups/zero_variance_frac, grad_norm,
        completion/length_mean and completion/truncated_frac (how long the policy's answers
        grew, and how many hit the length cap).
      all_uniform_adv_abs_mean, all_zero_variance_frac: the same two over every training step.
      train_s_median, rollout_s_median: medians of time/train and time/rollout over the steps
        after the first (which compiles); eval_s: [min, max] of time/eval; eval_total_s its sum.
    """
    by_step: dict[int, dict] = {}
    for row in rows:
        by_step.setdefault(int(row["step"]), {}).update(row)
    train = sorted(s for s, r in by_step.items() if isinstance(r.get("grad_norm"), int | float))
    stalled = None
    for s in reversed(train):
        if by_step[s]["grad_norm"] != 0.0:
            break
        stalled = s
    tail_steps = train[int(len(train) * (1 - tail)) :]
    if stalled is not None and tail_steps and stalled > tail_steps[0]:
        stalled = None  # a shorter stretch of zero gradients at the end is not a stall
    later = train[1:]

    def median(key):
        xs = [by_step[s][key] for s in later if isinstance(by_step[s].get(key), int | float)]
        return float(np.median(xs)) if xs else None

    evals = [
        r["time/eval"] for r in by_step.values() if isinstance(r.get("time/eval"), int | float)
    ]
    return {
        "stalled_from": stalled,
        "tail_from": tail_steps[0] if tail_steps else None,
        "tail_adv_abs_mean": _mean_over(by_step, "advantage/abs_mean", tail_steps),
        "tail_uniform_adv_abs_mean": _mean_over(by_step, "advantage/uniform_abs_mean", tail_steps),
        "tail_zero_variance_frac": _mean_over(by_step, "groups/zero_variance_frac", tail_steps),
        "tail_grad_norm": _mean_over(by_step, "grad_norm", tail_steps),
        "tail_length_mean": _mean_over(by_step, "completion/length_mean", tail_steps),
        "tail_truncated_frac": _mean_over(by_step, "completion/truncated_frac", tail_steps),
        "all_uniform_adv_abs_mean": _mean_over(by_step, "advantage/uniform_abs_mean", train),
        "all_zero_variance_frac": _mean_over(by_step, "groups/zero_variance_frac", train),
        "train_s_median": median("time/train"),
        "rollout_s_median": median("time/rollout"),
        "eval_s": [min(evals), max(evals)] if evals else None,
        "eval_total_s": float(sum(evals)),
    }


# (label, key of run_mechanism or "wall_min", digits): the per-arm mechanism and cost columns.
ARM_MECHANISM = (
    ("advantage abs mean on uniform groups, all steps", "all_uniform_adv_abs_mean", 2),
    ("same, last quarter", "tail_uniform_adv_abs_mean", 2),
    ("zero-variance share, all steps", "all_zero_variance_frac", 2),
    ("same, last quarter", "tail_zero_variance_frac", 2),
    ("grad norm, last quarter", "tail_grad_norm", 2),
    ("completion tokens, last quarter", "tail_length_mean", 1),
    ("truncated share, last quarter", "tail_truncated_frac", 2),
    ("train step s (median)", "train_s_median", 1),
    ("rollout s (median)", "rollout_s_median", 1),
    ("evaluation total min", "eval_total_min", 1),
    ("wall min", "wall_min", 1),
)


def arm_mechanism(
    runs: Sequence[Mapping], mechanism: Mapping[str, Mapping], variants: Sequence[str]
) -> dict[str, dict]:
    """Per variant: the spread over its finished runs of each ARM_MECHANISM column, and how many
    of them stalled (grad_norm 0 to the end). runs: {'name', 'variant', 'status', 'wall_s'}."""
    out = {}
    for v in variants:
        done = [
            r for r in runs
            if r["variant"] == v and r["status"] == "finished" and r["name"] in mechanism
        ]  # fmt: skip

        def value(r, key):
            m = mechanism[r["name"]]
            if key == "wall_min":
                return None if r.get("wall_s") is None else r["wall_s"] / 60
            if key == "eval_total_min":
                return m["eval_total_s"] / 60
            return m[key]

        out[v] = {
            "runs": len(done),
            "stalled": sum(mechanism[r["name"]]["stalled_from"] is not None for r in done),
            **{key: spread([value(r, key) for r in done]) for _, key, _ in ARM_MECHANISM},
        }
    return out
