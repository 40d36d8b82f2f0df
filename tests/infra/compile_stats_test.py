"""CompileClock sums JAX's own trace / lower / backend-compile events."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mmr_jax.infra import compile_stats


def test_a_new_program_counts_and_a_cached_call_does_not():
    clock = compile_stats.CompileClock().start()
    clock.lap()

    @jax.jit
    def f(x):
        return jnp.sin(x) @ x.T

    f(jnp.ones((8, 8))).block_until_ready()
    first = clock.lap()
    assert first["backend"] > 0 and first["trace"] > 0 and first["lower"] > 0
    assert first["total"] == first["trace"] + first["lower"] + first["backend"]
    f(jnp.ones((8, 8))).block_until_ready()  # same shapes: no new program
    assert clock.lap()["total"] == 0.0
    f(jnp.ones((4, 4))).block_until_ready()  # a new shape compiles again
    assert clock.lap()["backend"] > 0
