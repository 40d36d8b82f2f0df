"""Many hosts, one program: JAX's multi-controller runtime (DESIGN.md, "Many hosts").

Every process runs the same code on one global mesh (`jax.devices()` spans all processes once
`initialize` has run). What is per process lives here, at one place:

  - start-up: `initialize` (explicit coordinator / count / id, or `auto` on clusters JAX detects),
    with the checks that must fail before any step: a process id out of range, an unreachable
    coordinator (bounded wait), configs that differ across processes (`check_same_config`), a
    batch that does not split over the processes (`check_batch_split`);
  - the process's share of a batch of prompts (`share`: contiguous, so a group never spans two
    processes), sampled by its own engine (`ShareEngine`) and gathered, so that every process holds
    the step's B groups as one process would, and builds the same global batch;
  - process-local copies of global arrays (`local_copy`: the rollout engine and HF exports need
    whole weights in one process), and metrics reduced over processes (`reduce_metrics`).

On CPU, local processes with a localhost coordinator and gloo collectives are a real cluster
(tests/multihost_test.py). Everything here is a no-op with one process.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import socket
import time
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from flax import nnx

from mmr_jax.rollout import base as rollout_base

MODES = ("off", "auto", "explicit")


class DistributedError(RuntimeError):
    """A multi-process run cannot start or go on."""


class ProcessIdError(DistributedError, ValueError):
    """--process_id is not in [0, --num_processes)."""


class CoordinatorUnreachableError(DistributedError):
    """No coordinator answered at --coordinator_address within the start-up timeout."""


class ConfigMismatchError(DistributedError):
    """The processes of one run were started with different configs."""


class BatchSplitError(DistributedError, ValueError):
    """The batch's prompts do not split evenly over the processes."""


class PeerLostError(DistributedError):
    """Another process of the run died (its collectives failed); this one stops too."""


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
    *, distributed: str, coordinator_address, num_processes, process_id, timeout_s: int = 120
) -> Options:
    """--distributed=auto|off, or explicit flags (all three or none); raises on a partial set."""
    given = [coordinator_address, num_processes, process_id]
    if distributed not in ("off", "auto"):
        raise ValueError(f"--distributed must be 'off' or 'auto', got {distributed!r}")
    if distributed == "auto":
        if any(v is not None for v in given):
            raise ValueError("--distributed=auto takes no --coordinator_address/--num_processes/"
                             "--process_id (JAX reads them from the cluster)")  # fmt: skip
        return Options(mode="auto", timeout_s=timeout_s)
    if all(v is None for v in given):
        return Options()
    if any(v is None for v in given):
        raise ValueError(
            "--coordinator_address, --num_processes and --process_id go together; got "
            f"{coordinator_address!r}, {num_processes!r}, {process_id!r}"
        )
    opts = Options("explicit", coordinator_address, int(num_processes), int(process_id), timeout_s)
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
        jax.distributed.initialize(initialization_timeout=opts.timeout_s)
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


def is_primary() -> bool:
    """Process 0 alone writes the console, metrics, TensorBoard and exports."""
    return jax.process_index() == 0


_COLLECTIVE_S = [0.0]  # host-side cross-process collectives since the last `collective_seconds`


def collective_seconds() -> float:
    """Seconds this process spent in host-side collectives (gathers, weight copies) since the
    last call; the train step's own collectives run inside its jit and are not counted."""
    spent, _COLLECTIVE_S[0] = _COLLECTIVE_S[0], 0.0
    return spent


def allgather(x: np.ndarray, *, timed: bool = True) -> np.ndarray:
    """[P, ...]: `x` (same shape and dtype on every process) of every process, in process order.

    `timed`: count the call in `collective_seconds` (a gather queued behind a train step in flight
    waits for it: not collective time)."""
    if jax.process_count() == 1:
        return np.asarray(x)[None]
    from jax.experimental import multihost_utils

    t0 = time.perf_counter()
    try:
        return np.asarray(multihost_utils.process_allgather(np.asarray(x), tiled=False))
    except Exception as e:  # a dead peer closes its gloo connections: a named error, not a hang
        raise _peer_error(e) from e
    finally:
        _COLLECTIVE_S[0] += (time.perf_counter() - t0) if timed else 0.0


