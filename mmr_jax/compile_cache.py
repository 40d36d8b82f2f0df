"""XLA's persistent compilation cache for the scripts: a step compiled once is loaded after that.

A run compiles its train step once per length bucket and its sampler once per shape (15-20 s
each for SmolLM2 on 2 CPU cores). With the cache on disk, a resumed run, the next run of a study
and a rerun of the README job load those executables instead of compiling them again. The key
is XLA's (the program, its compile options, the jax/jaxlib version and the device), so a stale
entry is never used.

`MMR_JAX_COMPILE_CACHE` chooses the folder (default ~/.cache/mmr_jax/xla); set it to "" (or
"off") to switch the cache off.
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


def enable(environ=os.environ, *, min_compile_s: float = 1.0) -> pathlib.Path | None:
    """Points JAX's persistent cache at `folder()` (programs compiling >= `min_compile_s`)."""
    import jax

    path = folder(environ)
    if path is None:
        return None
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", min_compile_s)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path
