"""Device mesh with data / fsdp / tensor axes and partition rules for the decoder's parameters.

Rules are keyed on the parameter's state path (kernels are stored [in, out]):
  embedding [V, E]                     -> (tensor, fsdp)
  q/k/v/gate/up kernel [E, out]        -> (fsdp, tensor)   column-parallel
  o/down kernel [in, E]                -> (tensor, fsdp)   row-parallel
  lm_head kernel [E, V]                -> (fsdp, tensor)
  q/k/v bias [out]                     -> (tensor,)
  lora_a [in, r] / lora_b [r, out]     -> the kernel's in / out axis, rank replicated
  norms, other biases, RNG state       -> replicated
Stacked layer parameters ([L, ...]) keep the layer axis unsharded and follow these rules after it.
A dimension not divisible by its axis size is replicated instead. Batches shard over (data, fsdp).

On several hosts (processes) a run's mesh is by default hybrid over them (`mesh.over_hosts`), as
MaxText's and JAX's `mesh_utils.create_hybrid_device_mesh` (processes as granules): each host's
devices form one contiguous block of `data` rows, so fsdp's and tensor's collectives stay within
a host and only the data-parallel gradient reduction crosses hosts (`device_grid`).
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")  # a batch's rows split over these (`batch_sharding`)
TENSOR_AXIS = "tensor"  # attention heads and the projections' outputs
# `mesh.over_hosts`: 'hybrid' keeps fsdp and tensor within a host, 'flat' lays the shape over the
# devices in order (fsdp may span hosts). One host: the same mesh either way.
OVER_HOSTS = ("hybrid", "flat")
_COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "lm_head")
_ROW = ("o_proj", "down_proj")


def use_cpu_cores_as_devices(count: int | None = None) -> int:
    """Gives JAX one CPU device per core (default: all cores); call before any JAX operation.

    XLA:CPU runs one program on one device largely on one core: small batched ops (the MMR Gram
    matrices, a decode step's attention and sampling) do not spread over the intra-op threads.
    With a device per core, a batch sharded over a `data` mesh axis runs on every core. Only the
    CPU backend is affected: on a GPU host the GPUs stay the default devices. Returns the count.
    Raises RuntimeError once JAX has initialised its backends.
    """
    count = int(count or os.cpu_count() or 1)
    jax.config.update("jax_num_cpu_devices", count)
    return count


def data_parallel_mesh(devices=None) -> Mesh:
    """A (data, 1, 1) mesh over `devices` (default: all): batches split, parameters replicated."""
    return make_mesh(-1, 1, 1, devices=devices)


def batch_size(mesh: Mesh | None) -> int:
    """How many ways `batch_sharding(mesh)` splits a batch (1 without a mesh)."""
    return 1 if mesh is None else mesh.shape["data"] * mesh.shape["fsdp"]


class MeshShapeError(ValueError):
    """A mesh shape that does not fit the devices, or the hosts, it is laid over."""


def granule(device) -> int:
    """The unit a hybrid mesh lays along `data`: a TPU slice, whose chips are joined by ICI even
    across hosts (so one slice of several hosts keeps fsdp over all its chips, and a multislice
    run puts data across slices, over DCN); elsewhere (GPU nodes, CPU processes) the device's
    process. As `jax.experimental.mesh_utils.create_hybrid_device_mesh`'s granules, but the slice
    is read on TPUs only: CPU devices of a multi-process cluster carry a `slice_index` too, 0 on
    every process, which would lay their hosts flat."""
    slice_index = getattr(device, "slice_index", None)
    if getattr(device, "platform", None) == "tpu" and slice_index is not None:
        return slice_index
    return getattr(device, "process_index", 0)


def make_mesh(
    data: int = 1,
    fsdp: int = -1,
    tensor: int = 1,
    *,
    devices=None,
    over_hosts: str = "flat",
    hosts: Sequence[int] | None = None,
) -> Mesh:
    """A Mesh of shape (data, fsdp, tensor) over `devices` (default: all); one size may be -1.

    `over_hosts` 'flat' (the default here: `devices` in order, reshaped) or 'hybrid' (what a
    run uses by default, `mesh.over_hosts` in configs/base.py: hosts along data); `hosts[i]`: the
    host of `devices[i]` (default: its `granule`, the TPU slice or else the process). See
    `device_grid`.
    """
    devices = list(jax.devices() if devices is None else devices)
    hosts = [granule(d) for d in devices] if hosts is None else list(hosts)
    return Mesh(device_grid((data, fsdp, tensor), devices, hosts, over_hosts=over_hosts), AXES)


def device_grid(
    shape: Sequence[int], devices: Sequence, hosts: Sequence[int], *, over_hosts: str = "hybrid"
) -> np.ndarray:
    """`devices` as a [data, fsdp, tensor] array; `hosts[i]` is the host of `devices[i]`.

    One host, or over_hosts 'flat': `devices` in order, reshaped; -1 takes the remaining devices.
    'hybrid' on H hosts of k devices each: host h (in host order) fills data rows
    [h * d, (h + 1) * d) with its devices in order, reshaped (d, fsdp, tensor). A -1 on fsdp or
    tensor makes `shape` one host's mesh (-1: the rest of its k devices) and the hosts multiply
    data: (1, -1, 1) on 2 hosts x 8 is (2, 8, 1). Otherwise `shape` is global (-1 on data: the
    remaining devices) and its data must split over the hosts; a shape written in full whose data
    does not, e.g. (1, 2, 1) on 2 hosts x 1, is laid flat as written (fsdp across hosts, asked
    for explicitly). Anything else that would put fsdp or tensor across hosts raises
    `MeshShapeError`.
    """
    if over_hosts not in OVER_HOSTS:
        raise MeshShapeError(f"mesh over_hosts={over_hosts!r}; expected one of {OVER_HOSTS}")
    if len(hosts) != len(devices):
        raise MeshShapeError(f"{len(hosts)} host ids for {len(devices)} devices")
    shape = [int(s) for s in shape]
    if len(shape) != len(AXES) or shape.count(-1) > 1 or any(s < 1 and s != -1 for s in shape):
        raise MeshShapeError(
            f"mesh shape {tuple(shape)}: (data, fsdp, tensor) sizes >= 1, at most one -1"
        )
    groups: dict[int, list] = {}
    for device, host in zip(devices, hosts, strict=True):
        groups.setdefault(host, []).append(device)
    if over_hosts == "flat" or len(groups) == 1:
        return _flat(shape, devices)
    return _hybrid(shape, [groups[h] for h in sorted(groups)])


def _resolve(shape: list[int], count: int, where: str = "") -> list[int]:
    """`shape` with its -1 filled from `count` devices; raises unless it uses exactly those."""
    known = math.prod(s for s in shape if s != -1)
    if -1 in shape and count % known:
        raise MeshShapeError(
            f"mesh {tuple(shape)}: the sizes given ({known} devices) do not divide the {count} "
            f"devices{where}"
        )
    sizes = [count // known if s == -1 else s for s in shape]
    if math.prod(sizes) != count:
        raise MeshShapeError(
            f"mesh {dict(zip(AXES, sizes, strict=True))} needs {math.prod(sizes)} "
            f"devices, have {count}"
        )
    return sizes


def _flat(shape: list[int], devices: list) -> np.ndarray:
    return np.asarray(devices, dtype=object).reshape(_resolve(shape, len(devices)))


def _hybrid(shape: list[int], groups: list[list]) -> np.ndarray:
    """Each group (one host's devices) one contiguous block of data rows, in group order."""
    h, k = len(groups), len(groups[0])
    written = -1 not in shape
    if any(len(g) != k for g in groups):
        if written:
            return _flat(shape, [d for g in groups for d in g])
        raise MeshShapeError(
            f"hosts hold {[len(g) for g in groups]} devices: a hybrid mesh needs the same count "
            "on each; write every mesh size, or set mesh.over_hosts='flat'"
        )
    if -1 in shape[1:]:
        per_host = _resolve(shape, k, " of one host (a -1 on fsdp or tensor fills one host)")
    else:
        sizes = _resolve(shape, h * k)
        if sizes[0] % h:
            if written:  # fsdp / tensor across hosts, as written
                return _flat(sizes, [d for g in groups for d in g])
            raise MeshShapeError(
                f"mesh {tuple(sizes)}: data={sizes[0]} does not split over {h} hosts, so fsdp "
                "or tensor would span hosts; write every mesh size to ask for that, or set "
                "mesh.over_hosts='flat'"
            )
        per_host = [sizes[0] // h, *sizes[1:]]
    blocks = [np.asarray(g, dtype=object).reshape(per_host) for g in groups]
    return np.concatenate(blocks, axis=0)


def mesh_sizes(
    shape: Sequence[int], *, hosts: int, devices_per_host: int, over_hosts: str = "hybrid"
) -> dict[str, int]:
    """The (data, fsdp, tensor) sizes `device_grid` gives `shape` on `hosts` x `devices_per_host`
    devices (host i // devices_per_host), without any device."""
    n = hosts * devices_per_host
    grid = device_grid(
        shape, list(range(n)), [i // devices_per_host for i in range(n)], over_hosts=over_hosts
    )
    return dict(zip(AXES, grid.shape, strict=True))


def _logical_spec(path: tuple) -> tuple:
    names = [str(p) for p in path]
    leaf = names[-1]
    module = names[-2] if len(names) > 1 else ""
    if leaf == "embedding":
        return ("tensor", "fsdp")
    if module in _COLUMN:
        return {
            "kernel": ("fsdp", "tensor"),
            "bias": ("tensor",),
            "lora_a": ("fsdp", None),
            "lora_b": (None, "tensor"),
        }.get(leaf, ())
    if module in _ROW:
        return {
            "kernel": ("tensor", "fsdp"),
            "lora_a": ("tensor", None),
            "lora_b": (None, "fsdp"),
        }.get(leaf, ())
    return ()


def partition_spec(path: tuple, shape: tuple[int, ...], mesh: Mesh) -> P:
    """The PartitionSpec of the parameter at `path`, with non-divisible dims replicated.

    Parameters of the stacked layers (`layers/...`, [L, ...]) take their layer's rule on the
    trailing dims; the layer axis is never sharded (the scan slices it).
    """
    spec = _logical_spec(path)
    if str(path[0]) == "layers":
        spec = (None, *spec) if spec else ()
    if len(spec) != len(shape):
        return P()
    return P(
        *(
            ax if ax is not None and dim % mesh.shape[ax] == 0 else None
            for ax, dim in zip(spec, shape, strict=True)
        )
    )


def named_sharding(path: tuple, shape: tuple[int, ...], mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, partition_spec(path, shape, mesh))


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Sharding of [N, ...] host batches: N over (data, fsdp)."""
    return NamedSharding(mesh, P(BATCH_AXES))


def tracing_under(mesh: Mesh | None):
    """A context, entered inside a traced function, that makes `mesh` the trace's mesh
    (`jax.sharding.get_abstract_mesh()`): what kernels XLA cannot partition (splash's Mosaic call,
    `attention_impl._splash`) `shard_map` over. No mesh: nothing changes (their one-device call).
    Inside the trace, not around the call: a jitted step then needs no context from its caller."""
    if mesh is None:
        return contextlib.nullcontext()
    return jax.sharding.use_abstract_mesh(mesh.abstract_mesh)


def replicated(mesh: Mesh) -> NamedSharding:
    """Every device holds the whole array."""
    return NamedSharding(mesh, P())