_LOST_PEER = ("Gloo", "Connection closed", "Connection reset", "heartbeat", "Barrier failed")


def peer_lost(e: BaseException) -> PeerLostError | None:
    """A `PeerLostError` for an error raised by a collective whose peer process died, else None."""
    if isinstance(e, PeerLostError):
        return e
    text = str(e)
    if jax.process_count() == 1 or not any(s in text for s in _LOST_PEER):
        return None
    return PeerLostError(
        f"process {jax.process_index()}: a collective with the other processes failed "
        f"({text[:300]}); another process of the run has most likely died. Stop every "
        "process and re-run the same command: the run resumes from its last checkpoint."
    )


def _peer_error(e: Exception) -> Exception:
    return peer_lost(e) or e


def primary_value(value: bool) -> bool:
    """Process 0's `value` on every process (a decision about shared files, taken once)."""
    return bool(allgather(np.array([int(value)], np.int32))[0, 0])


def primary_first(fn, what: str):
    """Runs `fn` on process 0 alone (shared files); the others wait, and fail with a named error
    when it failed. Returns `fn()` on process 0, None elsewhere."""
    if jax.process_count() == 1:
        return fn()
    result, error = None, None
    if is_primary():
        try:
            result = fn()
        except Exception as e:  # the others learn of it below; process 0 raises its own
            error = e
    if not primary_value(error is None):
        if error is not None:
            raise error
        raise DistributedError(f"process 0 failed {what}; its log says why")
    return result


def config_digest(config: Mapping) -> bytes:
    """SHA-256 of the config dict as canonical JSON."""
    text = json.dumps(config, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).digest()


def check_same_config(config: Mapping) -> None:
    """ConfigMismatchError unless every process holds the same config (compared by hash)."""
    if jax.process_count() == 1:
        return
    digests = allgather(np.frombuffer(config_digest(config), np.uint8))
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


def share(num: int, processes: int, index: int) -> slice:
    """The contiguous items of process `index` among `num` (sizes differ by at most one)."""
    if not 0 <= index < processes:
        raise ProcessIdError(f"process {index} out of range for {processes} processes")
    base, extra = divmod(num, processes)
    start = index * base + min(index, extra)
    return slice(start, start + base + (index < extra))


# ----- rollouts per process --------------------------------------------------------------------


def gather_rollouts(
    local: rollout_base.RolloutBatch | None, *, sizes: Sequence[int], n: int, max_len: int
) -> rollout_base.RolloutBatch:
    """The `RolloutBatch` of every process's share, concatenated in process order.

    `sizes[p]`: the prompt count of process p (known to all: `share`); `local` is None where it is
    0. Every share is padded to the largest count and `max_len` tokens and packed into one int32
    array, so each step gathers once, always in the same shape (a new shape would compile anew).
    """
    bmax = max(sizes)
    packed = np.zeros((bmax, n, 3 * max_len + 1), np.int32)  # tokens | mask | logps | 'length'
    if local is not None:
        b, _, t = local.tokens.shape
        packed[:b, :, :t] = local.tokens
        packed[:b, :, max_len : max_len + t] = local.mask
        packed[:b, :, 2 * max_len : 2 * max_len + t] = local.logprobs.view(np.int32)
        packed[:b, :, -1] = np.asarray(local.finish_reasons) == rollout_base.FINISH_LENGTH
    gathered = allgather(packed)  # [P, bmax, n, 3 * max_len + 1]
    rows = np.concatenate([gathered[p, :size] for p, size in enumerate(sizes)], axis=0)
    mask = rows[..., max_len : 2 * max_len].astype(bool)
    t = int(max(1, mask.sum(-1).max(initial=1)))  # the longest completion, as one engine gives
    logps = np.ascontiguousarray(rows[..., 2 * max_len : 3 * max_len]).view(np.float32)
    finish = np.where(rows[..., -1] == 1, rollout_base.FINISH_LENGTH, rollout_base.FINISH_STOP)
    return rollout_base.RolloutBatch(
        tokens=np.ascontiguousarray(rows[..., :t]),
        mask=np.ascontiguousarray(mask[..., :t]),
        logprobs=np.ascontiguousarray(logps[..., :t]),
        finish_reasons=finish.tolist(),
    )


