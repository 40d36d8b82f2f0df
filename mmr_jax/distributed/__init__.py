"""Many hosts, one program: JAX's multi-controller runtime (docs/multihost.md).

Every process runs the same code on one global mesh (`jax.devices()` spans all processes once
`initialize` has run). What is per process lives in this package, at one place:

  - `startup`: `initialize` (explicit coordinator / count / id, or `auto` on clusters JAX
    detects), with the checks that must fail before any step: a process id out of range, an
    unreachable coordinator (bounded wait), configs that differ across processes
    (`check_same_config`), a batch that does not split over the processes (`check_batch_split`);
  - `shares`: each process's share of a batch of prompts (`share`: contiguous, so a group never
    spans two processes) and of the vLLM servers (`rollout_url`), sampled by its own engine
    (`ShareEngine`), with per-prompt results gathered back in process order (`gather_rows`,
    `gather_rollouts`), so that every process holds the step's B groups as one process would and
    builds the same global batch;
  - `collectives`: host-side all-gathers and what is built on them: metrics reduced over
    processes (`reduce_metrics`), decisions
    taken by process 0 (`primary_value`, `primary_first`), and `PeerLostError` for a dead peer;
  - `global_arrays`: the step's batch as global arrays, rows split over (data, fsdp) as the dry
    run compiles it (`global_batch`), after checking every process built the same one;
  - `failures`: a process that raises stops every process in bounded time, each with a named
    error (`announce`, `announced`, `exit_now`);
  - `errors`: the named errors.

On CPU, local processes with a localhost coordinator and gloo collectives are a real cluster
(tests/end_to_end/multihost_test.py). Everything here is a no-op with one process. The names below
are the package's API; callers import the package (`from mmr_jax import distributed`).

May import: `rollout.base` (the engine interface its shares wrap), nothing above.
"""

from mmr_jax.distributed.collectives import (
    allgather,
    barrier,
    collective_seconds,
    is_primary,
    peer_lost,
    primary_first,
    primary_value,
    reduce_metrics,
)
from mmr_jax.distributed.errors import (
    BatchSplitError,
    ConfigMismatchError,
    CoordinatorUnreachableError,
    DistributedError,
    PeerLostError,
    ProcessIdError,
    RolloutUrlError,
)
from mmr_jax.distributed.failures import announce, announced, exit_now
from mmr_jax.distributed.global_arrays import (
    BatchMismatchError,
    check_same_batch,
    global_batch,
    row_sharding,
)
from mmr_jax.distributed.shares import (
    ShareEngine,
    gather_rollouts,
    gather_rows,
    rollout_url,
    share,
    share_slices,
)
from mmr_jax.distributed.startup import (
    MODES,
    Options,
    check_batch_split,
    check_same_config,
    config_digest,
    define_flags,
    initialize,
    options_from_flags,
    start,
    validate,
    wait_for_coordinator,
)
from mmr_jax.distributed.weight_sync import local_copy, local_model

__all__ = [
    "BatchMismatchError", "BatchSplitError", "ConfigMismatchError", "CoordinatorUnreachableError",
    "DistributedError", "MODES", "Options", "PeerLostError", "ProcessIdError", "RolloutUrlError",
    "ShareEngine", "allgather", "announce", "announced", "barrier", "check_batch_split",
    "check_same_batch", "check_same_config", "collective_seconds", "config_digest", "define_flags",
    "exit_now", "gather_rollouts", "gather_rows", "global_batch", "initialize", "is_primary",
    "local_copy", "local_model", "options_from_flags", "peer_lost", "primary_first",
    "primary_value", "reduce_metrics", "rollout_url", "row_sharding", "share", "share_slices",
    "start", "validate", "wait_for_coordinator",
]  # fmt: skip
