"""Process-wide state a test can leave changed for the tests after it (tests/conftest.py's guard).

What the guard compares: the working directory, the environment variables that configure JAX,
XLA, this package, the hub and the scripts the tests start (`GUARDED_ENV`), and every
`jax.config` value. A test or fixture that changes one must restore it (monkeypatch, a context
manager); otherwise a later test on the same pytest worker runs under it, and passes or fails
depending on the order the tests ran in.

    before = global_state.snapshot()
    ...
    changed = global_state.restore(before)  # ['env XLA_FLAGS: ... -> ...', ...]; [] if none
"""

from __future__ import annotations

import os
import sys

# Environment variables (names starting so) read by JAX/XLA, by mmr_jax and its scripts, or by
# the hub libraries.
GUARDED_ENV = ("JAX_", "XLA_", "MMR_JAX_", "HF_", "TRANSFORMERS_", "PYTHONPATH", "CUDA_")


def snapshot() -> dict:
    """{'cwd': str, 'env': {name: value}, 'jax': {option: value} (empty before jax is imported)}."""
    jax = sys.modules.get("jax")
    return {
        "cwd": os.getcwd(),
        "env": {k: v for k, v in os.environ.items() if k.startswith(GUARDED_ENV)},
        "jax": dict(jax.config.values) if jax is not None else {},
    }


def differences(before: dict, after: dict) -> list[str]:
    """One line per value that differs between two snapshots ([] when none)."""
    out = []
    if before["cwd"] != after["cwd"]:
        out.append(f"cwd: {before['cwd']} -> {after['cwd']}")
    for name in sorted(before["env"].keys() | after["env"].keys()):
        a, b = before["env"].get(name), after["env"].get(name)
        if a != b:
            out.append(f"env {name}: {a!r} -> {b!r}")
    if before["jax"]:  # options compared once jax was imported before
        for name in sorted(before["jax"].keys() & after["jax"].keys()):
            a, b = before["jax"][name], after["jax"][name]
            if a != b:
                out.append(f"jax.config {name}: {a!r} -> {b!r}")
    return out


def restore(before: dict) -> list[str]:
    """Sets everything back to `before`; returns what had changed (`differences`)."""
    after = snapshot()
    changed = differences(before, after)
    if not changed:
        return []
    if after["cwd"] != before["cwd"]:
        os.chdir(before["cwd"])
    for name in after["env"].keys() - before["env"].keys():
        del os.environ[name]
    os.environ.update(before["env"])
    if before["jax"]:
        import jax

        for name, value in before["jax"].items():
            if after["jax"].get(name, value) != value:
                try:
                    jax.config.update(name, value)
                except (RuntimeError, ValueError) as e:  # e.g. a device count once JAX started
                    changed.append(f"jax.config {name}: not restored ({e})")
    return changed
