"""The one-slot prefetcher, driven by fake generate functions
(mmr_jax/rollout/prefetch.py) and the off-policy schedule over it
(mmr_jax/training/rollout_schedule.py): ordering, weight versions, error propagation, shutdown."""

import threading
import traceback

import pytest

from mmr_jax.rollout import prefetch
from mmr_jax.training import rollout_schedule

WAIT_S = 10.0  # a bound on every wait here: a bug shows as a failure, not a hung test


def _threads_alive(prefix="rollout-prefetch"):
    return [t for t in threading.enumerate() if t.name.startswith(prefix) and t.is_alive()]


class FakeRun:
    """A plain loop of the trainer's: prompt batches drawn in order, an engine weight version
    that changes only in `sync`, and a record of which version sampled each step."""

    def __init__(self, batch=2):
        self.position, self.batch = 0, batch
        self.engine_version = 0
        self.sampled = {}  # step -> (engine version, prompt positions)
        self.generating = threading.Event()

    def collect(self, step, timings):
        self.generating.set()
        drawn = list(range(self.position, self.position + self.batch))
        self.position += self.batch
        self.sampled[step] = (self.engine_version, drawn)
        timings["rollout"] = 1.0
        return f"groups{step}", {"info": step}

    def data_state(self):
        return {"position": self.position}


def _loop(run, rollouts, last, first=1, *, saved=None):
    """The trainer's loop (trainer.train) over steps first..last; the weight version after step s
    is s. -> the info of each step."""
    infos = {}
    for step in range(first, last + 1):
        timings = {}
        groups, info = rollouts.groups(step, step - 1, timings)
        assert groups == f"groups{step}" and timings["rollout"] == 1.0
        infos[step] = info
        # ... the update of `step` runs here, beside the rollout of step + 1 ...
        rollouts.wait(timings)
        assert "rollout_wait" in timings
        run.engine_version = step  # sync_weights(version=step), the engine free
        if saved is not None:
            saved[step] = dict(rollouts.data_state)
    return infos


class TestOffPolicySchedule:
    def test_step_t_plus_1_sampled_with_weights_t_minus_1(self):
        run = FakeRun()
        rollouts = rollout_schedule.OffPolicyRollouts(run.collect, run.data_state, last_step=5)
        infos = _loop(run, rollouts, 5)
        # Step 1 has nothing prefetched: sampled now, with the initial weights (lag 0). Step s+1
        # is sampled while step s trains, by the engine holding the weights after step s-1.
        assert {s: v for s, (v, _) in run.sampled.items()} == {1: 0, 2: 0, 3: 1, 4: 2, 5: 3}
        assert [infos[s]["rollout/policy_lag"] for s in range(1, 6)] == [0.0, 1.0, 1.0, 1.0, 1.0]
        assert all(infos[s]["info"] == s for s in infos)
        # Every prompt batch once, in order; nothing sampled beyond the last step.
        assert [run.sampled[s][1] for s in range(1, 6)] == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]
        assert run.position == 10 and rollouts.pending is None
        assert rollouts.close() and not _threads_alive()

    def test_checkpointed_position_excludes_the_prefetched_step_and_resume_regenerates(self):
        run = FakeRun()
        rollouts = rollout_schedule.OffPolicyRollouts(run.collect, run.data_state, last_step=5)
        saved = {}
        _loop(run, rollouts, 3, saved=saved)  # interrupted after step 3 (step 4 prefetched)
        assert run.position == 8  # step 4's prompts drawn by the background rollout
        assert saved == {1: {"position": 2}, 2: {"position": 4}, 3: {"position": 6}}
        assert rollouts.close()
        # Resume from the checkpoint of step 3: its position, its weights (version 3).
        resumed = FakeRun()
        resumed.position, resumed.engine_version = saved[3]["position"], 3
        again = rollout_schedule.OffPolicyRollouts(resumed.collect, resumed.data_state, last_step=5)
        infos = _loop(resumed, again, 5, first=4)
        assert [infos[s]["rollout/policy_lag"] for s in (4, 5)] == [0.0, 1.0]
        assert {s: v for s, (v, _) in resumed.sampled.items()} == {4: 3, 5: 3}
        # Steps 4 and 5 consume the prompts after step 3's, once each: 5 steps, 5 batches.
        assert [resumed.sampled[s][1] for s in (4, 5)] == [[6, 7], [8, 9]]
        assert resumed.position == 10
        assert again.close()

    def test_rollout_overlaps_the_caller(self):
        # The background rollout of step 2 waits for the caller's "update" of step 1: a
        # synchronous implementation would deadlock here (bounded by WAIT_S).
        run, updated = FakeRun(), threading.Event()

        def collect(step, timings):
            if step == 2:
                assert updated.wait(WAIT_S), "the rollout of step 2 did not overlap step 1"
            return run.collect(step, timings)

        rollouts = rollout_schedule.OffPolicyRollouts(collect, run.data_state, last_step=2)
        rollouts.groups(1, 0, {})
        updated.set()  # step 1's update, while step 2 is sampled
        rollouts.wait()
        groups, info = rollouts.groups(2, 1, {})
        assert groups == "groups2" and info["rollout/policy_lag"] == 1.0
        assert rollouts.close()


