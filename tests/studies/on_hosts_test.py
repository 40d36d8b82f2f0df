"""A study on several hosts (studies/on_hosts.py): local processes forming real JAX clusters.

The study processes form one cluster; each run's children form their own, one port up. The
runs' bodies here (tests/support/study_hosts_worker.py) gather over the run's cluster instead of
training; tests/studies/study_test.py::TestManyHosts trains a real study on 2 processes.
"""

import json
import os
import subprocess
import sys

import pytest

from mmr_jax import distributed
from mmr_jax.infra import metrics
from mmr_jax.studies import on_hosts, study

from support import multihost, testing
from support.tiny_study import overrides, strip_wall_clock, tiny_study

WORKER = multihost.REPO / "tests" / "support" / "study_hosts_worker.py"
RUNS = ("grpo_s1", "mmr_grpo_s1")


class TestOptions:
    def test_auto_and_in_process_refused_by_name(self):
        with pytest.raises(on_hosts.StudyClusterError, match="needs the address"):
            on_hosts.check_options(distributed.Options(mode="auto"), in_process=False)
        explicit = distributed.Options("explicit", "h0:1234", 2, 1)
        with pytest.raises(on_hosts.StudyClusterError, match="drop --in_process"):
            on_hosts.check_options(explicit, in_process=True)
        on_hosts.check_options(explicit, in_process=False)
        on_hosts.check_options(distributed.Options(), in_process=True)  # one process

    def test_each_run_one_port_up_same_processes(self):
        opts = distributed.Options("explicit", "10.0.0.7:8476", 4, 3, timeout_s=50)
        run = on_hosts.run_options(opts)
        assert run.coordinator_address == "10.0.0.7:8477"
        assert (run.num_processes, run.process_id, run.timeout_s) == (4, 3, 50)


def _launch(folders, body, *, lrs=(1e-3, 1e-3)):
    port = multihost.free_port(consecutive=2)
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
    cmds = [
        [sys.executable, str(WORKER), f"--folder={folder}", f"--body={body}",
         f"--coordinator_address=localhost:{port}", "--num_processes=2", f"--process_id={i}",
         f"--lr={lr}"]
        for i, (folder, lr) in enumerate(zip(folders, lrs, strict=True))
    ]  # fmt: skip
    return multihost.start_all(cmds, env)


def _ended(procs, timeout=240):
    """[(returncode, output, seconds to exit)] of the study processes."""
    return multihost.outputs(procs, timeout)


def _marker(folder, run):
    path = folder / run / study.RUN_FILE
    return json.loads(path.read_text())["status"] if path.exists() else None


