"""A run in its own process (training/own_process.py): each way a child ends, seen by the parent."""

import os
import pathlib
import re
import time

import pytest

from mmr_jax.training import own_process, trainer


# Run bodies for `train_in_child`: module level, so the spawned child can import them by name.
def _child_writes_pid(cfg, workdir):
    pathlib.Path(workdir).mkdir(parents=True, exist_ok=True)
    (pathlib.Path(workdir) / "pid").write_text(f"{os.getpid()} {os.getppid()} {cfg}")


def _child_diverges(cfg, workdir):
    raise trainer.NonFiniteLossError("step 3: non-finite loss nan")


def _child_raises(cfg, workdir):
    raise ValueError("bad row 17")


def _child_dies(cfg, workdir):
    os._exit(7)


def _child_sleeps(cfg, workdir):
    pathlib.Path(workdir).mkdir(parents=True, exist_ok=True)
    (pathlib.Path(workdir) / "pid").write_text(str(os.getpid()))
    time.sleep(120)


def _child_lingers(cfg, workdir):
    """Finishes, but a non-daemon thread keeps its process from exiting for a minute."""
    import threading

    _child_writes_pid(cfg, workdir)
    threading.Thread(target=time.sleep, args=(60,)).start()


def _gone(pid: int) -> bool:
    try:
        return pathlib.Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except FileNotFoundError:
        return True


class TestRunInChild:
    @pytest.mark.slow
    def test_outcomes_cross_the_process_boundary(self, tmp_path):
        own_process.train_in_child("cfg-x", tmp_path / "ok", train_fn=_child_writes_pid)
        child_pid, parent_pid, cfg = (tmp_path / "ok" / "pid").read_text().split()
        assert int(child_pid) != os.getpid() and int(parent_pid) == os.getpid()
        assert cfg == "cfg-x"
        with pytest.raises(trainer.NonFiniteLossError, match="step 3: non-finite loss nan"):
            own_process.train_in_child(None, tmp_path / "d", train_fn=_child_diverges)
        failed = r"(?s)failed in its process.*bad row 17"
        with pytest.raises(own_process.RunProcessError, match=failed):
            own_process.train_in_child(None, tmp_path / "e", train_fn=_child_raises)
        with pytest.raises(own_process.RunProcessError, match=r"died \(exit code 7"):
            own_process.train_in_child(None, tmp_path / "x", train_fn=_child_dies)

    @pytest.mark.slow
    def test_a_failure_in_the_childs_setup_reports_its_traceback(self, tmp_path):
        # console.setup cannot create the log file's folder: a file stands in its place.
        (tmp_path / "taken").write_text("")
        log_file = tmp_path / "taken" / "run.log"
        match = r"(?s)failed in its process.*Traceback.*console.py.*(FileExistsError|NotADirectory)"
        with pytest.raises(own_process.RunProcessError, match=match):
            own_process.train_in_child(
                None, tmp_path / "r", train_fn=_child_raises, log_file=log_file
            )

    def test_a_run_past_its_timeout_is_killed_with_a_named_error(self, tmp_path):
        start = time.monotonic()
        with pytest.raises(
            own_process.RunProcessTimeoutError, match=r"did not end within timeout_s=3s"
        ) as caught:
            own_process.train_in_child(
                None, tmp_path / "s", train_fn=_child_sleeps, timeout_s=3, poll_s=0.1
            )
        assert time.monotonic() - start < 30
        # The pid from the error, not from the child's pid file: on a loaded machine the spawned
        # child may still be importing when the 3 s run out, before it writes its file.
        assert _gone(int(re.search(r"\(pid (\d+)\)", str(caught.value)).group(1)))

    def test_a_child_that_does_not_exit_after_its_result_is_killed(self, tmp_path):
        start = time.monotonic()
        own_process.train_in_child(
            "c", tmp_path / "l", train_fn=_child_lingers, exit_timeout_s=1, poll_s=0.1
        )  # the run finished: its result stands
        assert time.monotonic() - start < 30
        assert _gone(int((tmp_path / "l" / "pid").read_text().split()[0]))
