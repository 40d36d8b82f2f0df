"""One-step off-policy rollouts (`rollout.off_policy_lag=1`, docs/off_policy.md).

    step t:  take step t's groups (sampled while step t-1 trained, weights of step t-2)
             start step t+1's rollout in the background  (engine: weights after step t-1)
             reference / old log-probs, update          (trainer: weights t-1 -> t)
             wait for step t+1's rollout, then sync the engine to the weights after step t

`Prefetcher` is the mechanism: a one-slot background worker (a daemon thread) with its result,
its error re-raised in the caller's thread as `PrefetchError` (the worker's exception chained, its
traceback kept), and a bounded close that cancels. It knows nothing of training; its tests drive
it with a fake generate function.

`OffPolicyRollouts` is the trainer's side: which step's groups come from the slot, which are
sampled in the foreground (the first step of a run and the first after a resume: lag 0), the
policy lag of each step (`rollout/policy_lag`), and the data position a checkpoint records
(before the prefetched step's prompts: a resume samples that step again, nothing is skipped or
trained twice).

Only the engine's `generate` runs in the worker; the trainer changes the engine's weights only
after `wait`, so the engine never samples and syncs at once.
"""

from __future__ import annotations

import dataclasses
import threading
import time
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


class OffPolicyRollouts:
    """Step groups one step ahead: step s+1's rollout runs while step s trains.

    Args:
      collect: `(step, timings) -> (groups, info)`, the step's rollout (`trainer.collect`).
      data_state: `() -> dict`, the prompt iterator's position (`data.PromptIterator.state`).
      last_step: no rollout is started beyond it.
      close_wait_s: `close` waits this long at most for a rollout in flight.
    """

    def __init__(
        self,
        collect: Callable[[int, dict], tuple[Any, dict]],
        data_state: Callable[[], dict],
        last_step: int,
        *,
        close_wait_s: float = CLOSE_WAIT_S,
    ):
        self._collect = collect
        self._data_state = data_state
        self._last = last_step
        self._close_wait_s = close_wait_s
        self._slot: Prefetcher = Prefetcher(self._background, name="rollout-prefetch")
        self.data_state: dict = data_state()  # position after the last step taken

    def _background(self, step: int, cancel: threading.Event):
        if cancel.is_set():
            raise Cancelled(f"rollout of step {step} cancelled before it began")
        timings: dict = {}
        groups, info = self._collect(step, timings)
        return groups, info, timings

    def groups(self, step: int, version: int, timings: dict) -> tuple[Any, dict]:
        """Step `step`'s groups and info, the trainer at weight `version`; then starts step
        `step + 1`'s rollout (the engine at `version`), unless `step` is the last.

        The step's groups come from the slot when it holds them (sampled with an older version),
        else they are sampled now (lag 0). Their `timings` (rollout, rewards, embeddings) are
        added to `timings`; `info` gains `rollout/policy_lag` (`version` minus the sampler's).
        """
        if self._slot.pending == step:
            got = self._slot.take(step)
            groups, info, bg = got.value
            for k, v in bg.items():
                timings[k] = timings.get(k, 0.0) + v
            sampled = got.version
        else:
            groups, info = self._collect(step, timings)
            sampled = version
        info = {**info, "rollout/policy_lag": float(version - sampled)}
        self.data_state = self._data_state()  # step's prompts drawn, step + 1's not yet
        if step < self._last:
            self._slot.start(step + 1, version)
        return groups, info

    def wait(self, timings: dict | None = None) -> None:
        """Waits for the rollout in flight (before the engine's weights change); its error is
        raised here as `PrefetchError`. The wait goes to `timings['rollout_wait']`."""
        t0 = time.perf_counter()
        self._slot.wait()
        if timings is not None:
            timings["rollout_wait"] = time.perf_counter() - t0

    @property
    def pending(self) -> int | None:
        return self._slot.pending

    def close(self) -> bool:
        """Cancels the rollout in flight (dropped: a resume samples its step again)."""
        return self._slot.close(self._close_wait_s)


def for_run(run, collect) -> OffPolicyRollouts | None:
    """The schedule of a `trainer.Run` with `rollout.off_policy_lag=1` (None with 0), over
    `collect(run, step, timings)`; its engine gets a copy of the run's weights."""
    import jax

    from mmr_jax.config import config_types

    if run.cfg.rollout.off_policy_lag == 0:
        return None
    if jax.process_count() > 1:  # the rollout's gathers would interleave with the update's
        raise config_types.ConfigError("rollout.off_policy_lag=1 runs on one process only")
    params = own(run.engine, run.state.params)
    if params is not run.state.params:  # the engine's weights become its own
        run.engine.sync_weights(run.policy.model(params), version=int(run.state.step))
    return OffPolicyRollouts(
        lambda step, timings: collect(run, step, timings), run.prompts.state, run.cfg.total_steps
    )


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
