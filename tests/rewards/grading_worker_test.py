"""A grading worker subprocess that dies while idle (killed, out of memory) is restarted before
the next batch instead of failing it with BrokenPipeError; one that cannot start is a named
error."""

import pytest

from mmr_jax.rewards import grading


def test_worker_killed_while_idle_is_restarted(caplog):
    grader = grading.Grader(workers=1, timeout_s=5)
    try:
        first = grader.grade([r"\boxed{4}"], ["4"])
        dead = grader._pool[0].proc
        dead.kill()
        dead.wait()
        with caplog.at_level("WARNING"):
            again = grader.grade([r"\boxed{4}", r"\boxed{5}"], ["4", "4"])
        assert [g.status for g in first] == [grading.CORRECT]
        assert [g.status for g in again] == [grading.CORRECT, grading.WRONG]
        assert grader._pool[0].proc is not dead and grader._pool[0].alive()
        assert "exited while idle" in caplog.text
    finally:
        grader.close()


def test_worker_dying_as_it_takes_a_row_is_restarted(monkeypatch):
    """The window between the liveness check and the write: the row goes to a fresh worker."""
    grader = grading.Grader(workers=1, timeout_s=5)
    try:
        grader.grade([r"\boxed{1}"], ["1"])
        worker = grader._pool[0]
        real_send = grading._Worker.send

        def send(self, completion, answer):
            if self is worker:  # dies exactly now
                self.proc.kill()
                self.proc.wait()
                raise BrokenPipeError(32, "Broken pipe")
            return real_send(self, completion, answer)

        monkeypatch.setattr(grading._Worker, "send", send)
        (grade,) = grader.grade([r"\boxed{7}"], ["7"])
        assert grade.status == grading.CORRECT and grader._pool[0] is not worker
    finally:
        grader.close()


def test_worker_that_cannot_start_is_a_named_error(monkeypatch):
    monkeypatch.setattr(grading.sys, "executable", "/bin/false")
    grader = grading.Grader(workers=1, timeout_s=5)
    with pytest.raises(grading.GradingWorkerError, match="did not start"):
        grader.grade(["x"], ["1"])


@pytest.mark.parametrize("text, expected", [("", None), ("3", 3), ("0", 0), (" 1 ", 1)])
def test_default_workers_from_the_environment(monkeypatch, text, expected):
    import os

    monkeypatch.setenv(grading.WORKERS_ENV, text)
    got = grading.default_workers()
    assert got == (max(1, min(2, os.cpu_count() or 1)) if expected is None else expected)


@pytest.mark.parametrize("text", ["-1", "two", "1.5"])
def test_default_workers_refuses_what_is_not_a_count(monkeypatch, text):
    monkeypatch.setenv(grading.WORKERS_ENV, text)
    with pytest.raises(ValueError, match=f"{grading.WORKERS_ENV}='{text}'"):
        grading.default_workers()
