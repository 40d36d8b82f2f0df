"""A training run in a process of its own, which exits when the run ends (`train_in_child`).

A study trains each run this way (`study.run_study` with `scripts/study.py`): nothing one run
compiled or cached outlives it, and the persistent compilation cache turns the next run's
compiles into loads. On several hosts the child first joins the run's cluster (`on_hosts`).
Every wait is bounded, and every way a child can end (finished, diverged, raised, died, hung) is
a result or a named error in the parent.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import pathlib
import signal
import time
import traceback
from collections.abc import Callable

from mmr_jax.infra import child_process, console

log = logging.getLogger(__name__)


class RunProcessError(RuntimeError):
    """A run's own process died or failed; the study stops (rerun it to resume the run)."""


class RunProcessTimeoutError(RunProcessError):
    """A run's process outlived its time (`timeout_s`), or ended without a result and did not
    exit; it was killed."""


def _run_child(train_fn, cfg, workdir, log_file, verbose, cluster) -> tuple[str, str]:
    """The run in the child, its setup included: ('finished' | 'diverged', detail)."""
    if cluster is not None:  # the run's own cluster, before anything else touches JAX
        from mmr_jax import distributed

        distributed.initialize(cluster)
    if log_file is not None:  # on several hosts, process 0's child alone prints
        console.setup(log_file, verbose=verbose, stdout=cluster is None or cluster.process_id == 0)
    from mmr_jax.infra import compile_cache
    from mmr_jax.training import trainer

    compile_cache.enable()
    try:
        (train_fn or trainer.train)(cfg, workdir)
    except trainer.NonFiniteLossError as e:
        return "diverged", str(e)
    return "finished", ""


def _child_main(parent_pid, train_fn, cfg, workdir, log_file, verbose, cluster, send) -> None:
    # SIGKILL with the study: a killed study leaves no orphan run writing into its folder.
    child_process.die_with_parent(parent_pid, signal.SIGKILL)
    try:  # everything from here on, setup too, reports its traceback to the parent
        result = _run_child(train_fn, cfg, workdir, log_file, verbose, cluster)
    except BaseException as e:
        result = ("error", traceback.format_exc())
        if cluster is not None:  # as scripts/train.py: the peers learn why, first
            from mmr_jax import distributed

            if not isinstance(e, distributed.PeerLostError):  # its own error, not a peer's
                distributed.announce(e)
    send.send(result)
    if cluster is not None and result[0] == "error":
        # Without JAX's exit barrier, which would hold this process while its peers wait for it
        # in a collective.
        from mmr_jax import distributed

        distributed.exit_now(1, f"run {workdir} failed on process {cluster.process_id}")


def _receive(child, receive, workdir, timeout_s: float | None, poll_s: float):
    """The child's (kind, detail), or (None, '') when it ends without one. Polls, so that a pipe
    some grandchild still holds open cannot hang the study once the child is gone."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while not receive.poll(poll_s):
        if not child.is_alive() and not receive.poll(0):
            return None, ""
        if deadline is not None and time.monotonic() > deadline:
            _kill(child)
            raise RunProcessTimeoutError(
                f"run {workdir} did not end within timeout_s={timeout_s:g}s; its process "
                f"(pid {child.pid}) was killed (rerun the study to resume the run from its latest "
                "checkpoint)"
            )
    try:
        return receive.recv()
    except EOFError:  # the child closed its end (it exited) without a result
        return None, ""


def _kill(child) -> None:
    child.kill()
    child.join(timeout=30)


def train_in_child(
    cfg,
    workdir,
    *,
    train_fn: Callable | None = None,
    log_file=None,
    verbose: bool = False,
    timeout_s: float | None = None,
    exit_timeout_s: float = 120.0,
    poll_s: float = 1.0,
    cluster=None,
) -> None:
    """`trainer.train(cfg, workdir)` in a fresh (spawned) process, which exits when the run ends.

    Each run then starts from an empty JAX process: nothing a run compiled or cached outlives it
    (in one process a study grew to 16 GB by its sixth SmolLM2 run), and the persistent
    compilation cache turns the next run's compiles into loads. The child logs to `log_file` and
    the same stdout; it is killed with the study. A non-finite loss is re-raised here as
    `NonFiniteLossError` (the run is marked diverged); any other failure, its setup's included,
    or the child dying, as `RunProcessError` with the child's traceback or exit code.

    Every wait is bounded: the run by `timeout_s` (None: no limit; a run takes what it takes),
    the child's exit after its result by `exit_timeout_s` (then it is killed; a result it sent
    stands). Either kill without a result raises `RunProcessTimeoutError`.

    `train_fn` (default `trainer.train`) must be importable by name (spawn pickles it).
    `cluster` (`distributed.Options`): the child joins this cluster first, one process of a run
    on several hosts (`on_hosts`).
    """
    from mmr_jax.training import trainer

    ctx = multiprocessing.get_context("spawn")  # fork after JAX started threads can deadlock
    receive, send = ctx.Pipe(duplex=False)
    args = (os.getpid(), train_fn, cfg, str(workdir), log_file, verbose, cluster, send)
    child = ctx.Process(target=_child_main, args=args, name=f"run {pathlib.Path(workdir).name}")
    child.start()
    send.close()  # the child holds the only writer: the pipe reads EOF when it dies
    try:
        kind, detail = _receive(child, receive, workdir, timeout_s, poll_s)
    finally:
        receive.close()
    child.join(timeout=exit_timeout_s)
    if child.is_alive():
        _kill(child)
        if kind is None:
            raise RunProcessTimeoutError(
                f"the process of run {workdir} closed its pipe without a result and did not "
                f"exit within exit_timeout_s={exit_timeout_s:g}s; it was killed"
            )
        log.warning(
            "run %s: its process did not exit %gs after its result; killed", workdir, exit_timeout_s
        )
    if kind == "finished":
        return
    if kind == "diverged":
        raise trainer.NonFiniteLossError(detail)
    if kind == "error":
        raise RunProcessError(f"run {workdir} failed in its process:\n{detail}")
    raise RunProcessError(
        f"the process of run {workdir} died (exit code {child.exitcode}; -9 is SIGKILL, often "
        "the kernel's out-of-memory killer) without a result; rerun the study to resume the run "
        "from its latest checkpoint"
    )
