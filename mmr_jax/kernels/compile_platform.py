"""The platform a program is being compiled for, where traced code picks a form by platform.

Traced code that chooses by platform (the CPU decode-attention kernel, splash attention's
interpret mode, what 'auto' attention means) asks `current()`: JAX's default backend, unless a
compile for another target is under way (`compiling_for`). A dry run compiles for a TPU or a GPU
that is not there (training/aot_dry_run.py) while JAX's own backend is the host's CPU; without
this, the TPU program would get the CPU kernel's custom call and splash's interpret mode.
"""

from __future__ import annotations

import contextlib
import contextvars

import jax

_TARGET: contextvars.ContextVar[str | None] = contextvars.ContextVar("platform", default=None)


def current() -> str:
    """'cpu', 'gpu' or 'tpu': the target being compiled for, else JAX's default backend."""
    return _TARGET.get() or jax.default_backend()


@contextlib.contextmanager
def compiling_for(platform: str):
    """Traces inside the block see `platform` ('gpu' or 'tpu'; JAX's device platform names)."""
    if platform not in ("cpu", "gpu", "tpu"):
        raise ValueError(f"unknown platform {platform!r}; expected 'cpu', 'gpu' or 'tpu'")
    token = _TARGET.set(platform)
    try:
        yield
    finally:
        _TARGET.reset(token)
