"""A failed checkpoint read: what it means, and how the processes stay in step after one.

`is_transient` tells a read worth retrying (an I/O error or timeout of the filesystem or bucket)
from a broken checkpoint (missing or bad metadata, a shape that does not fit); `agreed_outcome`
makes every process take the same decision for a step. `checkpoint.Checkpointer.restore` retries
the first and moves the second aside. `describe` is a failed read in a few words (the file and
what is wrong with it; TensorStore's error also dumps its specs), and `quiet_closed_loop` keeps
the reads a failure leaves in flight from printing a traceback each when they finish.

Orbax internals relied on (orbax-checkpoint 0.12, pinned in setup.cfg;
tests/training/checkpoint_read_test.py fails if one changes): the name of the barrier that ends
`Checkpointer.restore` (`ORBAX_RESTORE_BARRIER`), and that it runs inside
`orbax.checkpoint.multihost.sync_global_processes` (`in_barrier`). The barrier's prefix and
processes are the `MultiprocessingOptions` the checkpoint manager is given (`MULTIPROCESSING`,
public API).
"""

from __future__ import annotations

import errno
import re
import sys
import traceback

import numpy as np
import orbax.checkpoint as ocp
from absl import logging

from mmr_jax import distributed

# errno values of a read that may succeed when tried again (network filesystems, buckets).
TRANSIENT_ERRNOS = frozenset({
    errno.EIO, errno.ETIMEDOUT, errno.EAGAIN, errno.EINTR, errno.EBUSY, errno.ESTALE,
    errno.ECONNRESET, errno.ECONNABORTED, errno.ECONNREFUSED, errno.ENETUNREACH,
    errno.EHOSTUNREACH,
})  # fmt: skip
# tensorstore / gRPC status words of the same (their errors are ValueErrors with text).
_TRANSIENT_WORDS = ("DEADLINE_EXCEEDED", "UNAVAILABLE", "RESOURCE_EXHAUSTED")
# The barrier that ends orbax's `Checkpointer.restore` (orbax 0.12); a process whose read failed
# joins it (`join_restore_barrier`).
ORBAX_RESTORE_BARRIER = "Checkpointer:restore"
# The orbax barrier function a restore's barrier runs in (a peer died there, not a read failed).
ORBAX_BARRIER_FUNCTIONS = ("sync_global_devices", "sync_global_processes")
# The manager's multi-process options, given explicitly so that the restore barrier's key and
# processes are known without reading orbax's private attributes.
MULTIPROCESSING = ocp.options.MultiprocessingOptions(
    primary_host=0, active_processes=None, barrier_sync_key_prefix=None
)


def is_transient(err: BaseException) -> bool:
    """Whether `err` (or an error it was raised from) is a read that may succeed when retried:
    an OSError with a `TRANSIENT_ERRNOS` errno, a timeout or a connection error, or tensorstore's
    report of one. Anything else (missing or bad metadata, a file that does not deserialise, a
    shape that does not fit) means the checkpoint itself is broken."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, (TimeoutError, ConnectionError)):
            return True
        if isinstance(err, OSError) and err.errno in TRANSIENT_ERRNOS:
            return True
        text = str(err)
        m = re.search(r"os_error_code='(\d+)'", text)
        if (m and int(m.group(1)) in TRANSIENT_ERRNOS) or any(w in text for w in _TRANSIENT_WORDS):
            return True
        err = err.__cause__ or err.__context__
    return False


_READ, _BROKEN, _TRANSIENT = 0, 1, 2  # a process's outcome of reading a step


def agreed_outcome(err: BaseException | None) -> tuple[list[int], bool]:
    """(the processes whose read of a step failed, whether any of those failures was transient),
    from this process's `err` (None: read); the same on every process (a collective)."""
    mine = _READ if err is None else _TRANSIENT if is_transient(err) else _BROKEN
    outcomes = distributed.allgather(np.array([mine], np.int32))[:, 0]
    return np.flatnonzero(outcomes).tolist(), bool((outcomes == _TRANSIENT).any())


def restore_barrier_key(async_save: bool) -> str:
    """The key of the barrier that ends orbax's restore, as orbax 0.12 forms it: its
    AsyncCheckpointer (async_save) turns a None prefix into '' (key '_Checkpointer:restore')."""
    prefix = MULTIPROCESSING.barrier_sync_key_prefix
    if async_save and prefix is None:
        prefix = ""
    return ocp.multihost.unique_barrier_key(ORBAX_RESTORE_BARRIER, prefix=prefix)


def join_restore_barrier(async_save: bool) -> None:
    """Orbax's restore ends in a barrier where the processes that read the step wait; one whose
    read failed joins it (the same key, as orbax 0.12 forms it), so that every process runs the
    same collectives next."""
    ocp.multihost.sync_global_processes(
        restore_barrier_key(async_save), processes=MULTIPROCESSING.active_processes
    )


def in_barrier(err: BaseException) -> bool:
    """Whether `err` came out of a cross-process barrier (a peer died) rather than a read."""
    frames = traceback.extract_tb(err.__traceback__)
    return any(f.name in ORBAX_BARRIER_FUNCTIONS for f in frames)


_SPEC = re.compile(r" \[tensorstore_spec(?:\[\d+\])?='[^']*'\]")
_LOCAL_FILE = re.compile(r'local file "([^"]+)"')


def describe(err: BaseException, limit: int = 160) -> str:
    """A failed read in a few words: 'Requested byte range [0, 1093) is not valid for value of
    size 546 (file .../state/d/472a...)' for TensorStore's multi-kilobyte error; else the error's
    type and first line, cut to `limit` characters."""
    text = _SPEC.sub("", str(err)).strip()
    files = _LOCAL_FILE.findall(text)
    if files:
        return f"{text.rsplit(': ', 1)[-1][:limit]} (file {files[-1]})"
    first = text.splitlines()[0] if text else ""
    return f"{type(err).__name__}: {first[:limit]}"


_CLOSED_LOOP = "Event loop is closed"


def quiet_closed_loop() -> None:
    """After a failed read, orbax's event loop closes while TensorStore still completes the other
    reads of that step; each completion finds the loop closed and Python reports a 'RuntimeError:
    Event loop is closed' traceback on stderr (`sys.unraisablehook`), dozens of them, some before
    the failure reaches the caller. Installed before a restore (once), this sends those to the log
    file, one line each; other unraisable errors are reported as before."""
    previous = sys.unraisablehook
    if getattr(previous, "quiets_closed_loop", False):
        return

    def hook(unraisable):
        e = unraisable.exc_value
        if isinstance(e, RuntimeError) and str(e) == _CLOSED_LOOP:
            logging.info("a read of a failed checkpoint restore finished late: %s", e)
            return
        previous(unraisable)

    hook.quiets_closed_loop = True
    sys.unraisablehook = hook
