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

    `split` gives the decode-loop form: tuples of L per-layer arrays, k as [B, K, D, S] and v as
    [B, K, S, D]. A layer's slice is then a whole buffer (updated in place, no slice copy), the
    batch dims (b, k) lead (no transposed copy of the cache per step), and the long axis S is the
    one the decode attention vectorises over: q.k sums over d with s contiguous, p.v sums over s
    with d contiguous, both streaming the cache once (keys as [B, K, S, D] would make q.k a
    horizontal sum per slot, about 4x slower on CPU). `forward_cached` takes either form and
    returns the form it was given.
    """

    k: jax.Array | tuple[jax.Array, ...]
    v: jax.Array | tuple[jax.Array, ...]

    @property
    def is_split(self) -> bool:
        return isinstance(self.k, tuple)

    @property
    def max_len(self) -> int:
        return self.v[0].shape[2] if self.is_split else self.v.shape[2]


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
    """Stacked [L, B, S, K, D] -> per-layer k [B, K, D, S] and v [B, K, S, D] (see `KVCache`)."""
    if cache.is_split:
        return cache
    num_layers = cache.k.shape[0]
    return KVCache(
        k=tuple(jnp.transpose(cache.k[i], (0, 2, 3, 1)) for i in range(num_layers)),
        v=tuple(jnp.swapaxes(cache.v[i], 1, 2) for i in range(num_layers)),
    )


def stack(cache: KVCache) -> KVCache:
    """The inverse of `split`: per-layer tuples -> stacked [L, B, S, K, D]."""
    if not cache.is_split:
        return cache
    return KVCache(
        k=jnp.stack([jnp.transpose(a, (0, 3, 1, 2)) for a in cache.k]),
        v=jnp.stack([jnp.swapaxes(a, 1, 2) for a in cache.v]),
    )


def write_layer_keys(cache_BxKxDxS, new_BxTxKxD, write_index):
    """Writes new keys [B, T, K, D] at slots [write_index, write_index + T) of a layer's k."""
    zero = jnp.zeros((), jnp.int32)
    start = (zero, zero, zero, jnp.asarray(write_index, jnp.int32))
    new = jnp.transpose(new_BxTxKxD, (0, 2, 3, 1)).astype(cache_BxKxDxS.dtype)
    return jax.lax.dynamic_update_slice(cache_BxKxDxS, new, start)


def write_layer_values(cache_BxKxSxD, new_BxTxKxD, write_index):
    """Writes new values [B, T, K, D] at slots [write_index, write_index + T) of a layer's v."""
    zero = jnp.zeros((), jnp.int32)
    start = (zero, zero, jnp.asarray(write_index, jnp.int32), zero)
    new = jnp.swapaxes(new_BxTxKxD, 1, 2).astype(cache_BxKxSxD.dtype)
    return jax.lax.dynamic_update_slice(cache_BxKxSxD, new, start)
