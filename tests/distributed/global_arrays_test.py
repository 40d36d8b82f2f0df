"""The step's batch as global arrays (distributed.global_batch): rows split over (data, fsdp) as
the dry run compiles it, each device holding only its rows, on 1 process x 2 devices and on 2
processes x 1 device; processes that built different batches stop with a named error."""

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from mmr_jax import distributed

from support import multihost

REPO = pathlib.Path(__file__).resolve().parents[2]
WORKER = REPO / "tests" / "support" / "global_batch_worker.py"
sys.path.insert(0, str(REPO / "tests" / "support"))
import global_batch_worker  # noqa: E402


def _run(mode: str, processes: int, devices: int) -> list[dict]:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    port = multihost.free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), mode]
            + ([f"localhost:{port}", str(processes), str(i)] if processes > 1 else []),
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(processes)
    ]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    results = []
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 0, out[-3000:]
        (line,) = [x for x in out.splitlines() if x.startswith("RESULT ")]
        results.append(json.loads(line[len("RESULT ") :]))
    return results


def _check_split(results):
    """Across all processes: every row field split in halves, one per device, equal to the host's
    rows; the [3, 5] field replicated whole on each device."""
    shards = {k: [] for k in ("tokens", "completion_mask", "advantages", "odd_rows")}
    for r in results:
        for k, f in r["fields"].items():
            shards[k] += f["shards"]
            if k == "odd_rows":
                assert f["spec"] == "P()", f
            else:
                assert f["spec"] == "P(('data', 'fsdp'),)", f
    for k, got in shards.items():
        assert all(s["equal"] for s in got), (k, got)
        rows = sorted(tuple(s["rows"]) for s in got)
        assert rows == ([(0, 3), (0, 3)] if k == "odd_rows" else [(0, 4), (4, 8)]), (k, rows)


@pytest.mark.slow
def test_one_process_two_devices():
    _check_split(_run("same", processes=1, devices=2))


@pytest.mark.slow
def test_two_processes_one_device_each():
    results = _run("same", processes=2, devices=1)
    assert [r["process"] for r in results] == [0, 1]
    _check_split(results)
    # Process p holds rows [4p, 4p + 4) alone.
    assert [r["fields"]["tokens"]["shards"][0]["rows"] for r in results] == [[0, 4], [4, 8]]


@pytest.mark.slow
def test_different_batches_are_a_named_error_on_every_process():
    results = _run("differ", processes=2, devices=1)
    for r in results:
        assert r.get("error", "").startswith("BatchMismatchError: process(es) [1]"), r


@pytest.mark.slow
def test_reduce_metrics_over_three_processes():
    """Times by max (the slowest process), the rest by mean, in float64 (the 1e-12 terms survive),
    the same on every process."""
    results = _run("reduce", processes=3, devices=1)
    per = [global_batch_worker.process_metrics(i) for i in range(3)]
    want = {
        "time/step": 7.5,
        "loss": float(np.mean([m["loss"] for m in per])),
        "reward/mean": float(np.mean([m["reward/mean"] for m in per])),
    }
    assert want["reward/mean"] != 1.0  # float32 would have rounded the differences away
    for r in results:
        assert r["reduced"] == want, r


class TestOneProcess:
    def test_row_sharding(self):
        from mmr_jax.models import sharding

        mesh = sharding.make_mesh(1, -1, 1)
        assert distributed.row_sharding((8, 3), mesh).spec == sharding.batch_sharding(mesh).spec

    def test_digest_sees_one_ulp(self):
        a, b = global_batch_worker.host_batch(), global_batch_worker.host_batch(perturb=True)
        assert not np.array_equal(
            distributed.global_arrays.digest(a), distributed.global_arrays.digest(b)
        )
        np.testing.assert_array_equal(
            distributed.global_arrays.digest(a),
            distributed.global_arrays.digest(global_batch_worker.host_batch()),
        )

    def test_check_same_batch_is_a_no_op(self):
        distributed.check_same_batch(global_batch_worker.host_batch())

    def test_without_mesh_plain_arrays(self):
        host = global_batch_worker.host_batch()
        dev = distributed.global_batch(host, None)
        for k in host:
            np.testing.assert_array_equal(np.asarray(dev[k]), host[k])
