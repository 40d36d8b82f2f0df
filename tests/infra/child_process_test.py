"""Children that die with their parent: in-process (`die_with_parent`) and across exec
(`exec_argv`, what the vLLM launcher uses), each with a parent we SIGKILL (no atexit, no finally).
"""

import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from mmr_jax.infra import child_process

REPO = pathlib.Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux"
)

# A parent that starts the command its argument evaluates to (in the parent: `exec_argv` names
# the pid of the process that calls it), prints the child's pid, then waits to be killed.
_PARENT = """
import subprocess, sys, time
from mmr_jax.infra import child_process
child = subprocess.Popen(eval(sys.argv[1]))
print(child.pid, flush=True)
time.sleep(300)
"""
_READY_THEN_SLEEP = "print('ready', flush=True); import time; time.sleep(300)"


def _alive(pid: int) -> bool:
    try:
        return pathlib.Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


def _outlives_its_killed_parent(child_argv_expr: str, wait_s: float = 20) -> bool:
    """Starts a parent that starts `eval(child_argv_expr)` (which prints 'ready' once its death
    signal is set), SIGKILLs the parent; whether the child is still there `wait_s` later."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    parent = subprocess.Popen(
        [sys.executable, "-c", _PARENT, child_argv_expr], stdout=subprocess.PIPE, env=env
    )
    child = int(parent.stdout.readline())
    assert parent.stdout.readline().strip() == b"ready" and _alive(child)
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + wait_s
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    if _alive(child):
        os.kill(child, signal.SIGKILL)
        return True
    return False


def test_in_process_child_dies_with_its_killed_parent():
    code = (
        "import os, signal\n"
        "from mmr_jax.infra import child_process\n"
        "child_process.die_with_parent(os.getppid(), signal.SIGKILL)\n" + _READY_THEN_SLEEP
    )
    assert not _outlives_its_killed_parent(repr([sys.executable, "-c", code]))


def test_exec_argv_child_dies_with_its_killed_parent():
    # The prelude sets the death signal, then execs the program, which prints 'ready'.
    expr = f"child_process.exec_argv([sys.executable, '-c', {_READY_THEN_SLEEP!r}])"
    assert not _outlives_its_killed_parent(expr)


def test_without_the_helper_a_child_outlives_its_killed_parent():
    # The control: what the two tests above would see if the helper did nothing.
    assert _outlives_its_killed_parent(repr([sys.executable, "-c", _READY_THEN_SLEEP]), 3)


def test_a_child_whose_parent_is_gone_already_exits_with_the_reason():
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "from mmr_jax.infra import child_process as c; c.die_with_parent(1, 9)",
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=60,
    )
    assert out.returncode == 1
    assert "parent process 1 exited before this child started" in out.stderr


def test_exec_argv_runs_the_program_with_its_arguments(tmp_path):
    argv = [sys.executable, "-c", "import sys; print(sys.argv[1:])", "a b", "c"]
    out = subprocess.run(child_process.exec_argv(argv), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "['a b', 'c']"
