"""The persistent XLA compilation cache the scripts switch on (`mmr_jax.infra.compile_cache`)."""

import pathlib
import textwrap

from mmr_jax.infra import compile_cache

from support import testing


def test_folder_from_the_environment(tmp_path):
    assert compile_cache.folder({}) == compile_cache.DEFAULT
    assert compile_cache.folder({compile_cache.ENV: str(tmp_path)}) == tmp_path
    for off in ("", "off", "0", "None"):
        assert compile_cache.folder({compile_cache.ENV: off}) is None


_COMPILE = textwrap.dedent(
    """
    import logging, os, time
    import jax, jax.numpy as jnp
    from mmr_jax.infra import compile_cache
    hits = []
    class Hits(logging.Handler):
        def emit(self, record):
            if "cache hit" in record.getMessage().lower():
                hits.append(record.getMessage())
    logging.getLogger("jax._src.compilation_cache").addHandler(Hits())
    logging.getLogger("jax._src.compiler").addHandler(Hits())
    logging.getLogger("jax._src.compiler").setLevel(logging.DEBUG)
    logging.getLogger("jax._src.compilation_cache").setLevel(logging.DEBUG)
    print("FOLDER", compile_cache.enable(min_compile_s=0.0))

    def f(x):
        for i in range(40):
            x = jnp.sin(x @ x.T + i)
        return x

    out = jax.jit(f)(jnp.ones((64, 64)))
    print("VALUE", float(out.sum()), "HITS", len(hits))
    """
)


def test_a_second_process_loads_the_compiled_program(tmp_path):
    env = {compile_cache.ENV: str(tmp_path / "xla")}
    first = testing.run_in_fresh_jax(_COMPILE, env=env)
    assert first.returncode == 0, first.stderr[-2000:]
    assert f"FOLDER {tmp_path / 'xla'}" in first.stdout
    entries = [p for p in pathlib.Path(tmp_path / "xla").rglob("*") if p.is_file()]
    assert entries, "nothing was written to the cache"
    second = testing.run_in_fresh_jax(_COMPILE, env=env)
    assert second.returncode == 0, second.stderr[-2000:]
    value = lambda out: out.split("VALUE ")[1].split()[0]
    assert value(second.stdout) == value(first.stdout)  # the loaded program computes the same
    assert "HITS 0" in first.stdout and "HITS 0" not in second.stdout


def test_off_writes_nothing(tmp_path):
    out = testing.run_in_fresh_jax(_COMPILE, env={compile_cache.ENV: "off"}, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "FOLDER None" in out.stdout


_FLAG = textwrap.dedent(
    """
    import os
    import jax, jax.numpy as jnp
    from mmr_jax.infra import compile_cache
    print("ADDED", compile_cache.cpu_compile_flag())
    print("FLAGS", os.environ.get("XLA_FLAGS", ""))
    print("VALUE", float(jax.jit(lambda x: jnp.sin(x).sum())(jnp.ones(8))))  # XLA took the flags
    print("AFTER", compile_cache.cpu_compile_flag())  # the backend runs: too late to add it
    """
)


def test_cpu_compile_flag_before_the_backend_starts():
    out = testing.run_in_fresh_jax(_FLAG, env={"XLA_FLAGS": "--xla_cpu_enable_fast_math=false"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert "ADDED True" in out.stdout and "AFTER False" in out.stdout
    assert f"FLAGS --xla_cpu_enable_fast_math=false {compile_cache.CPU_FLAG}\n" in out.stdout
    # A level the user chose is kept.
    mine = "--xla_backend_optimization_level=3"
    out = testing.run_in_fresh_jax(_FLAG, env={"XLA_FLAGS": mine})
    assert out.returncode == 0, out.stderr[-2000:]
    assert "ADDED False" in out.stdout and f"FLAGS {mine}\n" in out.stdout
