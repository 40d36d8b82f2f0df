"""The guard of tests/conftest.py: what a test leaves changed is found and put back."""

import os

import jax

from support import global_state


def test_a_changed_env_var_jax_option_and_cwd_are_reported_and_restored(tmp_path):
    before = global_state.snapshot()
    cwd, xla = os.getcwd(), os.environ.get("XLA_FLAGS")
    promotion = jax.config.jax_numpy_rank_promotion
    other = "warn" if promotion != "warn" else "allow"
    try:
        os.environ["XLA_FLAGS"] = "--xla_test_guard_flag"
        os.environ["MMR_JAX_GUARD_TEST"] = "1"
        jax.config.update("jax_numpy_rank_promotion", other)
        os.chdir(tmp_path)
        changed = global_state.restore(before)
        assert changed == [
            f"cwd: {cwd} -> {tmp_path}",
            "env MMR_JAX_GUARD_TEST: None -> '1'",
            f"env XLA_FLAGS: {xla!r} -> '--xla_test_guard_flag'",
            f"jax.config jax_numpy_rank_promotion: {promotion!r} -> {other!r}",
        ]
        assert os.getcwd() == cwd and os.environ.get("XLA_FLAGS") == xla
        assert "MMR_JAX_GUARD_TEST" not in os.environ
        assert jax.config.jax_numpy_rank_promotion == promotion
        assert global_state.restore(before) == []  # nothing left to put back
    finally:  # whatever the asserts found, the guard of this very test must see nothing
        global_state.restore(before)


def test_unguarded_env_vars_are_ignored():
    before = global_state.snapshot()
    os.environ["SOME_TOOL_SETTING_FOR_THE_GUARD_TEST"] = "x"
    try:
        assert global_state.differences(before, global_state.snapshot()) == []
    finally:
        del os.environ["SOME_TOOL_SETTING_FOR_THE_GUARD_TEST"]
