"""The reward registry: a dict from config names to reward functions, filled by a decorator.

A reward function has the signature

    fn(completions: Sequence[str], answers: Sequence[str], *, lengths: Sequence[int], **params)
      -> np.ndarray float32 [N]

and may take `grades` (a list of grading.Grade, one per row) so that `rewards.score` grades each
completion once for every correctness-based function. `needs_grades` marks those functions.
"""

from __future__ import annotations

from collections.abc import Callable

REGISTRY: dict[str, Callable] = {}
NEEDS_GRADES: set[str] = set()


def register(name: str, *, needs_grades: bool = False):
    """Decorator: `@register('accuracy', needs_grades=True)` adds the function to REGISTRY."""

    def deco(fn):
        if name in REGISTRY:
            raise ValueError(f"reward {name!r} is already registered")
        REGISTRY[name] = fn
        if needs_grades:
            NEEDS_GRADES.add(name)
        return fn

    return deco
