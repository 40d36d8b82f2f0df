"""The compile-only environments for tests: which plugin is installed, and a fixture that keeps
JAX's backend on the CPU while a module compiles for accelerators that are not there.

Without a target's plugin a test is skipped with the reason, except where the environment
variable MMR_JAX_AOT_PLATFORMS names the platform ("tpu", "cuda" or both, comma-separated): .ci/run
sets it when it runs the compile-only tests inside .venv-aot-tpu / .venv-aot-gpu
(scripts/setup_aot_env.sh builds them), so that a venv without its plugin fails there. The slow
tests that start those venvs' python themselves (tests/training/aot_dry_run_test.py) fail under
CI=true when the venv is missing, as tests/rollout/vllm_server_test.py does for the vLLM
server's."""

from __future__ import annotations

import importlib.util
import os

import pytest

PLUGIN_MODULES = {"cuda": "jax_plugins.xla_cuda12", "tpu": "libtpu"}
VENVS = {"cuda": ".venv-aot-gpu", "tpu": ".venv-aot-tpu"}


def has_plugin(platform: str) -> bool:
    try:
        return importlib.util.find_spec(PLUGIN_MODULES[platform]) is not None
    except ModuleNotFoundError:
        return False


def require_plugin(platform: str) -> None:
    """Skips the calling test without `platform`'s plugin (fails where it is required)."""
    if has_plugin(platform):
        return
    why = (
        f"no {platform} compile-only plugin in this venv: run with {VENVS[platform]}/bin/python "
        "(scripts/setup_aot_env.sh builds it)"
    )
    required = os.environ.get("MMR_JAX_AOT_PLATFORMS", "").split(",")
    if platform in required:
        pytest.fail(f"MMR_JAX_AOT_PLATFORMS requires it: {why}")
    pytest.skip(why)


@pytest.fixture(scope="module")
def cpu_backend_for_aot():
    """`aot_targets.prepare_jax` for the module (JAX on the CPU, the CUDA plugin's device check
    off), put back after it for the conftest's global-state guard."""
    import jax

    from mmr_jax.infra import aot_targets

    env_before = {name: os.environ.get(name) for name in aot_targets.PLUGIN_ENV}
    platforms_before = jax.config.values["jax_platforms"]
    aot_targets.prepare_jax()
    yield
    jax.config.update("jax_platforms", platforms_before)
    for name, value in env_before.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
