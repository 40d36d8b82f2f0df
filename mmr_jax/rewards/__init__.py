"""Rewards: accuracy (math-verify), format, cosine length-scaled accuracy; registry and `score`.

    from mmr_jax import rewards
    s = rewards.score(texts, answers, lengths, {"format": 1.0, "cosine": 2.0},
                      params={"cosine": {"max_len": 1024}})
    s.total  # float32 [N]; s.valid: bool [N], False where the gold answer cannot be parsed

N is the number of completions (groups flattened); `answers[i]` is the gold answer of row i.

May import: nothing of mmr_jax (grading runs in worker subprocesses of its own).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from mmr_jax.rewards import functions, grading, registry
from mmr_jax.rewards.functions import RELEASED_COSINE, cosine_schedule  # noqa: F401
from mmr_jax.rewards.grading import Grade, Grader, default_grader  # noqa: F401
from mmr_jax.rewards.registry import REGISTRY, register  # noqa: F401

assert functions  # registers the built-in rewards


@dataclasses.dataclass
class Scores:
    """Rewards of N completions.

    per_fn: name -> float32 [N], unweighted. total: float32 [N] = sum_f weight_f * per_fn[f].
    valid: bool [N], False where the gold answer cannot be parsed (the trainer leaves those rows
      out of the update; their rewards here are never the released code's 1.0).
    counts: 'gold_invalid' and 'timeouts' (rows whose grading hit the time bound; reward 0).
    """

    per_fn: dict[str, np.ndarray]
    total: np.ndarray
    valid: np.ndarray
    counts: dict[str, int] = dataclasses.field(default_factory=dict)


def make_reward_fn(name: str, **params) -> Callable:
    """The registered function `name` with its keyword parameters bound (functools.partial)."""
    if name not in REGISTRY:
        raise KeyError(f"unknown reward {name!r}; registered: {sorted(REGISTRY)}")
    return functools.partial(REGISTRY[name], **params)


def _check_inputs(completions, answers, lengths) -> None:
    for i, c in enumerate(completions):
        if not isinstance(c, str):
            raise TypeError(f"completion {i} is {type(c).__name__}, expected str (decode first)")
    for i, a in enumerate(answers):
        if not isinstance(a, str):
            raise TypeError(f"gold answer {i} is {type(a).__name__}, expected str")
    if len(answers) != len(completions) or len(lengths) != len(completions):
        raise ValueError(
            f"{len(completions)} completions, {len(answers)} answers, {len(lengths)} lengths"
        )


def score(
    completions: Sequence[str],
    answers: Sequence[str],
    lengths: Sequence[int],
    weights: Mapping[str, float],
    *,
    params: Mapping[str, Mapping] | None = None,
    grader: grading.Grader | None = None,
) -> Scores:
    """Weighted sum of the named reward functions over N completions.

    Args:
      completions: N decoded completion texts.
      answers: N gold answer strings (repeat each prompt's answer over its group).
      lengths: N completion lengths in tokens.
      weights: reward name -> weight, e.g. {'format': 1.0, 'cosine': 2.0}.
      params: reward name -> keyword parameters, e.g. {'cosine': RELEASED_COSINE}.
      grader: the math-verify grader (default: `grading.default_grader()`); each completion is
        graded once, shared by every correctness-based reward.

    Raises TypeError for a non-string completion, ValueError for a reward that is not finite.
    """
    _check_inputs(completions, answers, lengths)
    params = dict(params or {})
    unknown = set(params) - set(weights)
    if unknown:
        raise ValueError(f"params given for rewards without a weight: {sorted(unknown)}")
    grader = grader or grading.default_grader()
    n = len(completions)
    # The gold check runs even when no weighted reward needs correctness, so validity never
    # depends on which rewards are configured; with no correctness reward only golds are parsed.
    if registry.NEEDS_GRADES & set(weights):
        grades = grader.grade(completions, answers)
    else:
        grades = _gold_only(answers, grader)
    per_fn, total = {}, np.zeros([n], np.float32)
    for name, weight in weights.items():
        kwargs = dict(params.get(name, {}))
        if name in registry.NEEDS_GRADES:
            kwargs["grades"] = grades
        r = np.asarray(make_reward_fn(name, **kwargs)(completions, answers, lengths=lengths))
        if r.shape != (n,):
            raise ValueError(f"reward {name!r} returned shape {r.shape}, expected ({n},)")
        if not np.all(np.isfinite(r)):
            bad = np.flatnonzero(~np.isfinite(r))
            raise ValueError(f"reward {name!r} is not finite at rows {bad[:10].tolist()}")
        per_fn[name] = r.astype(np.float32)
        total += np.float32(weight) * per_fn[name]
    valid = np.array([g.gold_valid for g in grades], bool)
    counts = {"gold_invalid": int((~valid).sum()), "timeouts": grading.timeouts(grades)}
    return Scores(per_fn=per_fn, total=total, valid=valid, counts=counts)


def _gold_only(answers: Sequence[str], grader: grading.Grader) -> list[grading.Grade]:
    """Grades an empty completion per unique gold: only the gold's parseability matters."""
    unique = sorted(set(answers))
    by_answer = dict(zip(unique, grader.grade([""] * len(unique), unique), strict=True))
    return [by_answer[a] for a in answers]
