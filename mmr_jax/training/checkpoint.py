"""Checkpoints of a training run: Orbax for arrays, JSON for host state.

Layout of a workdir:

    <workdir>/run.json            the config of the run (`workdir_guard`: refuses another config's)
    <workdir>/checkpoints/<step>/state   params (or LoRA adapters), optimiser state, RNG key data
    <workdir>/checkpoints/<step>/meta    JSON: step, data-iterator position, anything host-side

The workdir may be a bucket (`gs://...`): every path is an `epath.Path` (`run_paths`), which Orbax
takes natively. Orbax writes each step into a temporary folder and renames it when complete (on a
bucket: writes it in place and marks it complete with a commit file), so a process killed
mid-save leaves the previous checkpoints intact; only the last `keep` are kept. A step folder that
fails to restore (truncated or missing files) is moved aside to `<step>.unreadable` and the one
before it is restored; with several processes a step is taken only when every process read it,
and process 0 alone moves one aside. A transient read error (an I/O error or timeout of the
filesystem or bucket, `checkpoint_read.is_transient`) is retried with backoff, and if it persists
stops the run with `CheckpointReadError`: the step is not moved aside and the metrics are not cut
back to an older one (`checkpoint_read` also holds the Orbax internals a failed read relies on).
A write that fails (full disk, read-only folder) raises `WorkdirWriteError` naming the path; what
was already saved is left as it was. The HF exports of a run are `hf_export`'s.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import time
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging

from mmr_jax import distributed
from mmr_jax.infra import run_paths, user_errors
from mmr_jax.training import checkpoint_read, checkpoint_unstacked

CKPT_DIR = "checkpoints"


class WorkdirWriteError(OSError):
    """A file of the run could not be written (full disk, read-only or missing folder)."""

    def __str__(self) -> str:
        return str(self.strerror)


class CheckpointRestoreError(user_errors.UserError, RuntimeError):
    """No checkpoint of the run could be restored (told in one line, the details in the log)."""


class NoCheckpointError(user_errors.UserError, FileNotFoundError):
    """The workdir holds no checkpoint (of the step asked for)."""


class CheckpointReadError(CheckpointRestoreError):
    """A checkpoint could not be read for a transient reason (I/O error, timeout), even after
    retries; it was left in place."""


# errno values that mean "this path cannot take the write", as opposed to a bug.
WRITE_ERRNOS = frozenset({errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EPERM, errno.EDQUOT})
UNREADABLE_SUFFIX = ".unreadable"
READ_RETRY_S = (1.0, 4.0, 16.0)  # waits before each retry of a transient read error


def write_error(err: BaseException, path, what: str, *, kept: str = "") -> WorkdirWriteError:
    """A `WorkdirWriteError` that names `path` (or the file the error names) and what was kept."""
    code, where = getattr(err, "errno", None), getattr(err, "filename", None)
    if not isinstance(err, OSError):  # tensorstore: '... "<file>": ... [os_error_code='28']'
        m = re.search(r"os_error_code='(\d+)'", str(err))
        code = int(m.group(1)) if m else None
        m = re.search(r'Failed writing: "([^"]+)"', str(err))
        where = m.group(1) if m else None
    reason = os.strerror(code) if code else str(err)
    return WorkdirWriteError(
        code or errno.EIO,
        f"cannot write {what} to {where or path}: {reason}. {kept}"
        "Free space or make the folder writable, then re-run the same command to resume.",
    )


def saved_steps(workdir) -> list[int]:
    """The steps of `<workdir>/checkpoints/<N>` folders, read without opening Orbax (nothing is
    created). Orbax names a step being written `<N>.orbax-checkpoint-tmp-*`, and one moved aside
    is `<N>.unreadable`: neither counts. (On a bucket, a step is written in place: a half-written
    one counts too.)"""
    folder = run_paths.as_path(workdir) / CKPT_DIR
    if not folder.is_dir():
        return []
    return sorted(int(p.name) for p in folder.iterdir() if re.fullmatch(r"\d+", p.name))


def require_checkpoint(workdir, step: int | None = None) -> None:
    """Raises `NoCheckpointError` unless `workdir` holds a checkpoint (`step` when given), before
    anything is written there (scripts/train.py --export_hf)."""
    steps = saved_steps(workdir)
    if step is None and steps:
        return
    if step is not None and step in steps:
        return
    if not steps:
        raise NoCheckpointError(
            f"no checkpoint in {workdir} (no {CKPT_DIR}/<step> folder): give the --workdir of a "
            "run that saved one (its checkpoint.every steps)"
        )
    raise NoCheckpointError(f"{workdir} has no checkpoint of step {step}; it has steps {steps}")


def state_tree(state) -> dict:
    """The tree a `train_step.TrainState` is saved as (`<step>/state`); of a freshly built state,
    also the abstract state `Checkpointer.restore` takes."""
    tree = {
        "step": state.step,
        "params": state.params,
        "opt_state": state.opt_state,
        "rng": state.rng,
    }
    if state.entropy_coef is not None:  # adaptive entropy only: older checkpoints lack it
        tree["entropy_coef"] = state.entropy_coef
    return tree


class Checkpointer:
    """Save / restore of (array pytree, JSON dict) pairs by step, the last `keep` kept.

    Args:
      directory: folder of step subfolders (created).
      keep: number of most recent checkpoints kept (None = all).
      keep_period: also keep steps divisible by this (0 = off).
      async_save: write in a background thread; `wait()` or the next save joins it.
      read_retry_s: waits before each retry of a transient read error (default `READ_RETRY_S`).
    """

    def __init__(
        self,
        directory,
        *,
        keep: int | None = 3,
        keep_period: int = 0,
        async_save=True,
        read_retry_s: tuple[float, ...] | None = None,
    ):
        self.directory = run_paths.as_path(directory, absolute=True)  # or a bucket
        self.read_retry_s = tuple(READ_RETRY_S if read_retry_s is None else read_retry_s)
        self.async_save = bool(async_save)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep or None,
            keep_period=keep_period or None,
            create=True,
            enable_async_checkpointing=async_save,
            multiprocessing_options=checkpoint_read.MULTIPROCESSING,
        )
        self._saving = None  # step of the write in flight, for error messages
        with self._writing():
            self._manager = ocp.CheckpointManager(self.directory, options=options)

    def save(self, step: int, state: Any, meta: Mapping[str, Any]) -> bool:
        """Saves `state` (a pytree of arrays) and `meta` (JSON-able) at `step`."""
        args = ocp.args.Composite(
            state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(dict(meta))
        )
        self.wait()  # a failed previous write is reported as that step's, not this one's
        self._saving = int(step)
        with self._writing():
            saved = self._manager.save(int(step), args=args, force=True)
        if saved:
            logging.info("checkpoint: saving step %d to %s", step, self.directory)
        return saved

    def _writing(self):
        """Turns a failed (possibly asynchronous) write into a `WorkdirWriteError`."""
        return _WriteGuard(self)

    def restore(self, abstract_state: Any, step: int | None = None) -> tuple[Any, dict] | None:
        """(state, meta) at `step` (default: latest), or None when there is no checkpoint.

        `abstract_state` is a pytree of `jax.ShapeDtypeStruct` (with shardings) or arrays
        that fixes the structure, dtypes and placement of the result.
        """
        abstract = jax.tree.map(_abstract, abstract_state)
        args = ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()
        )
        if step is not None:
            out = self._restore_step(int(step), abstract, args)
            return out["state"], dict(out["meta"])
        unreadable = []  # newest first: (step, error)
        for candidate in reversed(self._steps_everywhere()):
            out, err = self._attempt_with_retries(candidate, abstract, args)
            if err is not None:
                unreadable.append((candidate, err))
                continue
            for bad, err in unreadable:  # a later step read fine, so these are broken, not us
                self._move_aside(bad, err)
            return out["state"], dict(out["meta"])
        if unreadable:  # nothing restores: a config or code problem, not a torn write
            bad, err = unreadable[0]
            logging.info("checkpoint step %d could not be restored: %s", bad, err)
            raise CheckpointRestoreError(
                f"no checkpoint in {self.directory} could be restored (tried steps "
                f"{[s for s, _ in unreadable]}; step {bad}: {checkpoint_read.describe(err)}); "
                "nothing was moved or changed. If they were written by another config or code "
                "version, use another --workdir (or --overwrite to delete them); the full error "
                "is in the run's log"
            ) from err
        return None

    def _steps_everywhere(self) -> list[int]:
        """`all_steps()`, the same on every process (they must try the same steps in turn)."""
        steps = self.all_steps()
        digest = np.frombuffer(hashlib.sha256(json.dumps(steps).encode()).digest(), np.uint8)
        if len({bytes(d) for d in distributed.allgather(digest)}) > 1:
            raise CheckpointRestoreError(
                f"the processes see different checkpoints in {self.directory} (this one: "
                f"{steps}); the workdir must be one filesystem that every host shares"
            )
        return steps

    def _attempt_with_retries(self, step: int, abstract, args):
        """(restored, None) or (None, error) for `step`, agreed by every process; a transient
        error on any process is retried by all (`read_retry_s`), and raised as
        `CheckpointReadError` when it persists (nothing moved aside)."""
        for attempt in range(len(self.read_retry_s) + 1):
            out, err = self._attempt(step, abstract, args)
            failed, transient = checkpoint_read.agreed_outcome(err)
            if err is None and failed:  # a step some other process cannot read
                err = CheckpointRestoreError(
                    f"step {step} is unreadable on process(es) {failed} (their logs say why)"
                )
            if err is None or not transient:
                return out, err
            if attempt == len(self.read_retry_s):
                raise CheckpointReadError(
                    f"checkpoint step {step} in {self.directory} could not be read after "
                    f"{attempt + 1} tries ({checkpoint_read.describe(err, 300)}); it looks "
                    "transient (I/O error or timeout), so it was left in place. Re-run when the "
                    "storage answers again: the run resumes from it."
                ) from err
            wait = self.read_retry_s[attempt]
            logging.warning(
                "checkpoint step %d: transient read error (%s); retry %d in %.1f s",
                step,
                checkpoint_read.describe(err),
                attempt + 1,
                wait,
            )
            time.sleep(wait)
        raise AssertionError("unreachable")

    def _attempt(self, step: int, abstract, args) -> tuple[Any, BaseException | None]:
        """(restored, None) or (None, error) for `step` on this process."""
        checkpoint_read.quiet_closed_loop()  # a failed read's others finish after it: no tracebacks
        try:
            return self._restore_step(step, abstract, args), None
        except Exception as e:  # any failure to read: the caller tries the one before
            if jax.process_count() > 1 and not checkpoint_read.in_barrier(e):
                checkpoint_read.join_restore_barrier(self.async_save)
            return None, e

    def _restore_step(self, step: int, abstract, args):
        # Written before the decoder's layers were stacked: stacked while restoring.
        if checkpoint_unstacked.has_unstacked_layers(self.directory / str(step)):
            logging.info("checkpoint step %d has per-layer parameters: stacking them", step)
            return checkpoint_unstacked.restore(self._manager, step, abstract)
        return self._manager.restore(step, args=args)

    def _move_aside(self, step: int, err: BaseException) -> None:
        """Moves unreadable `step` to `<step>.unreadable`: process 0 alone (a shared folder), the
        others waiting for it; then every process forgets the step."""
        src = self.directory / str(step)
        dst = src.with_name(f"{step}{UNREADABLE_SUFFIX}")

        def move():
            if dst.exists():
                dst.rmtree()
            src.rename(dst)  # kept, not deleted: a person may want to look at it

        distributed.primary_first(move, f"to move checkpoint step {step} aside")
        logging.info("checkpoint step %d: %s", step, err)  # the full error: the log file only
        logging.warning(
            "checkpoint step %d is unreadable (%s); moved to %s, resuming from the one before it",
            step,
            checkpoint_read.describe(err),
            dst,
        )
        self._manager.reload()

    def restore_meta(self, step: int | None = None) -> dict | None:
        """Only the JSON part of a checkpoint."""
        step = self.latest_step() if step is None else step
        if step is None:
            return None
        out = self._manager.restore(int(step), args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        return dict(out["meta"])

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def wait(self) -> None:
        with self._writing():
            self._manager.wait_until_finished()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._manager.close()


class _WriteGuard:
    """Context of `Checkpointer._writing`."""

    def __init__(self, ckpt: Checkpointer):
        self.ckpt = ckpt

    def __enter__(self):
        return self

    def __exit__(self, kind, err, tb):
        if err is None or not _is_write_failure(err):
            return False
        saving = self.ckpt._saving
        manager = getattr(self.ckpt, "_manager", None)
        kept = [s for s in manager.all_steps() if s != saving] if manager is not None else []
        raise write_error(
            err,
            self.ckpt.directory,
            "checkpoints" if saving is None else f"checkpoint step {saving}",
            kept=f"Complete checkpoints {kept} in {self.ckpt.directory} are intact. ",
        ) from err


def _is_write_failure(err: BaseException) -> bool:
    # Orbax's tensorstore writes report the OS error in the message of a ValueError.
    if isinstance(err, OSError):
        return err.errno in WRITE_ERRNOS
    text = str(err)
    return any(f"os_error_code='{code}'" in text for code in WRITE_ERRNOS) or any(
        os.strerror(code) in text for code in WRITE_ERRNOS
    )


def _abstract(x):
    if isinstance(x, jax.ShapeDtypeStruct):
        return x
    sharding = getattr(x, "sharding", None)
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
