"""What libtpu's cost model (`compiled.cost_analysis()`) says about a program, and why the dry
run's `optimal_seconds` is not a train step's time (docs/performance.md, "Will it fit?").

Two properties of the TPU compiler's estimate, each shown on a program small enough to know the
answer by hand, compiled for one v5p chip:
- it sums its ops once per appearance in the HLO: a loop's body counts once, whatever the trip
  count (8 matmuls in a `scan` cost what one does; unrolled, eight). Every program of a run has
  loops (the scanned layers, the minibatches, the decode loop);
- an additive scatter into two indexed dimensions (`x.at[rows, cols].add`, the gradient of the
  log-prob's `take_along_axis`) adds -2 s: three of them, -6 s. So the train step's total is
  negative, and `compiled_dry_run.measure` reports no estimate for it (None) rather than a
  negative time; a plain program keeps the compiler's positive figure.

If a libtpu release changes either, these fail, and the docs' reading of the figure is due a
revision. Slow; run inside the TPU compile-only venv:

    .venv-aot-tpu/bin/python -m pytest tests/training/tpu_cost_model_test.py --runslow -m slow
"""

from __future__ import annotations

import pytest

from support import aot

pytestmark = pytest.mark.slow
cpu_backend_for_aot = aot.cpu_backend_for_aot  # the module's fixture
N = 1024


@pytest.fixture(scope="module")
def compile_cost(cpu_backend_for_aot):
    """f, argument shapes -> (cost_analysis dict, Compiled figures) on one v5p chip."""
    aot.require_plugin("tpu")
    import jax
    import jax.numpy as jnp

    from mmr_jax.infra import aot_targets
    from mmr_jax.training import compiled_dry_run

    device = aot_targets.compile_only_devices(aot_targets.parse_target("v5p:2x2x1"))[0]
    mesh = jax.sharding.Mesh([device], ("x",))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

    def run(f, *shapes):
        args = [jax.ShapeDtypeStruct(s, d, sharding=replicated) for s, d in shapes]
        figures, compiled = compiled_dry_run.measure(f.__name__, jax.jit(f), *args)
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, list | tuple) else cost
        return {k: float(v) for k, v in cost.items()}, figures

    run.jnp, run.jax = jnp, jax
    return run


def _matmuls(compile_cost, *, scanned: bool):
    jnp, jax = compile_cost.jnp, compile_cost.jax

    def layers(a, w):
        if scanned:
            return jax.lax.scan(lambda c, _: (jnp.tanh(c @ w), None), a, None, length=8)[0]
        for _ in range(8):
            a = jnp.tanh(a @ w)
        return a

    return compile_cost(layers, ((N, N), jnp.bfloat16), ((N, N), jnp.bfloat16))


def test_a_loop_body_counts_once(compile_cost):
    one_matmul = 2 * N**3
    scanned, _ = _matmuls(compile_cost, scanned=True)
    unrolled, _ = _matmuls(compile_cost, scanned=False)
    # flops: the scan's are one matmul's (and the tanh); unrolled, eight
    assert scanned["flops"] == pytest.approx(one_matmul, rel=0.01)
    assert unrolled["flops"] == pytest.approx(8 * one_matmul, rel=0.01)
    # time: counted 8 times the scan would cost about what the unrolled program does; counted
    # once, an eighth of it and the loop's own overhead (3.7x less at N = 1024, 6.2x at 4096)
    assert 0 < scanned["optimal_seconds"] < unrolled["optimal_seconds"] / 3


def _scatter_adds(compile_cost, count: int, *, add: bool = True):
    jnp = compile_cost.jnp

    def scatters(a, cols):
        rows = jnp.arange(a.shape[0])[:, None]
        for j in range(count):
            a = a.at[rows, cols + j].add(1.0) if add else a.at[rows, cols + j].set(1.0)
        return a

    return compile_cost(scatters, ((N, N), jnp.float32), ((N, 16), jnp.int32))


@pytest.mark.parametrize("count", [1, 3])
def test_each_scatter_add_counts_minus_two_seconds(compile_cost, count):
    cost, figures = _scatter_adds(compile_cost, count)
    # the ops' own estimate is tens of microseconds; the rest is -2 s a scatter-add
    assert cost["optimal_seconds"] == pytest.approx(-2.0 * count, abs=0.01)
    assert figures.optimal_seconds is None  # the dry run reports no negative time
    assert figures.flops == cost["flops"] > 0


def test_a_scatter_that_sets_keeps_a_positive_estimate(compile_cost):
    cost, figures = _scatter_adds(compile_cost, 1, add=False)
    assert 0 < cost["optimal_seconds"] < 0.01
    assert figures.optimal_seconds == cost["optimal_seconds"]
