"""The adaptive entropy coefficient: the update rule on hand values, and its place in the state."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from mmr_jax.algorithms import entropy_control
from mmr_jax.step import train_step
from mmr_jax.training import checkpoint

jax.config.update("jax_numpy_rank_promotion", "raise")

CONTROL = entropy_control.Control(target=0.2, step=0.005, low=0.0, high=0.01)


class TestUpdate:
    @pytest.mark.parametrize(
        "coef,entropy,expected",
        [
            (0.003, 0.1, 0.008),  # below the target: + step
            (0.003, 0.35, 0.0),  # above: - step, clamped at the lower bound 0
            (0.008, 0.1, 0.01),  # + step, clamped at the upper bound
            (0.007, 0.3, 0.002),  # above: - step
            (0.004, 0.2, 0.004),  # on the target: unchanged
        ],
    )
    def test_hand_values(self, coef, entropy, expected):
        got = entropy_control.update(jnp.float32(coef), jnp.float32(entropy), CONTROL)
        assert got.dtype == jnp.float32 and got.shape == ()
        np.testing.assert_allclose(float(got), expected, atol=1e-9)

    def test_jit_and_walk(self):
        # Ten steps below the target from 0 climb 0.005 a step to the bound 0.01 and stay.
        fn = jax.jit(lambda c, h: entropy_control.update(c, h, CONTROL))
        coef, path = jnp.float32(0.0), []
        for _ in range(4):
            coef = fn(coef, jnp.float32(0.05))
            path.append(float(coef))
        np.testing.assert_allclose(path, [0.005, 0.01, 0.01, 0.01], atol=1e-9)


class TestCheckpointed:
    def _state(self, coef):
        params = {"w": jnp.ones((2, 3))}
        return train_step.TrainState(
            step=jnp.int32(3),
            params=params,
            opt_state=optax.sgd(1.0).init(params),
            rng=jax.random.key_data(jax.random.key(0)),
            entropy_coef=None if coef is None else jnp.float32(coef),
        )

    def test_resumed_run_continues_with_its_coefficient(self, tmp_path):
        ck = checkpoint.Checkpointer(tmp_path / "ck", keep=2)
        ck.save(3, checkpoint.state_tree(self._state(0.0125)), {"step": 3})
        ck.wait()
        fresh = self._state(0.0)  # what a restarted run builds: the configured start
        tree, _ = ck.restore(checkpoint.state_tree(fresh))
        restored = train_step.TrainState(**tree)  # as trainer.py rebuilds it
        assert float(restored.entropy_coef) == np.float32(0.0125)
        ck.close()

    def test_fixed_coefficient_keeps_the_old_tree(self):
        # Without adaptation the saved tree is the one before issue 47 (old checkpoints restore).
        assert set(checkpoint.state_tree(self._state(None))) == {
            "step",
            "params",
            "opt_state",
            "rng",
        }
