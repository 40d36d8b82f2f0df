"""Whole process-local copies of global arrays: one gather per process, only of what changed.

The rollout engine and the HF export need whole weights in one process, on its first device. A
global array is gathered into each process once (`gather`), and its copy is reused while both
live (`LocalCopies`): a JAX array never changes value, so an array already copied needs no
second gather. Under LoRA the frozen base and the RNG state are the same arrays at every sync
(the embedded engine keeps their copies) and are gathered once; each update makes new adapter
arrays (new parameter arrays in full fine-tuning), and those alone are gathered again. A vLLM
engine under LoRA reads the adapters alone (`ShareEngine.sync_weights`): its base stays on the
server and is never gathered.

Mechanism. The obvious ones copy the model to every device: `multihost_utils.process_allgather`
of a global array, as the old `_replicate` here, runs a jit whose output is replicated (`P()`)
over the array's whole mesh, so a host with 8 devices held 8 copies (and the jit was a new lambda
each call: a compilation per sync). A `jax.device_put` onto one device per process is refused
("For a cross-host reshard in multi-controller JAX, input and target sharding should have the
same set of devices", JAX 0.10). So `gather` stays on the array's own devices and asks for
another layout of them: the devices as a (process, local) mesh, each array replicated over
`process` and split over `local`, i.e. one copy per process spread over its devices (one
program, cached per layout, `_program`); then each process assembles its copy on its first
device with a local transfer. With one device per process that copy is already on it.
"""

from __future__ import annotations

import functools
import time
import weakref
import zlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from mmr_jax.distributed import collectives
from mmr_jax.distributed.errors import DistributedError

# Running totals of `gather` in this process: calls, arrays and bytes gathered (whole arrays),
# and the most bytes one gather placed on one device of this process (its layout's peak).
_STATS = dict.fromkeys(("calls", "arrays", "bytes", "max_device_bytes"), 0)


def gather_stats() -> dict[str, int]:
    """This process's gather totals since start: 'calls', 'arrays', 'bytes' (the whole arrays
    gathered, i.e. what one copy holds) and 'max_device_bytes' (the most one gather placed on
    one device of this process: `bytes` / local devices, not `bytes`, once split)."""
    return dict(_STATS)


def host_mesh(devices) -> Mesh:
    """`devices` as a ('process', 'local') mesh: row p the devices of process p, by id."""
    by_process: dict[int, list] = {}
    for d in devices:
        by_process.setdefault(d.process_index, []).append(d)
    rows = [sorted(by_process[p], key=lambda d: d.id) for p in sorted(by_process)]
    if len({len(r) for r in rows}) != 1:
        raise DistributedError(
            "weight copy: the processes hold different numbers of the mesh's devices "
            f"({[len(r) for r in rows]}); every process must hold the same number"
        )
    return Mesh(np.array(rows, dtype=object), ("process", "local"))


def gather_spec(shape: tuple[int, ...], dtype, local: int) -> PartitionSpec:
    """How an array of `shape` lies on the host mesh: replicated over processes and split over
    `local` along its first axis that divides by it; whole on each local device when none does
    (then small: a scalar, a norm vector of odd size, an RNG key)."""
    if local > 1 and not jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        for axis, size in enumerate(shape):
            if size % local == 0:
                return PartitionSpec(*(None,) * axis, "local")
    return PartitionSpec()


def _identity(*xs):
    return xs


@functools.lru_cache(maxsize=64)
def _program(shardings: tuple[NamedSharding, ...]):
    """The gather of one tuple of layouts, jitted once (its compilations cached by shape)."""
    return jax.jit(_identity, out_shardings=shardings)


def gather(arrays: list[jax.Array], device: jax.Device | None = None) -> list[jax.Array]:
    """A whole copy of each global array on `device` (default: this process's first).

    A collective over the arrays' devices (one program per device set, e.g. the run's mesh):
    every process calls it with arrays of the same shapes, in the same order.
    """
    device = device or jax.local_devices()[0]
    groups: dict[frozenset, list[int]] = {}
    for i, x in enumerate(arrays):
        groups.setdefault(frozenset(x.sharding.device_set), []).append(i)
    out: list = [None] * len(arrays)
    for devices, members in groups.items():
        copies = _gather_on(devices, [arrays[i] for i in members], device)
        for i, y in zip(members, copies, strict=True):
            out[i] = y
    return out


def _gather_on(devices, arrays: list[jax.Array], device: jax.Device) -> list[jax.Array]:
    mesh = host_mesh(devices)
    local = mesh.shape["local"]
    shardings = tuple(NamedSharding(mesh, gather_spec(x.shape, x.dtype, local)) for x in arrays)
    try:
        out = jax.block_until_ready(_program(shardings)(*arrays))
    except Exception as e:  # a dead peer: PeerLostError, as every collective here
        lost = collectives.peer_lost(e)
        if lost is None:
            raise
        raise lost from e
    _count(arrays, out)
    mine = next(r for r in mesh.devices if r[0].process_index == jax.process_index())
    out = list(out)
    for i, y in enumerate(out):  # leaf by leaf: the device holds one leaf's parts at a time
        out[i] = _assemble(y, device, mine)
    return out


