"""How a training run ends, finished or failing: the error it stops with, then its close.

`named_error` turns a failure of the loop into the error a person can act on (a full disk or
read-only workdir: `checkpoint.WorkdirWriteError` naming what was kept; a dead peer process:
`distributed.peer_lost`'s). `close` then joins the checkpoint write in flight (bounded by
`CLOSE_WAIT_S` when one process of several fails), and stops the metric writer, the rollout
prefetcher, the engine (a vLLM server the run launched) and a bucket workdir's mirror.
"""

from __future__ import annotations

import sys
import threading

import jax
from absl import logging

from mmr_jax import distributed
from mmr_jax.infra import run_paths
from mmr_jax.training import checkpoint

# A process of several that fails joins its checkpoint write in flight this long at most: its
# peers wait in a collective until it exits (`distributed.failures`).
CLOSE_WAIT_S = 60.0


def named_error(err: Exception, workdir, last_saved: int | None) -> Exception | None:
    """The error the run raises (from `err`) instead of `err`, or None to raise `err` itself."""
    if isinstance(err, checkpoint.WorkdirWriteError):  # named already
        return None
    if isinstance(err, OSError):
        if err.errno not in checkpoint.WRITE_ERRNOS:  # not the path's fault: a bug, raised as is
            return None
        kept = f"The last complete checkpoint (step {last_saved}) is intact. " if last_saved else ""
        return checkpoint.write_error(err, workdir, "the run's files", kept=kept)
    lost = distributed.peer_lost(err)  # a dead peer process: not the collective's own error
    return None if lost is None or lost is err else lost


def close(run) -> None:
    """Closes `run` (a `trainer.Run`): joins the checkpoint write in flight; when an error is
    already on its way, keeps that one.

    With several processes a failing one first announces its error to its peers
    (`distributed.announce`), and joins the write for at most `CLOSE_WAIT_S`; the caller then
    leaves without JAX's exit barrier (`distributed.exit_now`, scripts/train.py)."""
    error = sys.exc_info()[1]
    failing, several = error is not None, jax.process_count() > 1
    if failing and several and distributed.peer_lost(error) is None:
        distributed.announce(error)  # before anything that could wait for the peers
    try:
        if failing and several:
            close_bounded(run.checkpointer, CLOSE_WAIT_S)
        else:
            run.checkpointer.close()
    except Exception as e:  # a failed write: reported, the first error kept
        if not failing:
            raise
        logging.warning("closing the checkpointer after an error: %s", e)
    finally:
        run.writer.close()
        run.rollouts.close()  # before the engine: a rollout in flight is dropped
        if hasattr(run.engine, "close"):  # a vLLM server the run launched stops with it
            run.engine.close()
        run_paths.close(run.workdir)  # a bucket workdir gets its metrics and logs now


def close_bounded(ckpt: checkpoint.Checkpointer, seconds: float) -> None:
    """`ckpt.close()` in a thread joined for at most `seconds` (then abandoned: Orbax never takes
    an unfinished step's temporary folder for a checkpoint)."""
    errors = []

    def close():
        try:
            ckpt.close()
        except Exception as e:  # reported below, in this thread
            errors.append(e)

    thread = threading.Thread(target=close, name="checkpoint-close", daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        logging.warning("checkpoint write not finished after %.0f s; abandoned", seconds)
    elif errors:
        logging.warning("closing the checkpointer after an error: %s", errors[0])
