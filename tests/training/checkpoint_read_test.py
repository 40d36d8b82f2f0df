"""Transient read errors are retried and never discard a checkpoint; corruption is moved aside;
the Orbax internals the restore relies on are where checkpoint_read.py expects them."""

import configparser
import errno
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from packaging import specifiers, version

from mmr_jax.training import checkpoint, checkpoint_read

REPO = pathlib.Path(__file__).resolve().parents[2]


def _state(scale=1.0):
    return {"w": scale * jnp.ones((3, 4)), "step": jnp.int32(0)}


def _abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def _saved(tmp_path, steps=(1, 2)):
    ck = checkpoint.Checkpointer(tmp_path / "ck", keep=None, async_save=False)
    for step in steps:
        ck.save(step, _state(step), {"step": step})
    ck.close()
    return tmp_path / "ck"


def _failing_reads(monkeypatch, step, errors):
    """Step `step`'s reads raise `errors` in turn (then read normally); -> the calls per step."""
    calls, real = {}, checkpoint.Checkpointer._restore_step
    pending = list(errors)

    def restore_step(self, s, abstract, args):
        calls[s] = calls.get(s, 0) + 1
        if s == step and pending:
            raise pending.pop(0)
        return real(self, s, abstract, args)

    monkeypatch.setattr(checkpoint.Checkpointer, "_restore_step", restore_step)
    return calls


class TestIsTransient:
    @pytest.mark.parametrize(
        "err",
        [
            OSError(errno.EIO, "Input/output error"),
            OSError(errno.ETIMEDOUT, "Connection timed out"),
            TimeoutError("read timed out"),
            ConnectionResetError("reset"),
            ValueError("Error reading \"x\": [os_error_code='5'] Input/output error"),
            ValueError("DEADLINE_EXCEEDED: GCS read"),
        ],
    )
    def test_transient(self, err):
        assert checkpoint_read.is_transient(err)

    @pytest.mark.parametrize(
        "err",
        [
            FileNotFoundError(errno.ENOENT, "no _METADATA"),
            ValueError("Found incomplete checkpoint at /x/3."),
            ValueError("Requested shape (5, 5) does not match (3, 4)"),
            KeyError("params"),
        ],
    )
    def test_corruption(self, err):
        assert not checkpoint_read.is_transient(err)

    def test_cause_chain(self):
        try:
            try:
                raise OSError(errno.EIO, "Input/output error")
            except OSError as e:
                raise ValueError("restore failed") from e
        except ValueError as outer:
            assert checkpoint_read.is_transient(outer)


class TestTransientRead:
    def test_retried_then_read(self, tmp_path, monkeypatch):
        ck_dir = _saved(tmp_path)
        calls = _failing_reads(
            monkeypatch, 2, [OSError(errno.EIO, "Input/output error"), TimeoutError("slow")]
        )
        ck = checkpoint.Checkpointer(ck_dir, keep=None, read_retry_s=(0.0, 0.0, 0.0))
        out, meta = ck.restore(_abstract(_state()))
        ck.close()
        assert meta == {"step": 2} and calls == {2: 3}  # two failures, the third read
        np.testing.assert_array_equal(out["w"], 2 * np.ones((3, 4)))
        assert sorted(p.name for p in ck_dir.iterdir()) == ["1", "2"]

    def test_persistent_is_a_named_error_and_nothing_moves(self, tmp_path, monkeypatch):
        ck_dir = _saved(tmp_path)
        calls = _failing_reads(monkeypatch, 2, [OSError(errno.EIO, "Input/output error")] * 9)
        ck = checkpoint.Checkpointer(ck_dir, keep=None, read_retry_s=(0.0, 0.0))
        with pytest.raises(checkpoint.CheckpointReadError, match="step 2 .* after 3 tries"):
            ck.restore(_abstract(_state()))
        ck.close()
        assert calls == {2: 3}  # step 1 never tried: the run does not fall back past step 2
        assert sorted(p.name for p in ck_dir.iterdir()) == ["1", "2"]

    def test_corruption_moved_aside_without_retry(self, tmp_path, monkeypatch):
        ck_dir = _saved(tmp_path)
        calls = _failing_reads(monkeypatch, 2, [ValueError("bad _METADATA")])
        ck = checkpoint.Checkpointer(ck_dir, keep=None, read_retry_s=(0.0, 0.0))
        _, meta = ck.restore(_abstract(_state()))
        ck.close()
        assert meta == {"step": 1} and calls == {2: 1, 1: 1}
        assert (ck_dir / f"2{checkpoint.UNREADABLE_SUFFIX}").is_dir()

    def test_default_waits_grow(self):
        waits = checkpoint.READ_RETRY_S
        assert len(waits) >= 2 and all(a < b for a, b in zip(waits, waits[1:], strict=False))


class TestOrbaxInternals:
    """What checkpoint_read.py relies on in orbax-checkpoint, beyond its public API."""

    @pytest.mark.parametrize("async_save", [True, False])
    def test_restore_barrier_key_and_processes(self, tmp_path, monkeypatch, async_save):
        """A process whose read failed joins the barrier that ends orbax's restore with the key
        and processes `join_restore_barrier` forms: orbax must use the same."""
        from orbax.checkpoint._src.multihost import multihost as orbax_multihost

        ck_dir = _saved(tmp_path, steps=(1,))
        seen, real = [], orbax_multihost.sync_global_processes

        def spy(name, **kw):
            seen.append((name, kw.get("processes")))
            return real(name, **kw)

        monkeypatch.setattr(orbax_multihost, "sync_global_processes", spy)
        ck = checkpoint.Checkpointer(ck_dir, keep=None, async_save=async_save)
        ck.restore(_abstract(_state()))
        ck.close()
        ours = checkpoint_read.restore_barrier_key(async_save)
        assert (ours, checkpoint_read.MULTIPROCESSING.active_processes) in seen, seen

    def test_barrier_function_names(self):
        """`in_barrier` recognises a failure inside orbax's barrier by its function's name."""
        from jax.experimental import multihost_utils

        names = checkpoint_read.ORBAX_BARRIER_FUNCTIONS
        assert ocp.multihost.sync_global_processes.__name__ in names
        assert multihost_utils.sync_global_devices.__name__ in names

    def test_installed_version_inside_pinned_range(self):
        cfg = configparser.ConfigParser()
        cfg.read(REPO / "setup.cfg")
        reqs = [r.strip() for r in cfg["options"]["install_requires"].splitlines() if r.strip()]
        (pin,) = [r for r in reqs if r.startswith("orbax-checkpoint")]
        spec = specifiers.SpecifierSet(pin[len("orbax-checkpoint") :])
        assert "<" in str(spec), f"{pin}: no upper bound on the tested range"
        assert version.Version(ocp.__version__) in spec, (pin, ocp.__version__)