@pytest.mark.slow
class TestStudyOnTwoProcesses:
    def test_each_run_is_one_cluster_and_a_rerun_skips_ended_runs(self, tmp_path):
        folder = tmp_path / "s"
        ended = _ended(_launch([folder, folder], "joins_cluster"))
        assert [code for code, _, _ in ended] == [0, 0], ended[0][1][-3000:] + ended[1][1][-3000:]
        for run in RUNS:  # each run: one cluster of 2 processes (a new one, the same port)
            seen = [json.loads((folder / run / f"process{i}.json").read_text()) for i in (0, 1)]
            assert [s["processes"] for s in seen] == [2, 2]
            assert [s["gathered"] for s in seen] == [[[0, 1], [10, 11]]] * 2
            assert _marker(folder, run) == "finished"
        pids = {json.loads((folder / r / "process0.json").read_text())["pid"] for r in RUNS}
        assert len(pids) == 2  # each run in a process of its own
        assert "report written by process 0" in ended[0][1]
        assert "report written" not in ended[1][1]
        for run in RUNS:
            for i in (0, 1):
                (folder / run / f"process{i}.json").unlink()
        again = _ended(_launch([folder, folder], "joins_cluster"))
        assert [code for code, _, _ in again] == [0, 0]
        assert not list(folder.glob("*/process*.json"))  # ended runs: trained by no process
        assert "report written by process 0" in again[0][1]

    def test_a_failure_on_one_process_stops_every_process_then_resumes(self, tmp_path):
        folder = tmp_path / "s"
        ended = _ended(_launch([folder, folder], "fails_on_process_1"))
        (code0, out0, _), (code1, out1, _) = ended
        assert code0 != 0 and code1 != 0
        cause = "RuntimeError: injected failure of process 1 in run mmr_grpo_s1"
        assert f"process 1 failed: {cause}" in out0  # process 0's run names process 1's error
        assert cause in out1.splitlines()[-1]
        assert "(study process 0)" in out0.splitlines()[-1]
        assert max(t for _, _, t in ended) < 120  # bounded: no exit barrier, no heartbeat wait
        assert _marker(folder, "grpo_s1") == "finished"
        assert _marker(folder, "mmr_grpo_s1") is None  # no marker for a failed run
        assert "report written" not in out0
        first = (folder / "grpo_s1" / "process0.json").read_text()
        again = _ended(_launch([folder, folder], "joins_cluster"))
        assert [code for code, _, _ in again] == [0, 0]
        assert (folder / "grpo_s1" / "process0.json").read_text() == first  # not trained again
        assert _marker(folder, "mmr_grpo_s1") == "finished"
        assert json.loads((folder / "mmr_grpo_s1" / "process1.json").read_text())["processes"] == 2

    def test_a_folder_not_shared_or_another_config_refused_on_every_process(self, tmp_path):
        ended = _ended(_launch([tmp_path / "a", tmp_path / "b"], "joins_cluster"))
        for code, out, _ in ended:
            assert code != 0 and "StudyFolderError: processes [1] see the study folder" in out
        assert not list(tmp_path.glob("*/*/process*.json"))  # no run started
        ended = _ended(_launch([tmp_path / "c"] * 2, "joins_cluster", lrs=(1e-3, 2e-3)))
        for code, out, _ in ended:
            assert code != 0 and "ConfigMismatchError: processes [1]" in out
        assert not (tmp_path / "c" / study.STUDY_FILE).exists()


@pytest.mark.slow
def test_scripts_study_on_two_processes_equals_one_process_on_two_devices(tmp_path, tiny_llama_dir):
    """scripts/study.py trains its run on both processes: the study equals one process's on as
    many devices (the N-processes contract, through the study). One run, MMR-GRPO, 2 steps:
    a run's cluster after another's on the same port is the tests above."""

    def cmd(folder, *flags):
        c = tiny_study(tiny_llama_dir, folder, total_steps=2)
        c.run, c.compare, c.baselines = ("mmr_grpo",), (), ()
        script = multihost.REPO / "scripts" / "study.py"
        config = multihost.REPO / "configs" / "study.py"
        return [sys.executable, str(script), f"--config={config}:pilot", *overrides(c), *flags]

    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=testing.XLA_CACHE_DIR)
    one = subprocess.run(
        cmd(tmp_path / "one"),
        env={**env, "XLA_FLAGS": "--xla_force_host_platform_device_count=2"},
        capture_output=True,
        text=True,
    )
    assert one.returncode == 0, one.stderr[-3000:]
    port = multihost.free_port(consecutive=2)
    cluster = [f"--coordinator_address=localhost:{port}", "--num_processes=2"]
    two = [cmd(tmp_path / "two", *cluster, f"--process_id={i}") for i in (0, 1)]
    one_device = {**env, "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
    ended = _ended(multihost.start_all(two, one_device), timeout=600)
    assert [code for code, _, _ in ended] == [0, 0], ended[0][1][-3000:] + ended[1][1][-3000:]
    a = json.loads((tmp_path / "one" / "study.json").read_text())
    b = json.loads((tmp_path / "two" / "study.json").read_text())
    assert [(r["name"], r["status"]) for r in b["runs"]] == [("mmr_grpo_s1", "finished")]
    assert [r["curve"]["steps"] for r in b["runs"]] == [[0, 1, 2]]
    assert strip_wall_clock(a) == strip_wall_clock(b)
    out0, out1 = ended[0][1], ended[1][1]
    assert "study: 1/1 runs done" in out0 and "| mmr_grpo |" in out0  # progress and report
    assert "runs done" not in out1 and "| mmr_grpo |" not in out1  # process 0 alone prints
    for folder, several in (("one", False), ("two", True)):  # gathers: only between processes
        rows = metrics.read_jsonl(tmp_path / folder / "mmr_grpo_s1" / metrics.METRICS_FILE)
        assert any("time/collectives" in r for r in rows) == several
    assert (tmp_path / "two" / "study.process1.log").exists()
