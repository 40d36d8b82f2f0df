"""The end of a run: the named error a failure becomes, and the close that keeps the first error."""

import errno
import logging
import os
import threading
import time
import types

import pytest

from mmr_jax import distributed
from mmr_jax.training import checkpoint, rollout_schedule, shutdown


class TestNamedError:
    def test_full_disk_names_the_workdir_and_the_kept_step(self, tmp_path):
        err = shutdown.named_error(OSError(errno.ENOSPC, "No space left"), tmp_path, 4)
        assert isinstance(err, checkpoint.WorkdirWriteError) and err.errno == errno.ENOSPC
        assert str(err).startswith(
            f"cannot write the run's files to {tmp_path}: {os.strerror(errno.ENOSPC)}. "
        )
        assert "The last complete checkpoint (step 4) is intact." in str(err)

    def test_nothing_saved_yet_claims_no_checkpoint(self, tmp_path):
        err = shutdown.named_error(OSError(errno.EROFS, "Read-only"), tmp_path, None)
        assert isinstance(err, checkpoint.WorkdirWriteError) and err.errno == errno.EROFS
        assert str(err).startswith(
            f"cannot write the run's files to {tmp_path}: {os.strerror(errno.EROFS)}. Free space"
        )

    @pytest.mark.parametrize(
        "err",
        [
            checkpoint.WorkdirWriteError(errno.ENOSPC, "already named"),
            FileNotFoundError(errno.ENOENT, "a bug, not the disk"),
            ValueError("not an I/O error"),
            distributed.PeerLostError("already named"),
        ],
    )
    def test_raised_as_is(self, tmp_path, err):
        assert shutdown.named_error(err, tmp_path, 2) is None


class _Closable:
    def __init__(self, name, log, error=None):
        self.name, self.log, self.error = name, log, error

    def close(self):
        self.log.append(self.name)
        if self.error is not None:
            raise self.error


def _run(tmp_path, log, ckpt_error=None, prefetch=True, engine_closes=True):
    """A run's closable parts; without `prefetch`, the on-policy schedule (nothing to stop)."""
    on_policy = rollout_schedule.OnPolicyRollouts(lambda step, timings: None, dict)
    return types.SimpleNamespace(
        checkpointer=_Closable("checkpointer", log, ckpt_error),
        writer=_Closable("writer", log),
        rollouts=_Closable("prefetch", log) if prefetch else on_policy,
        engine=_Closable("engine", log) if engine_closes else object(),
        workdir=str(tmp_path),
    )


class TestClose:
    def test_closes_everything_in_order(self, tmp_path):
        log = []
        shutdown.close(_run(tmp_path, log))
        assert log == ["checkpointer", "writer", "prefetch", "engine"]

    def test_without_prefetch_or_closable_engine(self, tmp_path):
        log = []
        shutdown.close(_run(tmp_path, log, prefetch=False, engine_closes=False))
        assert log == ["checkpointer", "writer"]

    def test_failed_write_without_error_in_flight_is_raised(self, tmp_path):
        log = []
        with pytest.raises(OSError, match="write failed"):
            shutdown.close(_run(tmp_path, log, ckpt_error=OSError("write failed")))
        assert log == ["checkpointer", "writer", "prefetch", "engine"]

    def test_error_in_flight_is_kept_over_a_failed_write(self, tmp_path):
        log = []
        run = _run(tmp_path, log, ckpt_error=OSError("write failed"))
        with pytest.raises(RuntimeError, match="the first error"):
            try:
                raise RuntimeError("the first error")
            finally:
                shutdown.close(run)
        assert log == ["checkpointer", "writer", "prefetch", "engine"]


class TestCloseBounded:
    def test_a_hung_write_is_abandoned_after_the_bound(self, caplog):
        release = threading.Event()
        hung = types.SimpleNamespace(close=lambda: release.wait(30))
        caplog.set_level(logging.WARNING)
        t0 = time.perf_counter()
        shutdown.close_bounded(hung, 0.2)
        elapsed = time.perf_counter() - t0
        release.set()
        assert 0.2 <= elapsed < 5.0, elapsed
        assert "checkpoint write not finished after 0 s; abandoned" in caplog.text

    def test_a_failed_write_is_reported_not_raised(self, caplog):
        log = []
        caplog.set_level(logging.WARNING)
        shutdown.close_bounded(_Closable("checkpointer", log, OSError("write failed")), 5.0)
        assert log == ["checkpointer"]
        assert "closing the checkpointer after an error: write failed" in caplog.text
