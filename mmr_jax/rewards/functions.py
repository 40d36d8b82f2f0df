"""Reward functions of the paper: accuracy, format, cosine (length-scaled accuracy); and
DAPO's soft overlong punishment (`overlong`).

Shapes: N completions (all groups of a batch flattened); every function returns float32 [N].
Reference: MMR-GRPO (Wei et al.), appendix "Reward Functions", and its released code (open-r1
rewards). Deliberate differences from the released code are listed per function.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np

from mmr_jax.rewards import grading, registry

# The paper's format: reasoning in <think></think>, then <answer></answer> holding a \boxed{}.
_TAGS_RE = re.compile(
    r"^\s*<think>.*?</think>\s*<answer>.*?\\boxed\{.*?\}.*?</answer>\s*$", re.DOTALL
)


def _grades(completions, answers, grades, grader):
    if grades is None:
        grades = (grader or grading.default_grader()).grade(completions, answers)
    if len(grades) != len(completions):
        raise ValueError(f"{len(grades)} grades for {len(completions)} completions")
    return grades


@registry.register("accuracy", needs_grades=True)
def accuracy(
    completions: Sequence[str],
    answers: Sequence[str],
    *,
    lengths: Sequence[int] | None = None,
    grades: Sequence[grading.Grade] | None = None,
    grader: grading.Grader | None = None,
    number_only: bool = False,
) -> np.ndarray:
    """1.0 where math-verify finds the completion's answer equivalent to the gold, else 0.0.

    Rows whose gold answer cannot be parsed get 0.0 here and valid=False from `rewards.score`
    (the released code gave them 1.0); rows that time out get 0.0 and are counted there.

    number_only: also require the stated answer to be a plain number. math-verify evaluates
      expressions, so on arithmetic prompts ("What is 3 + 9?") restating the question ("The
      answer is 3 + 9") counts as correct; small models find that shortcut within a few steps.
    """
    del lengths
    grades = _grades(completions, answers, grades, grader)
    correct = np.array([g.correct for g in grades], bool)
    if number_only:
        correct &= np.array([states_a_number(c) for c in completions], bool)
    return correct.astype(np.float32)


# The stated answer: the last \boxed{...}, else what follows the last "answer is" up to a comma,
# semicolon, line end or sentence end.
_BOXED_RE = re.compile(r"\\boxed\{([^{}]*)\}")
_ANCHOR_RE = re.compile(r"answer is:?\s*(.*?)(?:[,;\n]|\.(?:\s|$)|$)", re.IGNORECASE)
_NUMBER_RE = re.compile(r"\$?\s*-?\d+(?:\.\d+)?\s*\$?\.?")


def states_a_number(completion: str) -> bool:
    """The stated answer (last \\boxed{}, else after the last "answer is") is a plain number."""
    boxed = _BOXED_RE.findall(completion)
    if boxed:
        return bool(_NUMBER_RE.fullmatch(boxed[-1].strip()))
    anchored = _ANCHOR_RE.findall(completion)
    return bool(anchored) and bool(_NUMBER_RE.fullmatch(anchored[-1].strip()))


@registry.register("format")
def format_reward(
    completions: Sequence[str],
    answers: Sequence[str] | None = None,
    *,
    lengths: Sequence[int] | None = None,
    style: str = "tags",
) -> np.ndarray:
    """1.0 for a well-formed completion, else 0.0.

    style='tags' (the paper's description and training system prompt): the whole completion is
      `<think> ... </think> <answer> ... \\boxed{...} ... </answer>` (whitespace allowed around).
    style='r1' (the released code, for R1-distilled models whose chat template opens `<think>`
      itself): the completion contains the string "\\n</think>\\n" exactly once.
    """
    del answers, lengths
    if style == "tags":
        return np.array([bool(_TAGS_RE.match(c)) for c in completions], np.float32)
    if style == "r1":
        return np.array([c.count("\n</think>\n") == 1 for c in completions], np.float32)
    raise ValueError(f"unknown format style {style!r}; expected 'tags' or 'r1'")


@registry.register("format_r1")
def format_r1(completions, answers=None, *, lengths=None) -> np.ndarray:
    """The released code's format reward: format_reward(style='r1')."""
    return format_reward(completions, answers, lengths=lengths, style="r1")


def cosine_schedule(
    length_N: np.ndarray,
    correct_N: np.ndarray,
    *,
    max_len: float,
    clamp: bool = True,
    min_value_wrong: float = 0.0,
    max_value_wrong: float = -0.5,
    min_value_correct: float = 0.5,
    max_value_correct: float = 1.0,
) -> np.ndarray:
    """r = lo + (hi - lo) * (1 + cos(pi * L / max_len)) / 2 (released `cosine_scaled_reward`).

    Correct: lo, hi = min_value_correct, max_value_correct (1.0 at L=0 down to 0.5 at max_len).
    Wrong: lo, hi = max_value_wrong, min_value_wrong (the released code's swap): 0.0 at L=0 down
    to -0.5 at max_len with the released defaults, so long wrong answers are penalised more. (The
    paper's prose says short wrong answers get the stronger penalty; the released defaults, which
    this project follows, do the opposite.)

    clamp=True uses min(L, max_len). clamp=False (released) leaves L unbounded, which makes the
    reward periodic in L with period 2 * max_len: with max_len=1000 characters, a correct 2000-char
    completion scores 1.0 again, exactly like an empty one, and a wrong one 0.0 again, so for
    R1-style completions of several thousand characters the "length penalty" is an arbitrary
    function of length.
    """
    length_N = np.asarray(length_N, np.float64)
    if clamp:
        length_N = np.minimum(length_N, max_len)
    cos = np.cos(np.pi * length_N / max_len)
    correct_N = np.asarray(correct_N, bool)
    lo = np.where(correct_N, min_value_correct, max_value_wrong)
    hi = np.where(correct_N, max_value_correct, min_value_wrong)
    return (lo + 0.5 * (hi - lo) * (1.0 + cos)).astype(np.float32)


@registry.register("cosine", needs_grades=True)
def cosine(
    completions: Sequence[str],
    answers: Sequence[str],
    *,
    lengths: Sequence[int] | None = None,
    grades: Sequence[grading.Grade] | None = None,
    grader: grading.Grader | None = None,
    max_len: int = 3584,
    unit: str = "tokens",
    clamp: bool = True,
    min_value_wrong: float = 0.0,
    max_value_wrong: float = -0.5,
    min_value_correct: float = 0.5,
    max_value_correct: float = 1.0,
) -> np.ndarray:
    """Length-scaled accuracy (see `cosine_schedule`).

    Default: L = `lengths` (completion tokens), clamped at max_len (default 3584, the paper's max
    completion length; set it to the run's max_new_tokens). `RELEASED_COSINE` reproduces the
    released code: L = len(completion) in characters, unclamped, max_len 1000.
    """
    if unit == "tokens":
        if lengths is None:
            raise ValueError("cosine reward with unit='tokens' needs `lengths`")
        length_N = np.asarray(lengths)
    elif unit == "chars":
        length_N = np.array([len(c) for c in completions])
    else:
        raise ValueError(f"unknown cosine unit {unit!r}; expected 'tokens' or 'chars'")
    if len(length_N) != len(completions):
        raise ValueError(f"{len(length_N)} lengths for {len(completions)} completions")
    grades = _grades(completions, answers, grades, grader)
    correct_N = np.array([g.correct for g in grades], bool)
    return cosine_schedule(
        length_N,
        correct_N,
        max_len=max_len,
        clamp=clamp,
        min_value_wrong=min_value_wrong,
        max_value_wrong=max_value_wrong,
        min_value_correct=min_value_correct,
        max_value_correct=max_value_correct,
    )


# The released code's cosine reward, for reproduction: `params={'cosine': RELEASED_COSINE}`.
RELEASED_COSINE = dict(unit="chars", clamp=False, max_len=1000)


@registry.register("overlong")
def overlong(
    completions: Sequence[str],
    answers: Sequence[str] | None = None,
    *,
    lengths: Sequence[int] | None = None,
    max_len: int = 3584,
    cache_len: int = 716,
) -> np.ndarray:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13), L = completion tokens:

        0                                  L <= L_max - L_cache
        ((L_max - L_cache) - L) / L_cache  L_max - L_cache < L <= L_max
        -1                                 L > L_max

    with L_max = `max_len` and L_cache = `cache_len` (DAPO: 20480 and 4096; verl's
    `overlong_buffer`, TRL's `get_soft_overlong_punishment`). Added to the task reward.
    """
    if lengths is None:
        raise ValueError("the overlong reward needs `lengths` (completion tokens)")
    if not 0 <= cache_len <= max_len:
        raise ValueError(f"overlong cache_len={cache_len} must lie in [0, max_len={max_len}]")
    length_N = np.asarray(lengths, np.float64)
    if len(length_N) != len(completions):
        raise ValueError(f"{len(length_N)} lengths for {len(completions)} completions")
    start = max_len - cache_len
    ramp = (start - length_N) / max(cache_len, 1)
    out = np.where(length_N <= start, 0.0, np.where(length_N <= max_len, ramp, -1.0))
    return out.astype(np.float32)
