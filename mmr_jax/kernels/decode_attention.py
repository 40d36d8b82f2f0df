"""The sampler's decode attention as a C++ kernel on CPU (`decode_attention.cc`), built on use.

`attend_shared_prompt` computes what `attention.attend_shared_prompt` computes (that function is
the reference; tests hold the two to 1e-5), but reads only the prompt slots between each
prompt's first and last unmasked slot and the rows' first `own_len` own slots, where XLA's static
shapes read all P + S and mask the rest. With left-padded prompts and a cache that fills one slot
a step that is about half the attention's memory traffic.

Build: g++ (or $CXX) compiles the source against XLA's FFI headers (`jax.ffi.include_dir()`)
with -march=native into a cache folder ($MMR_JAX_CACHE, else $XDG_CACHE_HOME/mmr_jax, else
~/.cache/mmr_jax), keyed by the source, the flags, the compiler, jax's version and this CPU's
feature flags, so a shared home folder never hands one CPU another's binary. No compiler, a
failed build or MMR_JAX_CPU_KERNELS=0: `available()` is False (with one warning saying why) and
the decoder keeps the pure-JAX attention.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import pathlib
import platform
import shutil
import subprocess
import tempfile

import jax
import jax.numpy as jnp
from absl import logging

from mmr_jax.kernels import compile_platform

TARGET = "mmr_decode_attention"
SOURCE = pathlib.Path(__file__).with_name("decode_attention.cc")
FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fopenmp-simd", "-std=c++17")
FLAGS += ("-shared", "-fPIC", "-Wno-attributes", "-Wno-return-type")
ENV_SWITCH = "MMR_JAX_CPU_KERNELS"


def cache_dir() -> pathlib.Path:
    root = os.environ.get("MMR_JAX_CACHE")
    if root:
        return pathlib.Path(root) / "kernels"
    xdg = os.environ.get("XDG_CACHE_HOME") or str(pathlib.Path.home() / ".cache")
    return pathlib.Path(xdg) / "mmr_jax" / "kernels"


def _cpu_features() -> str:
    """This CPU's feature flags (what -march=native compiles for)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _build(compiler: str) -> pathlib.Path:
    """The compiled library, from the cache or built now (atomically: parallel builds are safe)."""
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, check=True
    ).stdout.splitlines()[0]
    key = hashlib.sha256(
        "\n".join(
            [SOURCE.read_text(), " ".join(FLAGS), version, jax.__version__, _cpu_features()]
        ).encode()
    ).hexdigest()[:16]
    out = cache_dir() / f"decode_attention-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        lib = pathlib.Path(tmp) / out.name
        cmd = [compiler, *FLAGS, f"-I{jax.ffi.include_dir()}", str(SOURCE), "-o", str(lib)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
        os.replace(lib, out)
    return out


def usable() -> bool:
    """Whether to use the kernel: the platform compiled for (`compile_platform.current()`: JAX's
    default backend, unless a dry run compiles for an accelerator) is the CPU, and `available()`.

    The platform is checked first, so nothing is compiled (no g++ run) on a GPU or TPU host.
    """
    return compile_platform.current() == "cpu" and available()


@functools.cache
def available() -> bool:
    """Whether the kernel is built, loaded and registered with XLA for the CPU platform."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return False
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        logging.warning("no C++ compiler: the sampler uses the pure-JAX decode attention")
        return False
    try:
        lib = ctypes.cdll.LoadLibrary(str(_build(compiler)))
        handler = jax.ffi.pycapsule(lib.MmrDecodeAttention)
        jax.ffi.register_ffi_target(TARGET, handler, platform="cpu")
    except (OSError, RuntimeError, subprocess.CalledProcessError) as e:
        logging.warning("CPU decode-attention kernel unavailable (%s); using pure JAX", e)
        return False
    return True


def attend_shared_prompt(
    q_NxTxHxD, pk_LxBxKxDxP, pv_LxBxKxPxD, k_LxNxKxDxS, v_LxNxKxSxD, pmask, own_len, layer
):
    """`attention.attend_shared_prompt` of layer `layer` of the stacked caches, with own slots
    [0, own_len) valid; CPU, fp32, T = 1 only.

    own_len (in [1, S]) and layer (in [0, L)) are traced int32 scalars: the kernel reads that
    layer of the stacked buffers where they lie, so the decoder's scan over layers passes its
    carried cache without a per-layer copy. Returns [N, 1, H*D] fp32.
    """
    r, t, nh, d = q_NxTxHxD.shape
    out = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((r, t, nh, d), jnp.float32))(
        q_NxTxHxD.astype(jnp.float32),
        pk_LxBxKxDxP,
        pv_LxBxKxPxD,
        k_LxNxKxDxS,
        v_LxNxKxSxD,
        pmask.astype(jnp.bool_),
        jnp.asarray(own_len, jnp.int32).reshape(1),
        jnp.asarray(layer, jnp.int32).reshape(1),
    )
    return out.reshape(r, t, nh * d)
