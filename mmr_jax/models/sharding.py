"""Device mesh with data / fsdp / tensor axes and partition rules for the decoder's parameters.

Rules are keyed on the parameter's state path (our layout: kernels are [in, out]):
  embedding [V, H]                     -> (tensor, fsdp)
  q/k/v/gate/up kernel [H, out]        -> (fsdp, tensor)   column-parallel
  o/down kernel [in, H]                -> (tensor, fsdp)   row-parallel
  lm_head kernel [H, V]                -> (fsdp, tensor)
  q/k/v bias [out]                     -> (tensor,)
  lora_a [in, r] / lora_b [r, out]     -> the kernel's in / out axis, rank replicated
  norms, other biases, RNG state       -> replicated
Stacked layer parameters ([L, ...]) keep the layer axis unsharded and follow these rules after it.
A dimension not divisible by its axis size is replicated instead. Batches shard over (data, fsdp).
"""

from __future__ import annotations

import math
import os

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

AXES = ("data", "fsdp", "tensor")
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


def make_mesh(data: int = 1, fsdp: int = -1, tensor: int = 1, *, devices=None) -> Mesh:
    """A Mesh of shape (data, fsdp, tensor) over `devices` (default: all); one size may be -1."""
    devices = list(jax.devices() if devices is None else devices)
    sizes = [data, fsdp, tensor]
    if sizes.count(-1) > 1:
        raise ValueError(f"at most one mesh axis may be -1, got {sizes}")
    known = math.prod(s for s in sizes if s != -1)
    sizes = [len(devices) // known if s == -1 else s for s in sizes]
    if math.prod(sizes) != len(devices):
        raise ValueError(
            f"mesh {dict(zip(AXES, sizes, strict=True))} needs {math.prod(sizes)} "
            f"devices, have {len(devices)}"
        )
    return Mesh(np.asarray(devices, dtype=object).reshape(sizes), AXES)


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
    """Sharding of [B, ...] host batches: B over (data, fsdp)."""
    return NamedSharding(mesh, P(("data", "fsdp")))


def replicated(mesh: Mesh) -> NamedSharding:
    """Every device holds the whole array."""
    return NamedSharding(mesh, P())
