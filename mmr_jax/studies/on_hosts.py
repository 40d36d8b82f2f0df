"""A study on several hosts: `scripts/study.py` with the distributed flags, the same on every host.

Each run of the grid is one multi-process training. On every host the study starts the run in a
fresh child process (`own_process.train_in_child`, as on one host), and the children form the run's
own JAX cluster, whose coordinator is on process 0's host at the study's port + 1. One port
serves every run: the study processes gather each run's outcome before the next run starts, so
every process of a run has exited, on every host, before the next run's coordinator binds it.

The study processes themselves form a small CPU-only cluster on the study's port. They never
touch an accelerator (the runs' children hold those) and agree, through it, on:

  - the study config (`distributed.check_same_config`, `ConfigMismatchError`);
  - the study folder: process 0 checks or writes it, then every process must see what process 0
    wrote and the same ended runs (`StudyFolderError` otherwise: `study.folder` must be one
    folder that every host sees, a network filesystem or a bucket);
  - each run's outcome: process 0 writes the run's end marker once every process's child ended
    the run the same way (finished, or diverged). A run that fails anywhere stops its children
    on every host (the failed one announces its error, its peers stop with
    `distributed.PeerLostError` naming it), and then every study process, each with a named
    error; rerunning the same commands resumes the run from its latest checkpoint.

`--distributed=auto` is refused: a study needs the coordinator's address to place its runs'.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import logging
import sys
from collections.abc import Callable

import numpy as np

from mmr_jax import distributed
from mmr_jax.distributed.errors import DistributedError
from mmr_jax.studies import study
from mmr_jax.training import own_process

OUTCOMES = ("finished", "diverged", "failed")

log = logging.getLogger(__name__)


class StudyClusterError(DistributedError, ValueError):
    """Flags that a study on several hosts cannot run with."""


class StudyFolderError(DistributedError):
    """The study processes do not see one study folder (it is not shared between the hosts)."""


def check_options(opts: distributed.Options, *, in_process: bool) -> None:
    """Refuses what a study cannot do on several hosts, before anything starts."""
    if opts.mode == "auto":
        raise StudyClusterError(
            "--distributed=auto: a study places each run's cluster at the study's "
            "--coordinator_address port + 1, so it needs the address: give "
            "--coordinator_address, --num_processes and --process_id (on a TPU pod or SLURM: "
            "worker 0's host and a free port, the worker count and this worker's index)"
        )
    if opts.mode == "explicit" and in_process:
        raise StudyClusterError(
            "--in_process trains every run in the study's own process, which on several hosts "
            "holds the study's cluster; each run needs a cluster of its own: drop --in_process"
        )


def start(opts: distributed.Options) -> None:
    """Joins the study processes' cluster, on the CPU: this process never uses an accelerator
    (each run's child process takes them), and must not hold one's memory while they train."""
    import jax

    jax.config.update("jax_platforms", "cpu")  # this process only: a spawned child starts anew
    distributed.initialize(opts)


def run_options(opts: distributed.Options) -> distributed.Options:
    """The cluster of each run's child processes: the study's, one port up."""
    host, _, port = opts.coordinator_address.rpartition(":")
    return dataclasses.replace(opts, coordinator_address=f"{host}:{int(port) + 1}")


@contextlib.contextmanager
def _on_every_process():
    """Marks the errors of an agreement: every study process raises one at the same point (from
    the same gathered values), so they may leave through JAX's exit barrier, which then passes
    at once. Leaving without it, process 0 would take the coordinator down while the others
    are still printing their error, and JAX aborts them. A lost peer is not agreed on."""
    try:
        yield
    except Exception as e:
        if not isinstance(e, distributed.PeerLostError):
            e.on_every_process = True
        raise


@_on_every_process()
def check_folder(folder, stored: dict, check: Callable[[], None], view: Callable[[], dict]) -> None:
    """The processes hold one study config; process 0 `check`s (or writes) the study folder, and
    every process must then `view` it as process 0 does (`study.folder_view`): the config
    mismatch or `check`'s error on every process, `StudyFolderError` where a process sees
    another folder."""
    distributed.check_same_config(stored)
    distributed.primary_first(check, "checking the study folder")
    seen = view()
    text = json.dumps(seen, sort_keys=True)
    digest = np.frombuffer(hashlib.sha256(text.encode()).digest(), np.uint8)
    views = distributed.allgather(digest, timed=False)
    differ = [p for p in range(len(views)) if not np.array_equal(views[p], views[0])]
    if differ:
        here = "no study_config.json" if seen["config"] is None else "study_config.json"
        done = sorted(name for name, status in seen["ended"].items() if status)
        raise StudyFolderError(
            f"processes {differ} see the study folder {folder} other than process 0 does (this "
            f"process sees {here} and ended runs {done}): study.folder must be one folder that "
            "every host sees (a network filesystem or a gs:// bucket), not a local one per host"
        )


@_on_every_process()
def agree_outcome(name: str, outcome: str, error: Exception | None = None) -> None:
    """Waits until every study process's run `name` has ended (its child exited), and checks
    they ended it the same way (`OUTCOMES`). A run that failed on any process stops every study
    process: where it failed, with its own `error` (the run's traceback; a peer's child names
    the first failure), elsewhere with a `DistributedError` naming those processes."""
    codes = distributed.allgather(np.array([OUTCOMES.index(outcome)], np.int32), timed=False)
    outcomes = [OUTCOMES[int(c)] for c in codes[:, 0]]
    failed = [p for p, o in enumerate(outcomes) if o == "failed"]
    if failed:
        if error is not None:
            raise error
        raise DistributedError(
            f"run {name} failed on processes {failed}; see their study logs (rerun the same "
            "commands to resume it from its latest checkpoint)"
        )
    if len(set(outcomes)) > 1:
        raise DistributedError(
            f"run {name} ended differently on the study's processes ({outcomes}, in process "
            "order): a loss is the same on every process of a run, so one of them did not train "
            "the run the others did; see each process's study log"
        )


class Hosts:
    """What `study.run_study` asks of the study processes on several hosts (`start` first): their
    agreements, and who writes."""

    check_folder = staticmethod(check_folder)
    agree_outcome = staticmethod(agree_outcome)
    is_primary = staticmethod(distributed.is_primary)
    barrier = staticmethod(distributed.barrier)


def run(
    config,
    opts: distributed.Options,
    *,
    report: Callable[[], None],
    train_fn: Callable | None = None,
    log_file=None,
    verbose: bool = False,
    drop_checkpoints: bool = True,
) -> None:
    """This process's part of the study (`start` first): every run of the grid, each trained in a
    child that joins the run's cluster (`train_fn`, default `trainer.train`, in the child), then
    `report()` on process 0. An error of an agreement (config, folder, outcome) is raised on every
    process and ends each normally. Any other error ends this process at once, as
    scripts/train.py's do: its own error announced to the peers, and no JAX exit barrier (which
    would hold it while they wait in a collective); the peers then stop with `PeerLostError`."""
    failures = distributed.failures
    try:
        in_child = functools.partial(
            own_process.train_in_child,
            train_fn=train_fn,
            log_file=log_file,
            verbose=verbose,
            cluster=run_options(opts),
        )
        study.run_study(config, train_fn=in_child, drop_checkpoints=drop_checkpoints, hosts=Hosts())
        if opts.process_id == 0:
            report()
    except Exception as e:
        message = f"ERROR: {_summary(e)} (study process {opts.process_id})"
        if getattr(e, "on_every_process", False):  # every process stops here: a normal exit
            log.error("%s", message)
            sys.exit(message)
        code = failures.EXIT_PEER_LOST
        if not isinstance(e, distributed.PeerLostError):  # its own error: the peers learn it
            code = failures.EXIT_FAILED
            distributed.announce(e)
        log.exception("study process %d failed", opts.process_id)  # the whole traceback
        failures.exit_now(code, message)


def _summary(e: BaseException) -> str:
    """The error's type and first line, and a child's traceback cut to its last line (the
    child's error, which names a failed peer's)."""
    lines = [line for line in str(e).splitlines() if line.strip()]
    text = lines[0] if lines else ""
    if len(lines) > 1:
        text += " ... " + lines[-1]
    return f"{type(e).__name__}: {text}"
