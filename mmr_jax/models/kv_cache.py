"""Key/value cache for decoding: k and v stacked over the layers (leading axis L).

The decoder scans its layers (`decoder.scan_layers`). In the prefill the cache is the scan's carry
and layer i writes its new keys/values into slice i in place and reads slice i back. In the
sampler's decode step the scan only reads the cache; every layer's new key/value comes out of
the scan and one write puts them all in place (`write_all_layers`): no copy of the cache a step.

Shape legend (docs/design.md): L layers, N rows, S cache slots, K kv heads, D head dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class KVCache:
    """k, v: [L, N, S, K, D]; slot s of row b holds what `forward_cached` wrote there.

    `split` (static) marks the decode-loop form: k as [L, N, K, D, S] and v as [L, N, K, S, D].
    The batch dims (b, k) lead (no transposed copy of the cache per step), and the long axis S is
    the one the decode attention vectorises over: q.k sums over d with s contiguous, p.v sums
    over s with d contiguous, both streaming the cache once (keys as [N, K, S, D] would make q.k
    a horizontal sum per slot, about 4x slower on CPU). `forward_cached` takes either form and
    returns the form it was given.
    """

    k: jax.Array
    v: jax.Array
    split: bool = struct.field(pytree_node=False, default=False)

    @property
    def is_split(self) -> bool:
        return self.split

    @property
    def num_layers(self) -> int:
        return self.k.shape[0]

    @property
    def max_len(self) -> int:
        return self.v.shape[3] if self.split else self.v.shape[2]


def init(
    num_layers: int, batch: int, max_len: int, num_kv_heads: int, head_dim: int, dtype
) -> KVCache:
    """A zero cache of shape [L, N, S, K, D] for k and v."""
    shape = (num_layers, batch, max_len, num_kv_heads, head_dim)
    return KVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))


def layer(stacked_LxX, index):
    """Slice `index` (may be traced) of a stacked cache array: [L, ...] -> [...]."""
    return jax.lax.dynamic_index_in_dim(stacked_LxX, index, axis=0, keepdims=False)


def write(cache_LxNxSxKxD, layer_index, new_NxTxKxD, write_index):
    """Writes new [N, T, K, D] at slots [write_index, write_index + T) of layer `layer_index`."""
    zero = jnp.zeros((), jnp.int32)
    start = (jnp.asarray(layer_index, jnp.int32), zero, jnp.asarray(write_index, jnp.int32))
    return jax.lax.dynamic_update_slice(
        cache_LxNxSxKxD, new_NxTxKxD[None].astype(cache_LxNxSxKxD.dtype), (*start, zero, zero)
    )


def write_keys(k, layer_index, new_NxTxKxD, write_index, *, split: bool):
    """Writes new keys [N, T, K, D] of one layer into a stacked k of either form."""
    if not split:
        return write(k, layer_index, new_NxTxKxD, write_index)
    zero = jnp.zeros((), jnp.int32)
    start = (jnp.asarray(layer_index, jnp.int32), zero, zero, zero)
    new = jnp.transpose(new_NxTxKxD, (0, 2, 3, 1))[None].astype(k.dtype)  # [1, N, K, D, T]
    return jax.lax.dynamic_update_slice(k, new, (*start, jnp.asarray(write_index, jnp.int32)))


def write_values(v, layer_index, new_NxTxKxD, write_index, *, split: bool):
    """Writes new values [N, T, K, D] of one layer into a stacked v of either form."""
    if not split:
        return write(v, layer_index, new_NxTxKxD, write_index)
    zero = jnp.zeros((), jnp.int32)
    start = (jnp.asarray(layer_index, jnp.int32), zero, zero, jnp.asarray(write_index, jnp.int32))
    new = jnp.swapaxes(new_NxTxKxD, 1, 2)[None].astype(v.dtype)  # [1, N, K, T, D]
    return jax.lax.dynamic_update_slice(v, new, (*start, zero))


def write_all_layers(cache: KVCache, k_new_LxNxTxKxD, v_new_LxNxTxKxD, write_index) -> KVCache:
    """Every layer's new keys/values [L, N, T, K, D] written at slots [write_index, + T).

    One dynamic-update-slice per k and v over all L layers: a decode step whose layer scan only
    reads the cache writes its new token this way once, after the scan, so the stacked cache (a
    donated buffer or the decode loop's carry) is updated in place and never copied.
    """
    w, zero = jnp.asarray(write_index, jnp.int32), jnp.zeros((), jnp.int32)
    if cache.is_split:
        k_new = jnp.transpose(k_new_LxNxTxKxD, (0, 1, 3, 4, 2))  # [L, N, K, D, T]
        v_new = jnp.swapaxes(v_new_LxNxTxKxD, 2, 3)  # [L, N, K, T, D]
        k_start, v_start = (zero, zero, zero, zero, w), (zero, zero, zero, w, zero)
    else:
        k_new, v_new = k_new_LxNxTxKxD, v_new_LxNxTxKxD
        k_start = v_start = (zero, zero, w, zero, zero)
    return cache.replace(
        k=jax.lax.dynamic_update_slice(cache.k, k_new.astype(cache.k.dtype), k_start),
        v=jax.lax.dynamic_update_slice(cache.v, v_new.astype(cache.v.dtype), v_start),
    )


def split(cache: KVCache) -> KVCache:
    """[L, N, S, K, D] -> k [L, N, K, D, S] and v [L, N, K, S, D] (see `KVCache`)."""
    if cache.is_split:
        return cache
    return KVCache(
        k=jnp.transpose(cache.k, (0, 1, 3, 4, 2)), v=jnp.swapaxes(cache.v, 2, 3), split=True
    )


def stack(cache: KVCache) -> KVCache:
    """The inverse of `split`: the decode-loop form -> [L, N, S, K, D]."""
    if not cache.is_split:
        return cache
    return KVCache(k=jnp.transpose(cache.k, (0, 1, 4, 2, 3)), v=jnp.swapaxes(cache.v, 2, 3))
