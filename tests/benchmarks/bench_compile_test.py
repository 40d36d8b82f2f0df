"""`benchmarks/bench_compile.py`'s per-program compile seconds (`--programs`)."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from mmr_jax.infra import bench_harness, compile_stats


def _bench_compile():
    return bench_harness.load("bench_compile")


def test_programs_are_counted_by_name_and_build():
    programs = compile_stats.ProgramSeconds()

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


_WARM = """
import importlib.util, sys, tempfile
import jax, jax.numpy as jnp
spec = importlib.util.spec_from_file_location("bench_compile", sys.argv[1])
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)
jax.config.update("jax_compilation_cache_dir", tempfile.mkdtemp())
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
from mmr_jax.infra import compile_stats
programs, loads = compile_stats.ProgramSeconds(), compile_stats.CacheLoads()

@jax.jit
def cached(x):
    return jnp.sin(x) @ x.T

x = jnp.ones((64, 64))
cached(x).block_until_ready()
print("loads after the first build", loads.loads)
jax.clear_caches()
cached(x).block_until_ready()
row = {r["program"]: r for r in programs.since({})}["cached"]
print("loads after the second", loads.loads)
print("builds", row["builds"])
print("load within backend", 0 < loads.seconds <= row["backend"])
"""


def test_a_warm_cache_load_is_counted_and_lies_within_the_backend_event(tmp_path):
    """JAX reports a load from the on-disk cache as its own event and as the program's backend
    compile event: the benchmark counts the loads and does not add them twice."""
    script = tmp_path / "warm.py"
    script.write_text(_WARM)
    out = subprocess.run(
        [sys.executable, str(script), str(bench_harness.BENCHMARKS / "bench_compile.py")],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    ).stdout
    assert "loads after the first build 0" in out
    assert "loads after the second 1" in out
    assert "builds 2" in out  # the build and the load: one backend event each
    assert "load within backend True" in out


def test_compare_options_parses_xla_options_by_type():
    parse = _bench_compile().parse_options
    assert parse("xla_cpu_use_fusion_emitters=false, xla_backend_optimization_level=1") == {
        "xla_cpu_use_fusion_emitters": False,
        "xla_backend_optimization_level": 1,
    }
    assert parse("a=TRUE,b=0.5,c=fast") == {"a": True, "b": 0.5, "c": "fast"}
    assert parse("") == {}
    for bad in ("xla_cpu_use_fusion_emitters", "=1"):
        with pytest.raises(ValueError, match="name=value"):
            parse(bad)


def test_a_run_prints_its_top_programs_and_sums_the_rest(capsys):
    run = bench_harness.load("compile_run")  # bench_compile.py --train_run

    def program(name, builds):
        return {"program": name, "builds": builds, "trace": 0.5, "lower": 0.25, "backend": 1.0}

    out = {
        "compile_price_steps": 1.0,
        "steps": 2,
        "step_s_sum": 10.0,
        "first_step_s": 6.0,
        "compile_s": 3.0,
        "compile_parts_s": {"trace": 1.0, "lower": 0.5, "backend": 1.5},
        "compile_share": 0.3,
        "cache_loads": 0,
        "cache_load_s": 0.0,
        "packed_len": [192, 96],
        "packed_len_needed": [128, 96],
        "programs": [program("train_step", 2), program("a", 1), program("b", 3)],
    }
    run.print_run(out, top=1)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("compile_price_steps 1: 2 steps: 10.0 s of steps (first 6.0 s)")
    assert lines[0].endswith("= 30% of the step time")  # no cache loads: nothing after
    assert lines[1] == "  packed length needed -> run at: 128->192, 96->96"
    assert lines[2].split() == ["program", "builds", "trace", "s", "lower", "s", "backend", "s"]
    assert lines[3].split() == ["train_step", "2", "0.50", "0.25", "1.00"]
    assert lines[4].split() == ["2", "other", "programs", "4", "1.00", "0.50", "2.00"]
