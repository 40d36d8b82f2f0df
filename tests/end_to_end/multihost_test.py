"""Multi-process training on real CPU process clusters: the contract (N processes x k devices give
the metrics of one process with N * k devices and the same mesh shape) and faults (a killed
process, a resume on another process count or on the same one, an unreadable checkpoint).

The start-up checks, shares and gathers on their own are tests/distributed/distributed_test.py."""

import pathlib
import shutil
import sys
import time

import numpy as np
import pytest

from mmr_jax.infra import faults, metrics
from mmr_jax.training import checkpoint, problem_sets

from support import crash_harness, multihost_runs

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "configs"))
import dapo  # noqa: E402

# One worker under `pytest -n 2 --dist loadgroup` (CI): the module's runs (the reference, the
# uninterrupted and the killed 2-process runs) are fixtures its tests share, built once.
pytestmark = pytest.mark.xdist_group("multihost")
# A process whose peer died exits within this (the heartbeat timeout is 30 s).
_PEER_EXIT_S = 120
_config, _run, _ok = multihost_runs.config, multihost_runs.run, multihost_runs.ok
_metrics, _assert_same = multihost_runs.metrics_of, multihost_runs.assert_same


# The reference run carries every contract of the module in one pair of runs (one process of two
# devices, two processes of one): DAPO with MMR, dynamic sampling (the filter reward is constant on
# about half the groups, so they are dropped and refilled), an evaluation at the last step over 5
# held-out problems (shares of 3 and 2), and HF exports. The fault tests kill and resume it.
_REFERENCE = {
    "checkpoint.export_hf": True,
    "rewards.weights": {"test_target": 1.0, "test_target_even": 0.0},
    "dynamic_sampling.filter_reward": "test_target_even",
    "dynamic_sampling.max_generation_batches": 4,
    "eval.every": 3,
    "eval.source": problem_sets.ARITHMETIC,
    "eval.arithmetic_problems": 5,
    "eval.n": 2,
    "eval.max_new_tokens": 8,
}


# Session scope (here and below): xdist's loadgroup can interleave this module's tests with the
# group's other modules, which tore module-scoped runs down and rebuilt them in a full run.
@pytest.fixture(scope="session")
def reference(tmp_path_factory, tiny_llama_dir):
    """(config, workdir) of 3 steps of `_REFERENCE` on 1 process x 2 devices."""
    cfg = _config(dapo, tiny_llama_dir, steps=3, **_REFERENCE)
    assert cfg["dynamic_sampling"]["enabled"] and cfg["reweight"]["method"] == "mmr"
    one = tmp_path_factory.mktemp("multihost") / "one"
    _ok(_run(cfg, one, processes=1, devices=2))
    return cfg, one


@pytest.fixture(scope="session")
def reference_two(tmp_path_factory, reference):
    """The workdir of the same run on 2 processes x 1 device, uninterrupted."""
    cfg, _ = reference
    two = tmp_path_factory.mktemp("multihost") / "two"
    _ok(_run(cfg, two, processes=2, devices=1))
    return two


@pytest.fixture(scope="session")
def killed_two(tmp_path_factory, reference):
    """(workdir, seconds process 0 took to stop) of the 2-process run whose process 1 was killed
    in step 3's update; checkpoints 1 and 2 are complete. Tests resume copies of it."""
    cfg, _ = reference
    work = tmp_path_factory.mktemp("multihost") / "killed"
    procs = multihost_runs.launch(
        cfg, work, processes=2, devices=1, per_process_env=[{}, {faults.ENV: "train:3"}]
    )
    procs[1].wait(timeout=900)
    died = time.monotonic()
    procs[0].wait(timeout=_PEER_EXIT_S)  # a hang fails here
    waited = time.monotonic() - died
    out0 = pathlib.Path(procs[0].out_path).read_text()
    assert procs[1].returncode == -9
    assert procs[0].returncode != 0 and "PeerLostError" in out0, out0[-3000:]
    return work, waited


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _resumed_from(workdir, processes: int) -> list[int | None]:
    """The step each process's log header says it resumed from (the last run's header)."""
    names = ["train.log"] + [f"train.process{i}.log" for i in range(1, processes)]
    out = []
    for name in names:
        headers = [x for x in (workdir / name).read_text().splitlines() if "| workdir " in x]
        out.append(multihost_runs.header_resume_step(headers[-1]))
    return out


def _tensors(folder) -> dict:
    from safetensors.numpy import load_file

    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


def _check_contract(cfg, one, two):
    a, b = _metrics(one), _metrics(two)
    assert len(a) == cfg["total_steps"] and a[0]["grad_norm"] > 0
    assert a[0]["advantage/abs_mean"] > 0 and a[0]["reward/std"] > 0  # a step with signal
    _assert_same(a, b)
    return a