def _raise_at(step_to_fail):
    def collect_fails(step, timings):
        if step == step_to_fail:
            raise ValueError(f"engine down at step {step}")
        return f"groups{step}", {}

    return collect_fails


class TestErrors:
    def test_background_error_reraised_chained_with_its_traceback(self):
        rollouts = rollout_schedule.OffPolicyRollouts(_raise_at(3), dict, last_step=5)
        rollouts.groups(1, 0, {})
        rollouts.wait()
        rollouts.groups(2, 1, {})  # starts step 3's rollout, which raises
        with pytest.raises(prefetch.PrefetchError, match="step 3 .*ValueError: engine down") as e:
            rollouts.wait()
        assert isinstance(e.value.__cause__, ValueError)
        frames = traceback.extract_tb(e.value.__cause__.__traceback__)
        assert any(f.name == "collect_fails" for f in frames)  # the worker's own frames
        assert rollouts.pending is None and not _threads_alive()
        assert rollouts.close()

    def test_error_of_a_step_not_yet_waited_for_surfaces_at_take(self):
        slot = prefetch.Prefetcher(lambda step, cancel: 1 / 0, name="rollout-prefetch-t")
        slot.start(7, 6)
        with pytest.raises(prefetch.PrefetchError, match="step 7 .*weights version 6") as e:
            slot.take(7)
        assert isinstance(e.value.__cause__, ZeroDivisionError)
        assert slot.close() and not _threads_alive()

    def test_out_of_order_use_is_a_named_error(self):
        release = threading.Event()
        slot = prefetch.Prefetcher(lambda step, cancel: release.wait(WAIT_S) and step)
        slot.start(1, 0)
        with pytest.raises(prefetch.PrefetchUsageError, match="step 1 is still in the slot"):
            slot.start(2, 0)
        with pytest.raises(prefetch.PrefetchUsageError, match="holds step 1"):
            slot.take(2)
        release.set()
        got = slot.take(1)
        assert (got.step, got.version, got.value) == (1, 0, 1)
        assert slot.close()
        with pytest.raises(prefetch.PrefetchUsageError, match="closed"):
            slot.start(3, 0)

    def test_wait_timeout_is_a_named_error(self):
        release = threading.Event()
        slot = prefetch.Prefetcher(lambda step, cancel: release.wait(WAIT_S))
        slot.start(1, 0)
        with pytest.raises(prefetch.PrefetchError, match="did not finish in 0.05 s"):
            slot.wait(0.05)
        release.set()
        assert slot.close(WAIT_S)


class TestShutdown:
    def test_close_cancels_a_cooperative_rollout(self):
        started = threading.Event()

        def generate(step, cancel):
            started.set()
            if cancel.wait(WAIT_S):
                raise prefetch.Cancelled(f"step {step}")
            return "not cancelled"

        slot = prefetch.Prefetcher(generate, name="rollout-prefetch-c")
        slot.start(1, 0)
        assert started.wait(WAIT_S)
        assert slot.close(WAIT_S) is True  # the worker saw the event and ended
        assert slot.pending is None and not _threads_alive()

    def test_close_abandons_a_rollout_that_does_not_end(self):
        release = threading.Event()
        slot = prefetch.Prefetcher(lambda s, c: release.wait(WAIT_S), name="rollout-prefetch-h")
        slot.start(1, 0)
        assert slot.close(0.05) is False  # bounded: the caller goes on with its own error
        assert slot.running  # a daemon thread: it cannot hold the process at exit
        assert all(t.daemon for t in _threads_alive())
        release.set()

    def test_close_after_the_last_step_is_a_no_op(self):
        run = FakeRun()
        rollouts = rollout_schedule.OffPolicyRollouts(run.collect, run.data_state, last_step=1)
        rollouts.groups(1, 0, {})
        assert rollouts.pending is None  # nothing started beyond the last step
        assert rollouts.close() and rollouts.close()

    def test_close_before_the_rollout_begins_cancels_it(self):
        calls = []
        rollouts = rollout_schedule.OffPolicyRollouts(
            lambda s, t: calls.append(s) or ("g", {}), dict, last_step=3
        )
        rollouts._slot._cancel.set()  # as close() sets it, before the worker runs collect
        rollouts.groups(1, 0, {})
        with pytest.raises(prefetch.PrefetchError, match="Cancelled"):
            rollouts.wait()
        assert calls == [1]  # step 2's collect never ran
        assert rollouts.close()


class TestOwnWeights:
    def test_embedded_engine_gets_buffers_that_outlive_a_donation(self):
        import jax.numpy as jnp
        import numpy as np

        from mmr_jax.rollout import embedded

        params = {"w": jnp.arange(6.0).reshape(2, 3), "b": jnp.ones(3)}
        engine = object.__new__(embedded.EmbeddedEngine)  # only its type matters here
        mine = prefetch.own(engine, params)
        for x in params.values():
            x.delete()  # what the update's donation does to the trainer's arrays
        np.testing.assert_array_equal(np.asarray(mine["w"]), np.arange(6.0).reshape(2, 3))
        np.testing.assert_array_equal(np.asarray(mine["b"]), np.ones(3))

    def test_other_engines_get_the_arrays_themselves(self):
        params = {"w": object()}
        assert prefetch.own(object(), params) is params  # vLLM copies them out itself
