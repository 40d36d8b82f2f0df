"""Deterministic crash points for the crash-and-resume harness (tests/support/crash_harness.py,
run by tests/crash_harness_test.py).

`MMR_JAX_KILL_AT=<phase>:<step>` makes the process SIGKILL itself when the training loop reaches
`point(phase, step)`; phases are listed in `PHASES`. The variable is read once at import, so an
unset hook costs one comparison with None per call.
"""

from __future__ import annotations

import os
import signal

ENV = "MMR_JAX_KILL_AT"
PHASES = (
    "rollout",  # after the first generation round of the step, before its update
    "train",  # the update dispatched, not yet finished
    "checkpoint",  # the asynchronous checkpoint write dispatched, not yet finished
    "export",  # the HF export written to its temporary folder, not yet renamed
)


def parse(text: str) -> tuple[str, int] | None:
    """'train:3' -> ('train', 3); '' -> None."""
    if not text:
        return None
    phase, sep, step = text.partition(":")
    if not sep or phase not in PHASES or not step.isdigit():
        raise ValueError(f"{ENV}={text!r}: expected <phase>:<step> with phase in {PHASES}")
    return phase, int(step)


_TARGET = parse(os.environ.get(ENV, ""))


def point(phase: str, step: int | None) -> None:
    """SIGKILLs this process when `MMR_JAX_KILL_AT` names (`phase`, `step`)."""
    if _TARGET is not None and _TARGET == (phase, step):
        os.kill(os.getpid(), signal.SIGKILL)
