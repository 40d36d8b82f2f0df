"""`scripts/bench_compile.py`'s per-program compile seconds (`--programs`)."""

import importlib.util

import jax
import jax.numpy as jnp

from support import testing


def _bench_compile():
    spec = importlib.util.spec_from_file_location(
        "bench_compile", testing.REPO / "scripts/bench_compile.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_programs_are_counted_by_name_and_build():
    programs = _bench_compile().ProgramSeconds()

    @jax.jit
    def counted_twice(x):
        return jnp.sin(x) * 2

    @jax.jit
    def built_before(x):
        return x + 1

    built_before(jnp.ones(3)).block_until_ready()
    before = programs.snapshot()
    counted_twice(jnp.ones(3)).block_until_ready()
    counted_twice(jnp.ones(4)).block_until_ready()  # a new shape: a second build
    counted_twice(jnp.ones(4)).block_until_ready()  # already built: no event
    built_before(jnp.ones(3)).block_until_ready()

    rows = {r["program"]: r for r in programs.since(before)}
    assert rows["counted_twice"]["builds"] == 2
    assert rows["counted_twice"]["backend"] > 0
    assert rows["counted_twice"]["total"] == sum(
        rows["counted_twice"][k] for k in ("trace", "lower", "backend")
    )
    assert "built_before" not in rows  # built before the snapshot, not since
    everything = {r["program"] for r in programs.since({})}
    assert {"counted_twice", "built_before"} <= everything
