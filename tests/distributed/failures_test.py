"""An ordinary Python exception on one process stops every process of a run within a bound, with a
named error on each (mmr_jax/distributed/failures.py), through scripts/train.py itself.

The fault hook (`MMR_JAX_RAISE_AT=train:2`, infra/faults.py) raises `InjectedFault` on process 1
after it dispatched step 2's update; process 0 goes on into the step's collectives (the weight
copy for its engine), where it waits for process 1. Before the fix process 1 sat in JAX's exit
barrier (up to 300 s) while process 0 waited for it in a gather."""

import pathlib
import time

import pytest

from mmr_jax import distributed
from mmr_jax.infra import faults, metrics

from support import train_script

# Every process exits within this many seconds of the fault (cleanup's checkpoint join is bounded
# by shutdown.CLOSE_WAIT_S = 60 s; JAX's exit barrier alone would take 300 s).
_EXIT_S = 90


def _fault_logged(workdir: pathlib.Path) -> bool:
    log = workdir / "train.process1.log"
    return log.exists() and "injecting a fault" in log.read_text(errors="replace")


class TestInjectedFault:
    def test_parse_and_raise(self, monkeypatch):
        assert faults.parse("train:2", faults.RAISE_ENV) == ("train", 2)
        with pytest.raises(ValueError, match=faults.RAISE_ENV):
            faults.parse("step:2", faults.RAISE_ENV)
        monkeypatch.setattr(faults, "_RAISE", ("train", 2))
        faults.point("train", 1)  # another step: nothing
        faults.point("rollout", 2)  # another phase: nothing
        with pytest.raises(faults.InjectedFault, match="train of step 2"):
            faults.point("train", 2)


class TestKeyValueStore:
    def test_jax_internals_relied_on(self):
        """failures.kv_client reaches JAX's distributed client through a private name: a JAX
        that renames it fails here, not silently in a run (the peers' messages lose the cause)."""
        from jax._src import distributed as jax_distributed
        from jax._src.lib import _jax

        assert hasattr(jax_distributed.global_state, "client")
        for method in ("key_value_set", "key_value_try_get"):
            assert hasattr(_jax.DistributedRuntimeClient, method), method

    def test_one_process_is_a_no_op(self):
        distributed.announce(RuntimeError("x"))  # nothing to tell: no peers
        assert distributed.announced() is None


@pytest.mark.slow
def test_exception_on_one_process_stops_all(tmp_path, tiny_llama_dir):
    cfg = train_script.cluster_config(tiny_llama_dir, steps=4)
    work = tmp_path / "run"
    procs = train_script.launch(
        cfg,
        work,
        processes=2,
        per_process_env=[{}, {faults.RAISE_ENV: "train:2"}],
        # A CPU shared with other jobs can starve a process for longer than JAX's 30 s default;
        # the exit tested here does not wait for a heartbeat (closed connections end the wait).
        extra_args=("--distributed_heartbeat_s=600",),
    )
    try:
        deadline = time.monotonic() + 900
        while not _fault_logged(work) and all(p.poll() is None for p in procs):
            assert time.monotonic() < deadline, train_script.output(procs[0])[-3000:]
            time.sleep(0.2)
        fault_at = time.monotonic()
        for p in procs:
            p.wait(timeout=max(1.0, fault_at + _EXIT_S - time.monotonic()))  # a stall fails here
        waited = time.monotonic() - fault_at
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    out0, out1 = (train_script.output(p) for p in procs)
    assert procs[1].returncode == distributed.failures.EXIT_FAILED, out1[-3000:]
    assert "ERROR: InjectedFault: MMR_JAX_RAISE_AT=train:2" in out1, out1[-3000:]
    assert procs[0].returncode == distributed.failures.EXIT_PEER_LOST, out0[-3000:]
    assert "ERROR: PeerLostError" in out0, out0[-3000:]
    # Process 1 told process 0 why before it left: the peer's error names the cause.
    assert "process 1 failed: InjectedFault" in out0, out0[-3000:]
    assert waited < _EXIT_S
    # Cleanup ran on process 0 (the metric file closed with step 1's row; checkpoint 1 intact).
    rows = metrics.read_jsonl(work / metrics.METRICS_FILE)
    assert [r["step"] for r in rows][:1] == [1]
    assert (work / "checkpoints" / "1").is_dir()