def _count(arrays: list[jax.Array], out) -> None:
    per_device: dict = {}
    for y in out:
        for s in y.addressable_shards:
            per_device[s.device] = per_device.get(s.device, 0) + s.data.nbytes
    _STATS["calls"] += 1
    _STATS["arrays"] += len(arrays)
    _STATS["bytes"] += sum(int(x.nbytes) for x in arrays)
    _STATS["max_device_bytes"] = max(_STATS["max_device_bytes"], max(per_device.values()))


def _assemble(y: jax.Array, device: jax.Device, local_devices) -> jax.Array:
    """This process's copy of `y` (one copy per process, maybe split over its devices) whole on
    `device`: its parts moved there (device to device) and joined by a cached program. Not a
    `device_put` of the split array onto one device: JAX takes that through host memory."""
    spec = y.sharding.spec
    if all(s is None for s in spec):  # whole on every local device
        shards = {s.device: s.data for s in y.addressable_shards}
        if device in shards:
            return shards[device]
        return jax.device_put(shards[local_devices[0]], device)
    axis = next(i for i, s in enumerate(spec) if s is not None)
    parts = sorted(y.addressable_shards, key=lambda s: s.index[axis].start or 0)
    return _join(tuple(jax.device_put(s.data, device) for s in parts), axis=axis)


@functools.partial(jax.jit, static_argnames="axis")
def _join(parts: tuple[jax.Array, ...], axis: int) -> jax.Array:
    return jnp.concatenate(parts, axis=axis)


class LocalCopies:
    """Whole process-local copies of global arrays, each made once: while both an array and its
    copy live, the copy is returned again instead of gathered.

    Both are held weakly: a copy lives as long as its user keeps it (the embedded engine's model
    keeps the base under LoRA; a vLLM engine writes its copy out and drops it), so the cache
    never holds a model's worth of device memory of its own.
    """

    def __init__(self):
        self._copies: dict[int, tuple[weakref.ref, weakref.ref]] = {}

    def __len__(self) -> int:
        self._purge()
        return len(self._copies)

    def _purge(self) -> None:
        dead = [k for k, (src, dst) in self._copies.items() if src() is None or dst() is None]
        for k in dead:
            del self._copies[k]

    def _get(self, x: jax.Array) -> jax.Array | None:
        src, dst = self._copies.get(id(x), (lambda: None, lambda: None))
        copy = dst()
        if src() is not x or copy is None or copy.is_deleted():
            return None
        return copy

    def copy(self, tree, device: jax.Device | None = None):
        """`tree` with every jax.Array replaced by a whole copy on `device` (default: this
        process's first): global arrays not copied before are gathered (`gather`, a collective:
        every process calls it together, with the same tree), process-local ones copied."""
        device = device or jax.local_devices()[0]
        self._purge()
        leaves, treedef = jax.tree.flatten(tree)
        out = list(leaves)
        todo = []
        for i, x in enumerate(leaves):
            if isinstance(x, jax.Array):
                hit = self._get(x)
                if hit is None:
                    todo.append(i)
                else:
                    out[i] = hit
        remote = [i for i in todo if not leaves[i].is_fully_addressable]
        t0 = time.perf_counter()
        _agree(leaves, remote)
        for i, y in zip(remote, gather([leaves[i] for i in remote], device), strict=True):
            out[i] = y
        for i in todo:
            if leaves[i].is_fully_addressable:  # a process-local array: a copy of its own
                out[i] = jax.device_put(leaves[i], device, may_alias=False)
        for i in todo:
            self._copies[id(leaves[i])] = (weakref.ref(leaves[i]), weakref.ref(out[i]))
        jax.block_until_ready(out)
        collectives._COLLECTIVE_S[0] += time.perf_counter() - t0
        return jax.tree.unflatten(treedef, out)


def _agree(leaves, remote: list[int]) -> None:
    """Every process is about to gather the same arrays (else a named error, not a hang or a
    mismatched collective): a checksum of their shapes and dtypes, compared across processes."""
    if jax.process_count() == 1:
        return
    key = repr([(leaves[i].shape, str(leaves[i].dtype)) for i in remote]).encode()
    mine = np.array([zlib.crc32(key) & 0x7FFFFFFF], np.int32)
    every = collectives.allgather(mine, timed=False)[:, 0]
    if len(set(every.tolist())) != 1:
        raise DistributedError(
            f"weight copy: process {jax.process_index()} would gather {len(remote)} arrays, "
            "the processes different ones (checksums "
            f"{every.tolist()}); every process must copy the same global arrays together"
        )


COPIES = LocalCopies()  # the process's copies: the engine's weights, the exports'


def local_copy(tree):
    """`tree` with every jax.Array replaced by a whole copy on this process's first device.

    A collective (every process calls it together, with the same tree): global arrays are
    gathered once per process (never replicated on every device of the mesh), and an array
    copied before, while it lives, is not gathered again (under LoRA a sync gathers the
    adapters alone).
    """
    return COPIES.copy(tree)


def local_model(model: nnx.Module) -> nnx.Module:
    """A process-local copy of `model` (whole weights on this process's first device)."""
    graphdef, state = nnx.split(model)
    return nnx.merge(graphdef, local_copy(state))
