"""`benchmarks/off_policy.py --engine=vllm`'s pieces (`benchmarks/pinned_server.py`): the server it
launches is the one the trainer would launch, pinned to its CPUs (`vllm_launch.LaunchOptions.cpus`:
`taskset -c`, one OpenMP thread per CPU), and the RSS of the server's process group. The whole
command against a launched server is in tests/training/off_policy_test.py."""

import os
import pathlib
import sys
import time

import pytest

from mmr_jax.infra import bench_harness
from mmr_jax.rollout import vllm_launch

REPO = pathlib.Path(__file__).resolve().parents[2]
bench = bench_harness.load("off_policy")
pinned_server = bench_harness.load("pinned_server")

# A server venv's interpreter that runs the launcher's `-c` prelude (the death signal, then exec
# of itself with the server's argv), then only sleeps: a process to pin, measure and stop.
_SLEEPING_PYTHON = """#!{python}
import sys, time
args = sys.argv[1:]
if args[0] == "-c":
    sys.argv = ["-c"] + args[2:]
    exec(args[1])
time.sleep(120)
"""


def _venv(root) -> pathlib.Path:
    venv = pathlib.Path(root) / "venv"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text(_SLEEPING_PYTHON.format(python=sys.executable))
    python.chmod(0o755)
    return venv


def _wait_asleep_as_the_server(pid: int, timeout_s: float = 30.0) -> None:
    """Until `pid` has made its last exec (taskset -> prelude -> the server's argv) and sleeps:
    only then is its resident size steady, so the group's sum can be compared with its own."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        argv = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
        if b"-m" in argv and b"-c" not in argv and stat[stat.rindex(")") + 2] == "S":
            return
        time.sleep(0.05)
    raise AssertionError(f"process {pid} never slept as the server: {argv}")


def test_cpu_count_of_taskset_lists():
    assert [vllm_launch.cpu_count(c) for c in ("0", "1", "0,2", "0-3,6", "2-3")] == [1, 1, 2, 5, 2]
    for bad in ("", "a", "0-", "1,,2"):
        with pytest.raises(ValueError, match="taskset -c"):
            vllm_launch.cpu_count(bad)


def test_server_options_are_those_the_trainer_launches_with_pinned(tmp_path):
    venv = _venv(tmp_path)
    sets = ["model.init=pretrained", f"rollout.server_venv={venv}", "seed=7"]
    opts = pinned_server.server_options("configs/cpu_smollm2.py", sets, "0", 1234)
    assert opts.served_model_name == "checkpoints/smollm2-135m-instruct"  # the trainer's name
    assert opts.model.endswith("checkpoints/smollm2-135m-instruct")
    assert opts.max_model_len == 64 + 32 and opts.lora_rank == 0 and opts.seed == 7
    assert (opts.port, opts.cpus, opts.python) == (1234, "0", str(venv / "bin" / "python"))
    _, env = vllm_launch.command(opts)
    if opts.backend == "cpu":
        assert env["OMP_NUM_THREADS"] == "1"  # one thread per CPU it is pinned to
    # A checkpoint named by an absolute path, LoRA on: served and loaded as that path.
    sets += [f"model.path={tmp_path}", "lora.enabled=True", "lora.rank=4"]
    opts = pinned_server.server_options("configs/cpu_smollm2.py", sets, "", 1234)
    assert opts.model == opts.served_model_name == str(tmp_path)
    assert opts.lora_rank == 4 and opts.cpus is None


def test_pinned_server_process_runs_on_its_cpus_and_its_group_rss_is_measured(tmp_path):
    mine = sorted(os.sched_getaffinity(0))
    if len(mine) < 2:
        pytest.skip("pinning is visible only with 2 or more CPUs")
    python = str(_venv(tmp_path) / "bin" / "python")
    opts = vllm_launch.LaunchOptions(model="m", python=python, port=vllm_launch.free_port())
    pinned = vllm_launch.ServerProcess(
        vllm_launch.LaunchOptions(**{**opts.__dict__, "cpus": str(mine[-1])}), tmp_path / "a.log"
    ).start()
    free = vllm_launch.ServerProcess(opts, tmp_path / "b.log").start()
    rss = None
    try:
        pid = pinned.proc.pid
        deadline = time.monotonic() + 30
        while os.sched_getaffinity(pid) != {mine[-1]} and time.monotonic() < deadline:
            time.sleep(0.1)  # taskset sets it before it execs the interpreter
        assert os.sched_getaffinity(pid) == {mine[-1]}
        assert os.sched_getaffinity(free.proc.pid) == set(mine)  # unpinned: the parent's
        _wait_asleep_as_the_server(pid)
        rss = pinned_server.GroupRss(pid, every_s=0.05)
        own = int(pathlib.Path(f"/proc/{pid}/statm").read_text().split()[1])
        assert rss.sample() >= own * os.sysconf("SC_PAGE_SIZE") > 0
        time.sleep(0.3)
        assert rss.peak > 0
        assert pinned_server.GroupRss(2**22 + 12345).sample() == 0  # no such group
    finally:
        if rss is not None:
            rss.stop()
        pinned.stop()
        free.stop()
    assert not pinned.alive() and not free.alive()


def test_benchmark_cpus_default_to_both_cores_embedded_and_one_beside_a_server(monkeypatch):
    seen = {}

    def run_modes(args):
        seen[args.engine] = args.cpus
        raise SystemExit(0)

    monkeypatch.setattr(bench, "run_modes", run_modes)
    for engine in ("embedded", "vllm"):
        with pytest.raises(SystemExit):
            bench.main([f"--engine={engine}"])
    assert seen == {"embedded": "0,1", "vllm": "1"}
