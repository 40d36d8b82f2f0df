"""Key/value cache for decoding: one pytree of stacked per-layer arrays.

Legend: L layers, B batch, S cache slots, K kv heads, D head dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class KVCache:
    """k, v: [L, B, S, K, D]; slot s of row b holds what `forward_cached` wrote there."""

    k: jax.Array
    v: jax.Array

    @property
    def max_len(self) -> int:
        return self.k.shape[2]


def init(
    num_layers: int, batch: int, max_len: int, num_kv_heads: int, head_dim: int, dtype
) -> KVCache:
    """A zero cache of shape [L, B, S, K, D] for k and v."""
    shape = (num_layers, batch, max_len, num_kv_heads, head_dim)
    return KVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))


def write(cache_LxBxSxKxD, layer: int, new_BxTxKxD, write_index):
    """Writes new [B, T, K, D] at slots [write_index, write_index + T) of `layer`."""
    zero = jnp.zeros((), jnp.int32)
    start = (jnp.int32(layer), zero, jnp.asarray(write_index, jnp.int32), zero, zero)
    return jax.lax.dynamic_update_slice(
        cache_LxBxSxKxD, new_BxTxKxD[None].astype(cache_LxBxSxKxD.dtype), start
    )
