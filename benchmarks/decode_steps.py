"""The decode steps `bench_decode_step.py` times: `decode_loop`, a jitted run of `steps` KV-cache
decode steps of the sampler's model as the sampler's while loop runs them
(`forward_cached_shared_prompt` against a shared prompt cache and the rows' own cache, then a draw
at temperature 0.7), weight-major or plain x @ W; and `pass_q_through`, what the attention is
replaced by for the 'no attention' row.
"""

from __future__ import annotations

import functools

import numpy as np


def decode_loop(
    model,
    prompts: int,
    n: int,
    prompt_slots: int,
    new_slots: int,
    steps: int,
    fill: float,
    weight_major: bool = True,
):
    """A jitted run of `steps` decode steps as the sampler runs them (+ a draw at T = 0.7).

    `weight_major`: the linear layers on kernels transposed outside the jit, as the sampler does
    on CPU (`sampler_weights.weight_major`); False: plain x @ W.

    The own cache is donated and handed back, so no call copies it (the sampler makes it inside
    its jit); the timed steps write own slots from the middle of the cache on.
    """
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from mmr_jax.models import kv_cache
    from mmr_jax.rollout import sampler_weights, sampling

    rows = prompts * n
    graphdef, state = nnx.split(model)
    # Non-zero keys, so the softmax is a real one.
    prompt_cache = jax.tree.map(
        lambda a: a + 0.01, kv_cache.split(model.init_cache(prompts, prompt_slots))
    )
    cache = jax.tree.map(lambda a: a + 0.01, kv_cache.split(model.init_cache(rows, new_slots)))
    start = (new_slots - steps) // 2  # own slots written: about half, on average over the steps
    filled = max(1, round(fill * prompt_slots))
    prompt_mask = np.arange(prompt_slots)[None, :] >= prompt_slots - filled
    prompt_mask = np.repeat(prompt_mask & (np.arange(prompt_slots) < prompt_slots - 1), prompts, 0)

    kernels_t = sampler_weights.weight_major_kernels(graphdef, state) if weight_major else None

    @functools.partial(jax.jit, donate_argnums=2)
    def loop(state, prompt_cache, cache, kernels_t):
        m = nnx.merge(graphdef, state)
        keys = jax.random.split(jax.random.key(0), rows)

        def body(t, carry):
            cache, tok = carry
            pos = jnp.full((rows, 1), prompt_slots + start, jnp.int32) + t
            logits, cache = m.forward_cached_shared_prompt(
                tok,
                pos,
                prompt_cache,
                cache,
                write_index=start + t,
                prompt_mask_BxP=prompt_mask,
                kernels_t=kernels_t,
            )
            nxt, _ = sampling.sample_step(
                logits[:, 0], keys, 0.7, 0, 1.0, greedy=False, use_filter=False
            )
            return cache, nxt[:, None]

        init = (cache, jnp.ones((rows, 1), jnp.int32))
        return jax.lax.fori_loop(0, steps, body, init)

    carry = [cache]

    def run():
        carry[0], tok = loop(state, prompt_cache, carry[0], kernels_t)
        tok.block_until_ready()

    return run


def pass_q_through(q_NxTxHxD, *unused):
    """Stands in for the attention over the cache: q itself, heads merged ([N, T, H * D])."""
    del unused
    return q_NxTxHxD.reshape(q_NxTxHxD.shape[0], q_NxTxHxD.shape[1], -1)
