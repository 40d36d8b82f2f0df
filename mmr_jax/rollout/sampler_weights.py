"""The weights the sampler reads.

Matmuls. On CPU the decode loop runs every linear layer weight-major, W @ x^T on kernels
transposed to [out, in] once per call (`weight_major`, `layers.weight_major_matmul`): XLA:CPU's
matmul packs its right-hand operand every call, which in the plain x @ W is all the weights (SmolLM2
8 x 4: a decode step 116 -> 90 ms). The copy lasts the call; other platforms keep x @ W.

Weights. The prefill and the decode loop read the weights in the compute dtype, cast once per
weight version (`sampling_weights`; the engine keeps the copy between weight syncs), not at
every step. The decode step's layer scan only reads the KV caches and writes every layer's new
slot once after it (`Decoder.forward_cached_shared_prompt`): the caches, carried by the while
loop, are updated in place, never copied (tests/rollout/decode_inplace_test.py checks the compiled
HLO).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx


def weight_major(state) -> bool:
    """Whether the decode loop runs its matmuls weight-major: on CPU, where XLA's matmul packs its
    right-hand operand (the weights, in the plain x @ W) on every call
    (`layers.weight_major_matmul`; SmolLM2 8 x 4: linear layers 104 -> 70 ms a step). It takes a
    transposed copy of the weights for the call, so accelerators, where it would not pay for the
    memory, keep the plain form."""
    leaf = jax.tree.leaves(state)[0]
    return all(d.platform == "cpu" for d in leaf.devices())


def sampling_weights(model: nnx.Module) -> nnx.State:
    """`model`'s state with every floating-point array in its compute dtype (`model.dtype`).

    The decoder casts its fp32 master weights to the compute dtype where it uses them; in the
    decode loop that was a cast of every weight at every step (12% of the 1.5B decode step's
    device time on an H200, issue 35). Sampling from this copy, made once per weight version
    (`EmbeddedEngine` keeps it until the next `sync_weights`), the casts in the step are no-ops
    and every value is the same (a cast commutes with the gather and matmul operands it feeds).
    When the compute dtype is the storage dtype this is the model's own state, not a copy.
    """
    state = nnx.state(model)
    dtype = getattr(model, "dtype", None)
    if dtype is None or all(
        x.dtype == dtype or not jnp.issubdtype(x.dtype, jnp.floating)
        for x in jax.tree.leaves(state)
    ):
        return state
    return _cast_floating(state, jnp.dtype(dtype))


@functools.partial(jax.jit, static_argnames=("dtype",))
def _cast_floating(state, dtype):
    """Floating-point leaves cast to `dtype` (on their devices, with their shardings)."""
    cast = lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x
    return jax.tree.map(cast, state)


@functools.partial(jax.jit, static_argnames=("graphdef",))
def weight_major_kernels(graphdef, state):
    """`Decoder.weight_major_kernels` as the outputs of a jit, so laid out [out, in] in memory."""
    return nnx.merge(graphdef, state).weight_major_kernels()
