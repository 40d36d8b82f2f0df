"""Key/value cache for decoding: one pytree of stacked per-layer arrays.

Legend: L layers, B batch, S cache slots, K kv heads, D head dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class KVCache:
    """k, v: [L, B, S, K, D]; slot s of row b holds what `forward_cached` wrote there.

    `split` gives the decode-loop form: k and v are tuples of L per-layer [B, K, S, D] arrays, so a
    layer's slice is a whole buffer (updated in place, no slice copy) and attention contracts with
    leading batch dims (no transposed copy of the cache per step). `forward_cached` takes either
    form and returns the form it was given.
    """

    k: jax.Array | tuple[jax.Array, ...]
    v: jax.Array | tuple[jax.Array, ...]

    @property
    def is_split(self) -> bool:
        return isinstance(self.k, tuple)

    @property
    def max_len(self) -> int:
        return self.k[0].shape[2] if self.is_split else self.k.shape[2]


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


def split(cache: KVCache) -> KVCache:
    """Stacked [L, B, S, K, D] -> tuples of L per-layer [B, K, S, D] arrays (see `KVCache`)."""
    if cache.is_split:
        return cache
    per_layer = lambda a: tuple(jnp.swapaxes(a[i], 1, 2) for i in range(a.shape[0]))
    return KVCache(k=per_layer(cache.k), v=per_layer(cache.v))


def stack(cache: KVCache) -> KVCache:
    """The inverse of `split`: per-layer [B, K, S, D] tuples -> stacked [L, B, S, K, D]."""
    if not cache.is_split:
        return cache
    stacked = lambda t: jnp.stack([jnp.swapaxes(a, 1, 2) for a in t])
    return KVCache(k=stacked(cache.k), v=stacked(cache.v))


def write_layer(cache_BxKxSxD, new_BxTxKxD, write_index):
    """Writes new [B, T, K, D] at slots [write_index, write_index + T) of a per-layer array."""
    zero = jnp.zeros((), jnp.int32)
    start = (zero, zero, jnp.asarray(write_index, jnp.int32), zero)
    new = jnp.swapaxes(new_BxTxKxD, 1, 2).astype(cache_BxKxSxD.dtype)
    return jax.lax.dynamic_update_slice(cache_BxKxSxD, new, start)
