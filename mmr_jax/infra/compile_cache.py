"""XLA's persistent compilation cache for the scripts: a step compiled once is loaded after that.

A run compiles its train step once per length bucket (about 5 s for SmolLM2 on 2 CPU cores) and
its sampler's programs once per shape (0.2-1.2 s each). With the cache on disk, a resumed run,
the next run of a study and a rerun of the README job load those executables instead of
compiling them again. The key is XLA's (the program, its compile options, the jax/jaxlib version
and the device), so a stale entry is never used.

Measured on the CPU default's 8-step run (`benchmarks/bench_compile.py --train_run=8
--programs=10`, 2026-11-26, 2 cores): cold, 21.0 s of compilation (the train step's two builds
11.0 s, the sampler's loops 7 s); a second run with the cache 5.5 s, of which 3.3 s tracing and
lowering (paid either way) and 0.6 s loading 13 programs (the train step's two builds load in
0.4 s against 9.5 s to compile).

`MMR_JAX_COMPILE_CACHE` chooses the folder (default ~/.cache/mmr_jax/xla); set it to "" (or
"off") to switch the cache off.

On a host without a GPU plugin, `enable` also asks XLA for LLVM optimisation level 1 instead of
2 (`CPU_FLAG`, added to XLA_FLAGS unless they set a level): the CPU default's train step compiled
in 23 s instead of 31 s with the same step time (4.8 s), and the sampler's decode step was
unchanged (79 against 82 ms); the matmuls are library calls either way, only the small fused
kernels are compiled less hard. Level 0 is no cheaper to compile (21.1 s against 21.0 s on the
8-step run above) and its steps ran 1.7x slower. It can only apply before JAX's backend starts.
"""

from __future__ import annotations

import os
import pathlib

ENV = "MMR_JAX_COMPILE_CACHE"
DEFAULT = pathlib.Path.home() / ".cache" / "mmr_jax" / "xla"


def folder(environ=os.environ) -> pathlib.Path | None:
    """The cache folder `MMR_JAX_COMPILE_CACHE` asks for, or None when it is switched off."""
    value = environ.get(ENV)
    if value is None:
        return DEFAULT
    if value.strip().lower() in ("", "0", "off", "none"):
        return None
    return pathlib.Path(value).expanduser()


CPU_FLAG = "--xla_backend_optimization_level=1"
# Programs that took at least this long to compile are cached. Not 1 s: the sampler's decode
# loops, compactions, prefill and MMR each compile in 0.2-1.2 s on CPU and load in a fraction of
# that; at 1 s a second run of the CPU default still compiled 7 s of them (bench_compile,
# 2026-11-26). The many eager ops under 0.1 s stay out.
MIN_COMPILE_S = 0.1
_GPU_PLUGINS = ("jax_plugins", "jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm7_plugin")


def cpu_compile_flag(environ=os.environ) -> bool:
    """Adds `CPU_FLAG` to XLA_FLAGS when no GPU plugin is installed, the flags set no optimisation
    level and the backend has not started; returns whether it did."""
    import importlib.util

    from jax._src import xla_bridge

    flags = environ.get("XLA_FLAGS", "")
    if "xla_backend_optimization_level" in flags or xla_bridge.backends_are_initialized():
        return False
    if any(importlib.util.find_spec(name) is not None for name in _GPU_PLUGINS):
        return False
    environ["XLA_FLAGS"] = f"{flags} {CPU_FLAG}".strip()
    return True


def enable(environ=os.environ, *, min_compile_s: float = MIN_COMPILE_S) -> pathlib.Path | None:
    """Points JAX's persistent cache at `folder()` (programs compiling >= `min_compile_s`), and
    applies `cpu_compile_flag`."""
    import jax

    cpu_compile_flag(environ)

    path = folder(environ)
    if path is None:
        return None
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", min_compile_s)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path
