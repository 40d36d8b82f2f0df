"""Which rollout feeds each training step: sampled when the step begins (`OnPolicyRollouts`),
or one step ahead, in the background while the previous step trains (`OffPolicyRollouts`,
`rollout.off_policy_lag=1`, docs/off_policy.md):

    step t:  take step t's groups (sampled while step t-1 trained, weights of step t-2)
             start step t+1's rollout in the background  (engine: weights after step t-1)
             reference / old log-probs, update          (trainer: weights t-1 -> t)
             wait for step t+1's rollout, then sync the engine to the weights after step t

Both answer `groups(step, version, timings)`, `wait`, `data_state` (the prompt position a
checkpoint records: off-policy, before the prefetched step's prompts, so that a resume samples
that step again, nothing skipped or trained twice) and `close`. The background worker is
`rollout.prefetch.Prefetcher`; the first step of a run and the first after a resume are sampled
in the foreground (lag 0); each off-policy step logs `rollout/policy_lag`. The one-process rule
of the off-policy loop is a config check (`checks.check_processes`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from mmr_jax.config import schema
from mmr_jax.rollout import prefetch
from mmr_jax.step import pipeline


def make(
    cfg: schema.TrainConfig,
    *,
    prompts,
    engine,
    tokenizer,
    encoder,
    prompts_dropped: int,
    params,
    model: Callable[[Any], Any],
    version: int,
) -> OnPolicyRollouts | OffPolicyRollouts:
    """The schedule of `cfg.rollout.off_policy_lag` over `pipeline.collect`; off-policy, the
    engine gets weights of its own (`prefetch.own`: `model(params)` at `version`)."""

    def collect_fn(step: int, timings: dict):
        groups, info = pipeline.collect(cfg, prompts, engine, tokenizer, encoder, step, timings)
        info["data/prompts_dropped"] = float(prompts_dropped)
        return groups, info

    if cfg.rollout.off_policy_lag == 0:
        return OnPolicyRollouts(collect_fn, prompts.state)
    own = prefetch.own(engine, params)
    if own is not params:  # the engine's weights become its own: the update donates the state
        engine.sync_weights(model(own), version=version)
    return OffPolicyRollouts(collect_fn, prompts.state, cfg.total_steps)


class OnPolicyRollouts:
    """Each step's groups sampled when it begins, with the weights of the step before."""

    lag = 0

    def __init__(self, collect: Callable[[int, dict], tuple[Any, dict]], data_state):
        self._collect = collect
        self._data_state = data_state

    def groups(self, step: int, version: int, timings: dict) -> tuple[Any, dict]:
        del version  # the engine holds the trainer's weights
        return self._collect(step, timings)

    @property
    def data_state(self) -> dict:
        return self._data_state()

    def wait(self, timings: dict | None = None) -> None:
        del timings  # nothing runs in the background

    def engine_params(self, engine, params):
        """The params to sync `engine` to: the trainer's own (nothing samples beside the update)."""
        del engine
        return params

    def close(self) -> bool:
        return True


class OffPolicyRollouts:
    """Step groups one step ahead: step s+1's rollout runs while step s trains.

    Args:
      collect: `(step, timings) -> (groups, info)`, the step's rollout (`collect_fn`).
      data_state: `() -> dict`, the prompt iterator's position (`data.PromptIterator.state`).
      last_step: no rollout is started beyond it.
      close_wait_s: `close` waits this long at most for a rollout in flight.
    """

    lag = 1

    def __init__(
        self,
        collect: Callable[[int, dict], tuple[Any, dict]],
        data_state: Callable[[], dict],
        last_step: int,
        *,
        close_wait_s: float = prefetch.CLOSE_WAIT_S,
    ):
        self._collect = collect
        self._data_state = data_state
        self._last = last_step
        self._close_wait_s = close_wait_s
        self._slot: prefetch.Prefetcher = prefetch.Prefetcher(
            self._background, name="rollout-prefetch"
        )
        self.data_state: dict = data_state()  # position after the last step taken

    def _background(self, step: int, cancel: threading.Event):
        if cancel.is_set():
            raise prefetch.Cancelled(f"rollout of step {step} cancelled before it began")
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

    def engine_params(self, engine, params):
        """The params to sync `engine` to: a copy of its own when it keeps the arrays it is given,
        which then outlives the next update's donation (`prefetch.own`)."""
        return prefetch.own(engine, params)

    @property
    def pending(self) -> int | None:
        return self._slot.pending

    def close(self) -> bool:
        """Cancels the rollout in flight (dropped: a resume samples its step again)."""
        return self._slot.close(self._close_wait_s)
