"""Start-up of JAX's multi-controller runtime, with the checks that fail before any step.

`initialize` takes explicit flags (coordinator address, process count and id) or `auto` (clusters
JAX detects: TPU pod slices, SLURM); a process id out of range, a partial set of flags and an
unreachable coordinator (a bounded wait) are named errors. Once every process runs,
`check_same_config` and `check_batch_split` refuse a run whose processes cannot train together.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import socket
import time
from collections.abc import Mapping

import jax
import numpy as np

from mmr_jax.distributed import collectives
from mmr_jax.distributed.errors import (
    BatchSplitError,
    ConfigMismatchError,
    CoordinatorUnreachableError,
    DistributedError,
    ProcessIdError,
)

MODES = ("off", "auto", "explicit")


@dataclasses.dataclass(frozen=True)
class Options:
    """Start-up of the multi-controller runtime (flags of scripts/train.py)."""

    mode: str = "off"  # 'off': one process; 'auto': JAX detects the cluster; 'explicit'
    coordinator_address: str | None = None  # HOST:PORT of process 0's coordinator
    num_processes: int | None = None
    process_id: int | None = None
    timeout_s: int = 120  # start-up: the coordinator must answer and every process register
    heartbeat_s: int = 30  # a process silent this long is taken as dead (JAX stops the others)


def options_from_flags(
    *,
    distributed: str,
    coordinator_address,
    num_processes,
    process_id,
    timeout_s: int = 120,
    heartbeat_s: int = 30,
) -> Options:
    """--distributed=auto|off, or explicit flags (all three or none); raises on a partial set."""
    given = [coordinator_address, num_processes, process_id]
    if distributed not in ("off", "auto"):
        raise ValueError(f"--distributed must be 'off' or 'auto', got {distributed!r}")
    if distributed == "auto":
        if any(v is not None for v in given):
            raise ValueError("--distributed=auto takes no --coordinator_address/--num_processes/"
                             "--process_id (JAX reads them from the cluster)")  # fmt: skip
        return Options(mode="auto", timeout_s=timeout_s, heartbeat_s=heartbeat_s)
    if all(v is None for v in given):
        return Options()
    if any(v is None for v in given):
        raise ValueError(
            "--coordinator_address, --num_processes and --process_id go together; got "
            f"{coordinator_address!r}, {num_processes!r}, {process_id!r}"
        )
    opts = Options(
        "explicit", coordinator_address, int(num_processes), int(process_id), timeout_s,
        heartbeat_s,
    )  # fmt: skip
    validate(opts)
    return opts


def define_flags() -> dict:
    """The start-up flags of a script (train.py, evaluate.py); `start(flags)` reads them."""
    from absl import flags

    return dict(
        distributed=flags.DEFINE_enum(
            "distributed", "off", ["off", "auto"], "auto: jax.distributed.initialize() finds "
            "the cluster (TPU pod slices, SLURM)."
        ),
        coordinator_address=flags.DEFINE_string(
            "coordinator_address", None, "HOST:PORT of process 0 (with --num_processes and "
            "--process_id): several processes train as one program."
        ),
        num_processes=flags.DEFINE_integer("num_processes", None, "Processes of the run."),
        process_id=flags.DEFINE_integer("process_id", None, "This process's id, 0 .. N-1."),
        timeout_s=flags.DEFINE_integer(
            "distributed_timeout_s", 120, "Start-up: seconds to wait for the coordinator and "
            "the other processes."
        ),
        heartbeat_s=flags.DEFINE_integer(
            "distributed_heartbeat_s", 30, "A process silent this long is taken as dead and "
            "JAX stops every process (raise it on hosts so loaded that a process stalls)."
        ),
    )  # fmt: skip


def start(flag_holders: dict) -> bool:
    """`initialize` from `define_flags()`'s flags; exits with the named error on bad input."""
    import sys

    try:
        opts = options_from_flags(**{k: v.value for k, v in flag_holders.items()})
        return initialize(opts)
    except (ValueError, DistributedError) as e:
        sys.exit(f"ERROR: {type(e).__name__}: {e}")


def validate(opts: Options) -> None:
    """Checks the explicit flags before anything starts."""
    if opts.mode != "explicit":
        return
    if opts.num_processes < 1:
        raise ProcessIdError(f"--num_processes must be >= 1, got {opts.num_processes}")
    if not 0 <= opts.process_id < opts.num_processes:
        raise ProcessIdError(
            f"--process_id={opts.process_id} is out of range for --num_processes="
            f"{opts.num_processes} (ids are 0 .. {opts.num_processes - 1})"
        )
    _split_address(opts.coordinator_address)


def _split_address(address: str) -> tuple[str, int]:
    host, sep, port = (address or "").rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"--coordinator_address must be HOST:PORT, got {address!r}")
    return host, int(port)


def wait_for_coordinator(address: str, timeout_s: float) -> float:
    """Seconds until `address` accepts a TCP connection; CoordinatorUnreachableError after
    `timeout_s`. (JAX itself aborts the process with a C++ fatal error when it cannot connect.)"""
    host, port = _split_address(address)
    t0 = time.monotonic()
    last = None
    while time.monotonic() - t0 < timeout_s:
        try:
            with socket.create_connection((host, port), timeout=min(2.0, timeout_s)):
                return time.monotonic() - t0
        except OSError as e:
            last = e
            time.sleep(0.25)
    raise CoordinatorUnreachableError(
        f"no coordinator at {address} after {timeout_s:.0f} s ({last}); start process 0 first, "
        "or check --coordinator_address (process 0's host and a free port) and the firewall"
    )


def initialize(opts: Options) -> bool:
    """Starts JAX's multi-controller runtime per `opts`; False (nothing done) in mode 'off'.

    Call before any other JAX operation. CPU processes exchange collectives over gloo.
    """
    if opts.mode == "off":
        return False
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # no effect on GPU / TPU
    if opts.mode == "auto":
        jax.distributed.initialize(
            initialization_timeout=opts.timeout_s, heartbeat_timeout_seconds=opts.heartbeat_s
        )
        return True
    validate(opts)
    if opts.process_id != 0:  # process 0 runs the coordinator; the others wait for it, bounded
        wait_for_coordinator(opts.coordinator_address, opts.timeout_s)
    jax.distributed.initialize(
        opts.coordinator_address,
        opts.num_processes,
        opts.process_id,
        initialization_timeout=opts.timeout_s,
        heartbeat_timeout_seconds=opts.heartbeat_s,
    )
    return True


def config_digest(config: Mapping) -> bytes:
    """SHA-256 of the config dict as canonical JSON."""
    text = json.dumps(config, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).digest()


def check_same_config(config: Mapping) -> None:
    """ConfigMismatchError unless every process holds the same config (compared by hash)."""
    if jax.process_count() == 1:
        return
    digests = collectives.allgather(np.frombuffer(config_digest(config), np.uint8))
    differ = [p for p in range(len(digests)) if not np.array_equal(digests[p], digests[0])]
    if differ:
        raise ConfigMismatchError(
            f"processes {differ} were started with a config other than process 0's (config "
            "hashes differ); every process must get the same --config and overrides"
        )


def check_batch_split(prompts: int, processes: int | None = None) -> None:
    """BatchSplitError unless `prompts` per step split evenly over the processes."""
    processes = jax.process_count() if processes is None else processes
    if prompts % processes:
        raise BatchSplitError(
            f"batch.prompts={prompts} does not split over {processes} processes; each process "
            f"samples whole groups, so use a multiple of {processes}"
        )
