"""The sampler's packed prefill: prompt tokens packed into rows, their keys/values gathered into
the prompt cache (`sampler`'s docstring, "Layout").

Legend: Bp padded prompts, P prompt slots, N packed rows of W = P - 1 slots, L layers, K kv heads,
D head dim.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from mmr_jax.models import kv_cache, sharding


@functools.partial(jax.jit, static_argnames=("graphdef", "cache_sharding"))
def prefill(
    graphdef, state, tokens_NxW, positions_NxW, segment_ids_NxW, gather_BxP, *, cache_sharding=None
):
    """The prompt cache (split: keys [L, Bp, K, D, P], values [L, Bp, K, P, D]) from packed rows.

    Runs the packed rows against a temporary split cache of W slots, each token attending to its
    own segment, then gathers every layer's keys/values into the prompt-cache slots. The slots the
    gather index leaves at 0 hold copies of packed slot 0 (masked in the decode).
    `cache_sharding`: where the prompt cache goes (its prompt axis 1 split as the prompts' batch
    sharding: `cache_sharding(mesh)`), or None.
    """
    model = nnx.merge(graphdef, state)
    rows, w = tokens_NxW.shape
    packed = kv_cache.split(model.init_cache(rows, w))
    _, packed = model.forward_cached(
        tokens_NxW,
        positions_NxW,
        packed,
        write_index=0,
        kv_mask_NxS=segment_ids_NxW >= 0,
        segment_ids_NxS=segment_ids_NxW,
    )

    def gather_keys(k_LxNxKxDxW):
        nl, _, kh, d, _ = k_LxNxKxDxW.shape
        flat = jnp.transpose(k_LxNxKxDxW, (0, 2, 3, 1, 4)).reshape(nl, kh, d, rows * w)
        out = jnp.take(flat, gather_BxP, axis=3, mode="clip")  # [L, K, D, Bp, P]
        return jnp.transpose(out, (0, 3, 1, 2, 4))

    def gather_values(v_LxNxKxWxD):
        nl, _, kh, _, d = v_LxNxKxWxD.shape
        flat = jnp.transpose(v_LxNxKxWxD, (0, 2, 1, 3, 4)).reshape(nl, kh, rows * w, d)
        out = jnp.take(flat, gather_BxP, axis=2, mode="clip")  # [L, K, Bp, P, D]
        return jnp.transpose(out, (0, 2, 1, 3, 4))

    cache = kv_cache.KVCache(k=gather_keys(packed.k), v=gather_values(packed.v), split=True)
    if cache_sharding is not None:
        cache = jax.lax.with_sharding_constraint(cache, cache_sharding)
    return cache


def cache_sharding(mesh) -> jax.sharding.NamedSharding:
    """Sharding of a stacked cache [L, B, ...]: its batch axis 1 as batches are split."""
    (batch_axes,) = sharding.batch_sharding(mesh).spec
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, batch_axes))
