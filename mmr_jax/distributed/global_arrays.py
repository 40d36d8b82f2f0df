"""The step's batch as global arrays: each device receives only its rows.

Every process holds the whole step batch on the host (it gathered every share's scored groups,
`shares.gather_rows`), bit-identical by construction. `global_batch` places it on the mesh with
the sharding the compiled dry run uses (`dry_run_programs.abstract_batch`): rows split over the
(data, fsdp) axes (`batch_sharding`), so the program that runs is the dry run's, and the same on
1 process x N devices as on N processes x 1 device. Each process builds only its addressable
shards (`jax.make_array_from_callback`); with several processes the host batches are first
compared by digest (`check_same_batch`), as a process that built another batch would otherwise
train on a silently mixed one.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from mmr_jax.distributed import collectives
from mmr_jax.distributed.errors import DistributedError

ROW_AXES = ("data", "fsdp")  # the batch's rows split over these mesh axes (`batch_sharding`)


class BatchMismatchError(DistributedError):
    """The processes of a run built different step batches (they must be bit-identical)."""


def row_sharding(shape: tuple[int, ...], mesh: jax.sharding.Mesh) -> NamedSharding:
    """Rows (axis 0) over (data, fsdp) when they divide evenly, else replicated.

    A layout's [N, ...] and [Q, ...] arrays divide when batch.prompts is a multiple of the
    (data, fsdp) size; a packed batch's [N / k, L] rows may not. Those are replicated, on every
    topology alike (the sharding depends on the shape and the mesh only).
    """
    ways = int(np.prod([mesh.shape[a] for a in ROW_AXES]))
    if len(shape) and shape[0] % ways == 0:
        return NamedSharding(mesh, P(ROW_AXES))
    return NamedSharding(mesh, P())


def digest(tree) -> np.ndarray:
    """SHA-256 (32 uint8) of the tree's host arrays: names, shapes, dtypes and bytes."""
    h = hashlib.sha256()
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    for path, x in leaves:
        x = np.ascontiguousarray(x)
        h.update(f"{jax.tree_util.keystr(path)}|{x.shape}|{x.dtype}".encode())
        h.update(x.tobytes())
    return np.frombuffer(h.digest(), np.uint8)


def check_same_batch(tree) -> None:
    """Raises `BatchMismatchError` unless every process holds the same host `tree` (a collective;
    a no-op with one process)."""
    if jax.process_count() == 1:
        return
    digests = collectives.allgather(digest(tree))  # [P, 32]
    differ = [p for p in range(len(digests)) if not np.array_equal(digests[p], digests[0])]
    if differ:
        raise BatchMismatchError(
            f"process(es) {differ} built another step batch than process 0; every process must "
            "build the same batch from the gathered groups (same config, code and data order)"
        )


def global_batch(host: Mapping, mesh: jax.sharding.Mesh | None):
    """`host` (a pytree of numpy arrays, the whole batch) as global arrays on `mesh`, rows split
    over (data, fsdp) (`row_sharding`). Without a mesh: plain device arrays (one device).

    A collective with several processes (`check_same_batch`): every process calls it together.
    """
    if mesh is None:
        return jax.tree.map(jax.device_put, host)
    check_same_batch(host)

    def place(x):
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, row_sharding(x.shape, mesh), lambda i: x[i])

    return jax.tree.map(place, host)
