"""One-step off-policy rollouts (`rollout.off_policy_lag=1`, docs/off_policy.md).

    step t:  take step t's groups (sampled while step t-1 trained, weights of step t-2)
             start step t+1's rollout in the background  (engine: weights after step t-1)
             reference / old log-probs, update          (trainer: weights t-1 -> t)
             wait for step t+1's rollout, then sync the engine to the weights after step t

`Prefetcher` is the mechanism: a one-slot background worker (a daemon thread) with its result,
its error re-raised in the caller's thread as `PrefetchError` (the worker's exception chained, its
traceback kept), and a bounded close that cancels. It knows nothing of training; its tests drive
it with a fake generate function.

The schedule that uses it (which step's groups come from the slot, the data position a
checkpoint records) is the trainer's: `training/rollout_schedule.py`. `own` gives the engine
weights of its own, so that it can sample while the update donates the trainer's.

Only the engine's `generate` runs in the worker; the trainer changes the engine's weights only
after `wait`, so the engine never samples and syncs at once.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from absl import logging

T = TypeVar("T")

# A close waits this long at most for a rollout in flight (a JAX call cannot be interrupted);
# the daemon thread is then abandoned and dies with the process.
CLOSE_WAIT_S = 60.0


class PrefetchError(RuntimeError):
    """A background rollout raised (its exception is `__cause__`), or outran its wait."""


class PrefetchUsageError(RuntimeError):
    """The slot was used out of order: a second start, a take of a step not in it, or a use
    after close."""


class Cancelled(RuntimeError):
    """Raised by a generate function that saw its cancel event set (`Prefetcher.close`)."""


@dataclasses.dataclass(frozen=True)
class Prefetched(Generic[T]):
    """A finished background rollout: its step, the weight version it sampled with, its value."""

    step: int
    version: int
    value: T


class Prefetcher(Generic[T]):
    """A one-slot background worker: `start(step, version)`, then `take(step)` (or `wait()`).

    Args:
      generate: `(step, cancel) -> value`, run in a daemon thread; `cancel` (a threading.Event)
        is set by `close`, for a function that can stop early (`Cancelled`).
      name: the thread's name (in tracebacks and thread dumps).
    """

    def __init__(self, generate: Callable[[int, threading.Event], T], *, name: str = "prefetch"):
        self._generate = generate
        self._name = name
        self._closed = False
        self._clear()

    def _clear(self) -> None:
        self._thread: threading.Thread | None = None
        self._step: int | None = None
        self._version: int | None = None
        self._result: Any = None
        self._error: BaseException | None = None
        self._done = threading.Event()
        self._cancel = threading.Event()

    @property
    def pending(self) -> int | None:
        """The step in the slot (running or finished, not yet taken); None when empty."""
        return self._step

    @property
    def running(self) -> bool:
        """Whether the slot's worker is still generating."""
        return self._thread is not None and not self._done.is_set()

    def start(self, step: int, version: int) -> None:
        """Starts `generate(step, cancel)` in the background; `version` is the weight version the
        engine holds now (returned with the result)."""
        if self._closed:
            raise PrefetchUsageError(f"start of step {step}: the prefetcher is closed")
        if self._step is not None:
            raise PrefetchUsageError(
                f"start of step {step}: step {self._step} is still in the slot (take it first)"
            )
        self._step, self._version = int(step), int(version)
        done, cancel = self._done, self._cancel

        def work():
            try:
                self._result = self._generate(step, cancel)
            except BaseException as e:  # re-raised in the caller's thread (`wait`)
                self._error = e
            finally:
                done.set()

        self._thread = threading.Thread(target=work, name=f"{self._name}-step{step}", daemon=True)
        self._thread.start()

    def wait(self, timeout: float | None = None) -> None:
        """Blocks until the slot's rollout has finished (no-op when the slot is empty).

        Raises:
          PrefetchError: the rollout raised (chained; the slot is emptied), or it did not finish
            within `timeout` seconds (it keeps running; `close` abandons it).
        """
        if self._step is None:
            return
        if not self._done.wait(timeout):
            raise PrefetchError(
                f"the background rollout of step {self._step} did not finish in {timeout} s"
            )
        if self._error is not None:
            step, version, error = self._step, self._version, self._error
            self._clear()
            raise PrefetchError(
                f"the background rollout of step {step} (weights version {version}) failed: "
                f"{type(error).__name__}: {error}"
            ) from error

    def take(self, step: int, timeout: float | None = None) -> Prefetched[T]:
        """Step `step`'s finished rollout (waiting for it); the slot is empty afterwards."""
        if self._step != step:
            raise PrefetchUsageError(f"take of step {step}: the slot holds step {self._step}")
        self.wait(timeout)
        out = Prefetched(self._step, self._version, self._result)
        self._clear()
        return out

    def close(self, timeout: float = CLOSE_WAIT_S) -> bool:
        """Cancels and drops the slot's rollout; joins its thread for at most `timeout` seconds.
        Idempotent. -> True when no worker is left running."""
        self._closed = True
        thread, step = self._thread, self._step
        if thread is None:
            return True
        self._cancel.set()
        thread.join(timeout)
        if thread.is_alive():
            logging.warning(
                "the background rollout of step %s runs on after %.0f s; abandoned", step, timeout
            )
            return False
        self._clear()
        return True


def own(engine, params):
    """`params` to hand to `engine.sync_weights` when the engine samples beside the update.

    The embedded engine keeps the arrays it is given, and the update donates the trainer's
    state: it gets a copy (buffers of its own, same shardings). An engine that copies the
    weights out (vLLM: written to its sync folder) gets the arrays themselves."""
    import jax

    from mmr_jax.rollout import embedded

    if not isinstance(engine, embedded.EmbeddedEngine):
        return params
    return jax.tree.map(lambda x: x.copy(), params)