@pytest.mark.slow
class TestContract:
    """2 processes x 1 device against 1 process x 2 devices (mesh (1, 2, 1) in both)."""

    def test_dapo_mmr_dynamic_sampling_eval_and_export(self, reference, reference_two):
        cfg, one = reference
        a = _check_contract(cfg, one, reference_two)
        assert all(r["mmr/lambda_mean"] > 0 for r in a)
        assert any(r["dynamic_sampling/dropped_frac"] > 0 for r in a)  # the retry loop ran
        assert any(r["dynamic_sampling/generation_batches"] > 1 for r in a)
        assert "eval/heldout/pass@1" in a[-1]  # compared with the rest
        # Process 0 alone wrote the HF exports, from weights gathered over both processes.
        ref, got = (_tensors(d / "step_3") for d in (one, reference_two))
        assert ref.keys() == got.keys() and ref
        for k in ref:
            np.testing.assert_allclose(got[k], ref[k], rtol=2e-5, atol=1e-6, err_msg=k)


@pytest.mark.slow
class TestFaults:
    def test_killed_process_then_resume_on_one(self, tmp_path, reference, killed_two):
        """Process 1 dies in step 3's update: process 0 exits with a named error in bounded time;
        the run then resumes on 1 process x 2 devices from step 2 with the reference metrics."""
        cfg, one = reference
        killed, waited = killed_two
        assert waited < _PEER_EXIT_S
        work = _copy(killed, tmp_path / "killed")
        assert [r["step"] for r in _metrics(work)] == [1, 2]
        _ok(_run(cfg, work, processes=1, devices=2))  # 2 -> 1 processes, same checkpoint
        _assert_same(_metrics(one), _metrics(work))

    def test_killed_process_then_resume_on_two(
        self, tmp_path, reference, reference_two, killed_two
    ):
        """The crash harness on 2 processes: the same command re-run after the kill resumes on
        both processes from the last checkpoint (step 2) and ends where the uninterrupted
        2-process run ends, bit for bit: checkpoint, data position, metrics, HF exports."""
        cfg, _ = reference
        work = _copy(killed_two[0], tmp_path / "killed")
        _ok(_run(cfg, work, processes=2, devices=1))
        assert _resumed_from(work, 2) == [2, 2]
        diffs = crash_harness.differences(reference_two, work, multihost_runs.restore)
        assert diffs == [], "\n".join(diffs)

    def test_unreadable_latest_checkpoint_on_two(self, tmp_path, reference, reference_two):
        """Step 3's checkpoint loses the data process 1 wrote (so process 0 reads it and process
        1 cannot): both processes resume from step 2, process 0 alone moves step 3 aside, and the
        redone step 3 is the uninterrupted run's, bit for bit."""
        cfg, _ = reference
        work = _copy(reference_two, tmp_path / "w")
        step3 = work / checkpoint.CKPT_DIR / "3"
        written = sorted((step3 / "state" / "ocdbt.process_1" / "d").iterdir())
        assert written  # process 1's shards of the fsdp-sharded parameters
        for f in written:
            f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
        _ok(_run(cfg, work, processes=2, devices=1))
        assert _resumed_from(work, 2) == [2, 2]
        aside = work / checkpoint.CKPT_DIR / f"3{checkpoint.UNREADABLE_SUFFIX}"
        assert aside.is_dir() and (work / checkpoint.CKPT_DIR / "3").is_dir()
        logs = [(work / n).read_text() for n in ("train.log", "train.process1.log")]
        assert all("checkpoint step 3" in x and "is unreadable" in x for x in logs), logs
        diffs = crash_harness.differences(reference_two, work, multihost_runs.restore)
        assert diffs == [], "\n".join(diffs)

    def test_resume_one_to_two(self, tmp_path, reference):
        """A 1-process run stopped in step 3 resumes on 2 processes with the reference metrics.
        The stopped run is the reference as a kill in step 3's update leaves it (checkpoints,
        exports and metric rows of steps 1 and 2), not a second 1-process run killed there: the
        kill itself is the crash harness's and test_killed_process_then_resume_on_one's
        (issue 48: one 1-process training less, about 100 s under load)."""
        cfg, one = reference
        work = _copy(one, tmp_path / "w")
        shutil.rmtree(work / checkpoint.CKPT_DIR / "3")
        shutil.rmtree(work / "step_3")
        rows = (work / metrics.METRICS_FILE).read_text().splitlines(keepends=True)
        (work / metrics.METRICS_FILE).write_text("".join(rows[:2]))
        assert [r["step"] for r in _metrics(work)] == [1, 2]
        _ok(_run(cfg, work, processes=2, devices=1))  # 1 -> 2 processes, same checkpoint
        assert _resumed_from(work, 2) == [2, 2]
        _assert_same(_metrics(one), _metrics(work))

    def test_killed_coordinator_bounded_exit(self, tmp_path, reference):
        """Process 0 (which runs the coordinator) dies in step 2's update: process 1 stops within
        the bound, by PeerLostError or by JAX's own fatal error (its coordination service is
        gone); never a hang."""
        cfg, _ = reference
        procs = multihost_runs.launch(
            cfg,
            tmp_path / "w",
            processes=2,
            devices=1,
            per_process_env=[{faults.ENV: "train:2"}, {}],
        )
        procs[0].wait(timeout=900)
        died = time.monotonic()
        procs[1].wait(timeout=_PEER_EXIT_S)
        out1 = pathlib.Path(procs[1].out_path).read_text()
        assert procs[0].returncode == -9 and procs[1].returncode != 0
        assert time.monotonic() - died < _PEER_EXIT_S
        assert "PeerLostError" in out1 or "JAX distributed service detected fatal" in out1, out1