class ShareEngine:
    """A rollout engine for one process of many: `generate` samples this process's share of the
    prompts with `engine` (process-local weights) and returns every process's completions.

    With the embedded engine, the share's rows keep their row index in the whole batch
    (`first_row`), so they draw the random numbers they would in one process: the tokens are those
    of a one-process run, up to float rounding. Weight sync copies the global weights into this
    process first (`local_copy`, a collective: every process syncs together).
    """

    def __init__(self, engine, mesh: jax.sharding.Mesh):
        self.engine, self.mesh = engine, mesh
        self.pad_id = getattr(engine, "pad_id", 0)

    def generate(self, prompt_ids: Sequence[Sequence[int]], params) -> rollout_base.RolloutBatch:
        parts = [share(len(prompt_ids), jax.process_count(), p) for p in range(jax.process_count())]
        sizes = [part.stop - part.start for part in parts]
        mine = parts[jax.process_index()]
        local = None
        if mine.stop > mine.start:
            kwargs = {}
            if _takes_first_row(self.engine):
                kwargs["first_row"] = mine.start * params.n
            local = self.engine.generate(list(prompt_ids[mine]), params, **kwargs)
        return gather_rollouts(local, sizes=sizes, n=params.n, max_len=params.max_new_tokens)

    def sync_weights(self, model: nnx.Module, *, version: int) -> None:
        self.engine.sync_weights(local_model(model, self.mesh), version=version)

    def close(self) -> None:
        if hasattr(self.engine, "close"):
            self.engine.close()


def _takes_first_row(engine) -> bool:
    from mmr_jax.rollout import embedded

    return isinstance(engine, embedded.EmbeddedEngine)


# ----- global <-> process-local arrays ---------------------------------------------------------


def local_copy(tree, mesh: jax.sharding.Mesh | None = None):
    """`tree` with every global array replaced by a whole copy on this process's first device.

    A collective (an all-gather of sharded leaves): every process must call it together. `mesh`
    defaults to the mesh of the first leaf with a `NamedSharding`.
    """
    if mesh is None:
        mesh = next(
            x.sharding.mesh
            for x in jax.tree.leaves(tree)
            if isinstance(getattr(x, "sharding", None), jax.sharding.NamedSharding)
        )
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    device = jax.local_devices()[0]
    t0 = time.perf_counter()
    gathered = jax.block_until_ready(_replicate(tree, replicated))
    _COLLECTIVE_S[0] += time.perf_counter() - t0
    return jax.tree.map(
        lambda x: jax.device_put(x.addressable_data(0), device) if isinstance(x, jax.Array) else x,
        gathered,
    )


def _replicate(tree, replicated):
    leaves, treedef = jax.tree.flatten(tree)
    arrays = [i for i, x in enumerate(leaves) if isinstance(x, jax.Array)]
    moved = jax.jit(lambda *xs: xs, out_shardings=replicated)(*(leaves[i] for i in arrays))
    for i, x in zip(arrays, moved, strict=True):
        leaves[i] = x
    return jax.tree.unflatten(treedef, leaves)


def local_model(model: nnx.Module, mesh: jax.sharding.Mesh | None = None) -> nnx.Module:
    """A process-local copy of `model` (whole weights on this process's first device)."""
    graphdef, state = nnx.split(model)
    return nnx.merge(graphdef, local_copy(state, mesh))


def reduce_metrics(metrics: Mapping[str, float]) -> dict[str, float]:
    """Metrics of every process reduced to one value each: times (`time/*`) by max, the slowest
    process setting the pace; everything else by mean (batch metrics are equal on every process,
    as each holds the whole step's groups). Every process must call it with the same keys."""
    if jax.process_count() == 1:
        return dict(metrics)
    keys = sorted(metrics)
    exact = np.array([float(metrics[k]) for k in keys], np.float64).view(np.int32)  # no x64 cast
    values = allgather(exact, timed=False).view(np.float64)  # runs behind the next train step
    return {
        k: float(values[:, i].max() if k.startswith("time/") else values[:, i].mean())
        for i, k in enumerate(keys)
    }


def barrier() -> None:
    """Waits until every process gets here (a collective: PeerLostError if one has died)."""
    allgather(np.zeros((1,), np.int32))
