"""Generated arithmetic tasks for the second study (issue 26): fixed, disjoint train and held-out
sets.

Each task enumerates its whole question space (every distinct question once), shuffles it with a
fixed seed, and cuts it: the first HELDOUT_SIZE questions are the held-out set, the next (at most
TRAIN_SIZE) the training set. The two are disjoint by construction, identical on every machine
and in every run, and independent of the training seed (which only orders the training data).

Used as `data.source = 'task:<name>'` (training problems) and `eval.source = 'task'` (the same
task's held-out set); see `mmr_jax.training.build`. Candidates (docs/study_v2/plan.md):

    add_2d       a + b, a and b in 10..99                      ("What is 47 + 38?")
    add_sub_2d   a + b or a - b (a >= b), a and b in 10..99     ("What is 83 - 29?")
    chain3       a +/- b +/- c, operands 1..20, result >= 0     ("What is 7 + 12 - 5?")
    mul_1d_2d    a * b, a in 2..9, b in 10..99                  ("What is 7 * 46?")

The warm-up (format learning, docs/study_v2/plan.md) uses sums of one-digit operands, the
existing `data.source = 'arithmetic'`: two operands of 1..9, disjoint from every task here
(each of those has a two-digit operand or three terms).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import random
from collections.abc import Callable, Iterator

from mmr_jax.problems import data

PREFIX = "task:"  # data.source prefix
HELDOUT_SIZE = 128
TRAIN_SIZE = 1000
MIN_TRAIN_SIZE = 500
SPLIT_SEED = 20_261_125  # fixed: the split is part of the task, not of a run


@dataclasses.dataclass(frozen=True)
class Task:
    """A question space: `questions()` yields (expression, answer) once per distinct question."""

    name: str
    description: str
    questions: Callable[[], Iterator[tuple[str, int]]]


def _add_2d():
    for a, b in itertools.product(range(10, 100), repeat=2):
        yield f"{a} + {b}", a + b


def _add_sub_2d():
    for a, b in itertools.product(range(10, 100), repeat=2):
        yield f"{a} + {b}", a + b
        if a >= b:  # differences stay non-negative: a sign is one more format to learn
            yield f"{a} - {b}", a - b


def _chain3():
    for a, b, c in itertools.product(range(1, 21), repeat=3):
        for op1, op2 in itertools.product("+-", repeat=2):
            value = a + (b if op1 == "+" else -b)
            if value < 0:  # every partial result non-negative: left to right, no sign
                continue
            value += c if op2 == "+" else -c
            if value >= 0:
                yield f"{a} {op1} {b} {op2} {c}", value


def _mul_1d_2d():
    for a, b in itertools.product(range(2, 10), range(10, 100)):
        yield f"{a} * {b}", a * b


TASKS: dict[str, Task] = {
    t.name: t
    for t in (
        Task("add_2d", "sums of two operands 10-99", _add_2d),
        Task("add_sub_2d", "sums and non-negative differences of two operands 10-99", _add_sub_2d),
        Task("chain3", "three operands 1-20 with + and -, partial results >= 0", _chain3),
        Task("mul_1d_2d", "products of a one-digit (2-9) and a two-digit operand", _mul_1d_2d),
    )
}


def task_name(source: str) -> str | None:
    """'task:add_2d' -> 'add_2d'; None for any other data source. Unknown names raise."""
    if not source.startswith(PREFIX):
        return None
    name = source[len(PREFIX) :]
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r} in data.source={source!r}; known: {sorted(TASKS)}")
    return name


@functools.cache
def split(name: str) -> tuple[tuple[data.Problem, ...], tuple[data.Problem, ...]]:
    """(training problems, held-out problems) of task `name`: disjoint, fixed, deterministic."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; known: {sorted(TASKS)}")
    space = list(dict(TASKS[name].questions()).items())  # distinct expressions, first answer
    if len(space) < HELDOUT_SIZE + MIN_TRAIN_SIZE:
        raise ValueError(
            f"task {name!r} has {len(space)} distinct questions; needs at least "
            f"{HELDOUT_SIZE + MIN_TRAIN_SIZE} ({HELDOUT_SIZE} held out + {MIN_TRAIN_SIZE} to train)"
        )
    random.Random(f"{name}:{SPLIT_SEED}").shuffle(space)
    problems = [
        data.Problem(f"{name}_{i}", f"What is {expr}?", str(value))
        for i, (expr, value) in enumerate(space[: HELDOUT_SIZE + TRAIN_SIZE])
    ]
    return tuple(problems[HELDOUT_SIZE:]), tuple(problems[:HELDOUT_SIZE])


def train_problems(name: str) -> list[data.Problem]:
    """The training problems of task `name` (at most TRAIN_SIZE, at least MIN_TRAIN_SIZE)."""
    return list(split(name)[0])


def heldout_problems(name: str) -> list[data.Problem]:
    """The HELDOUT_SIZE held-out problems of task `name`, never in its training problems."""
    return list(split(name)[1])
