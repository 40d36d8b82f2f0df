"""Deterministic faults for the crash-and-resume harness (tests/support/crash_harness.py, run by
tests/end_to_end/crash_harness_test.py) and the fail-fast tests
(tests/distributed/failures_test.py).

`MMR_JAX_KILL_AT=<phase>:<step>` makes the process SIGKILL itself when the training loop reaches
`point(phase, step)`; `MMR_JAX_RAISE_AT=<phase>:<step>` makes it raise `InjectedFault` there (an
ordinary Python exception, as an unreachable server or a full disk would raise). Phases are
listed in `PHASES`. The variables are read once at import, so unset hooks cost two comparisons
with None per call.
"""

from __future__ import annotations

import os
import signal

ENV = "MMR_JAX_KILL_AT"
RAISE_ENV = "MMR_JAX_RAISE_AT"
PHASES = (
    "rollout",  # after the first generation round of the step, before its update
    "train",  # the update dispatched, not yet finished
    "checkpoint",  # the asynchronous checkpoint write dispatched, not yet finished
    "export",  # the HF export written to its temporary folder, not yet renamed
)


class InjectedFault(RuntimeError):
    """Raised by `point` where `MMR_JAX_RAISE_AT` names the phase and step."""


def parse(text: str, env: str = ENV) -> tuple[str, int] | None:
    """'train:3' -> ('train', 3); '' -> None."""
    if not text:
        return None
    phase, sep, step = text.partition(":")
    if not sep or phase not in PHASES or not step.isdigit():
        raise ValueError(f"{env}={text!r}: expected <phase>:<step> with phase in {PHASES}")
    return phase, int(step)


_TARGET = parse(os.environ.get(ENV, ""))
_RAISE = parse(os.environ.get(RAISE_ENV, ""), RAISE_ENV)


def point(phase: str, step: int | None) -> None:
    """SIGKILLs this process when `MMR_JAX_KILL_AT` names (`phase`, `step`); raises
    `InjectedFault` when `MMR_JAX_RAISE_AT` does."""
    if _TARGET is not None and _TARGET == (phase, step):
        os.kill(os.getpid(), signal.SIGKILL)
    if _RAISE is not None and _RAISE == (phase, step):
        from absl import logging

        logging.warning("injecting a fault at %s of step %d (%s)", phase, step, RAISE_ENV)
        logging.flush()
        raise InjectedFault(f"{RAISE_ENV}={phase}:{step}: injected fault at {phase} of step {step}")
