"""Abstract model builds: parameter counts and per-device memory for a mesh, without any weights.

The decoder is built with `nnx.eval_shape` (ShapeDtypeStructs only); per-device bytes come from the
partition rules in `sharding.py` applied to a mesh *shape*, so no devices are needed either.
`pod_mesh_shape` gives the shape a config's mesh takes on N hosts x k devices (hybrid by
default), and `pod_hosts` groups N * k virtual devices as those hosts for the compiled dry run.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from mmr_jax.models import config as config_lib
from mmr_jax.models import loading, sharding
from mmr_jax.models import lora as lora_lib


@dataclasses.dataclass(frozen=True)
class MeshShape:
    """Stands in for a `jax.sharding.Mesh` where only axis sizes matter."""

    data: int = 1
    fsdp: int = 1
    tensor: int = 1

    @property
    def shape(self) -> dict[str, int]:
        return {"data": self.data, "fsdp": self.fsdp, "tensor": self.tensor}


def pod_hosts(hosts: int, devices_per_host: int) -> list[int]:
    """The host of each of `hosts * devices_per_host` devices: device i on host i // k."""
    if hosts < 1 or devices_per_host < 1:
        raise ValueError(f"a pod of {hosts} hosts x {devices_per_host} devices")
    return [i // devices_per_host for i in range(hosts * devices_per_host)]


def pod_mesh_shape(
    shape, *, hosts: int = 1, devices_per_host: int = 1, over_hosts: str = "hybrid"
) -> MeshShape:
    """`shape` (data, fsdp, tensor; one size may be -1) laid on the pod as `sharding.make_mesh`
    lays it (`sharding.device_grid`)."""
    sizes = sharding.mesh_sizes(
        shape, hosts=hosts, devices_per_host=devices_per_host, over_hosts=over_hosts
    )
    return MeshShape(**sizes)


def formula_param_count(cfg: config_lib.ModelConfig) -> int:
    """Base parameter count from the config alone (embeddings, blocks, final norm, untied head)."""
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
    per_layer = 2 * h * q + 2 * h * kv + 3 * h * i + 2 * h
    per_layer += (q + 2 * kv) * cfg.attention_bias + h * cfg.o_proj_bias
    head = 0 if cfg.tie_word_embeddings else cfg.vocab_size * h
    return cfg.vocab_size * h + cfg.num_layers * per_layer + h + head


def formula_lora_count(cfg: config_lib.ModelConfig, lora: lora_lib.LoraConfig) -> int:
    """LoRA parameter count: rank * (in + out) per targeted projection per layer."""
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
    dims = {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, i),
        "up_proj": (h, i),
        "down_proj": (i, h),
    }
    return cfg.num_layers * sum(lora.rank * sum(dims[m]) for m in lora.target_modules)


def _params(model) -> list[tuple[tuple, jax.ShapeDtypeStruct, bool]]:
    """(path, abstract value, is_lora) for every parameter of an abstract model."""
    out = []
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        out.append((path, var.get_value(), isinstance(var, nnx.LoRAParam)))
    return out


def _per_device(path, shape, mesh) -> int:
    spec = sharding.partition_spec(path, tuple(shape), mesh)
    parts = math.prod(mesh.shape[ax] for ax in spec if ax is not None)
    return math.prod(shape) // parts


def summarize(
    cfg: config_lib.ModelConfig,
    *,
    mesh: MeshShape = MeshShape(),
    lora: lora_lib.LoraConfig | None = None,
    param_dtype=jnp.float32,
    adam_dtype=jnp.float32,
    frozen_dtype=None,
) -> dict:
    """Counts and per-device bytes (params, grads, Adam mu+nu) for full fine-tuning or LoRA.

    Gradients are in param_dtype; only trainable parameters (all without LoRA, the adapters with)
    have gradients and optimiser state. Under LoRA the frozen base is stored in `frozen_dtype`
    (None: param_dtype), as `decoder.Decoder` stores it. Activations and the KV cache are not
    included.
    """
    model = loading.abstract_model(cfg, param_dtype=param_dtype, lora=lora)
    params = _params(model)
    p_bytes, a_bytes = jnp.dtype(param_dtype).itemsize, jnp.dtype(adam_dtype).itemsize
    total = sum(math.prod(v.shape) for _, v, is_lora in params if not is_lora)
    lora_n = sum(math.prod(v.shape) for _, v, is_lora in params if is_lora)
    trainable = [(p, v) for p, v, is_lora in params if is_lora == (lora is not None)]
    dev_all = sum(_per_device(p, v.shape, mesh) for p, v, _ in params)
    dev_train = sum(_per_device(p, v.shape, mesh) for p, v in trainable)
    f_bytes = jnp.dtype(frozen_dtype if lora is not None and frozen_dtype else param_dtype).itemsize
    param_bytes = dev_train * p_bytes + (dev_all - dev_train) * f_bytes
    gib = 2.0**30
    return {
        "params": total,
        "lora_params": lora_n,
        "trainable": sum(math.prod(v.shape) for _, v in trainable),
        "formula_params": formula_param_count(cfg),
        "mesh": mesh.shape,
        "param_gib_per_device": param_bytes / gib,
        "grad_gib_per_device": dev_train * p_bytes / gib,
        "adam_gib_per_device": 2 * dev_train * a_bytes / gib,
        "total_gib_per_device": (param_bytes + dev_train * (p_bytes + 2 * a_bytes)) / gib,
    }


def format_summary(name: str, s: dict) -> str:
    mesh = "x".join(str(v) for v in s["mesh"].values())
    return (
        f"{name:34s} params {s['params'] / 1e9:7.3f}B  trainable {s['trainable'] / 1e6:9.2f}M  "
        f"mesh {mesh:7s} per device: params {s['param_gib_per_device']:6.2f} GiB  "
        f"grads {s['grad_gib_per_device']:6.2f}  adam {s['adam_gib_per_device']:6.2f}  "
        f"total {s['total_gib_per_device']:6.2f} GiB"
    )
