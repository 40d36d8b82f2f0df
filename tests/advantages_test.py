"""Tests for mmr_jax.algorithms.advantages against hand-worked values."""

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized

from mmr_jax.algorithms import advantages

jax.config.update("jax_numpy_rank_promotion", "raise")


class GrpoAdvantagesTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_hand_worked(self):
        # r = [1, 0, 0, 1]: mean 0.5; sum of squared deviations 4 * 0.25 = 1.
        # ddof=1: std = sqrt(1/3); ddof=0: std = sqrt(1/4) = 0.5.
        r = jnp.array([[1.0, 0.0, 0.0, 1.0]])
        for ddof, std in ((1, math.sqrt(1 / 3)), (0, 0.5)):
            fn = self.variant(lambda r, ddof=ddof: advantages.grpo_advantages(r, ddof=ddof))
            a = 0.5 / (std + 1e-4)
            np.testing.assert_allclose(fn(r), [[a, -a, -a, a]], rtol=1e-6)

    def test_eps(self):
        # r = [2, 0], ddof 0: std 1, A = +-1 / (1 + eps).
        got = jax.jit(advantages.grpo_advantages, static_argnames="ddof")(
            jnp.array([2.0, 0.0]), ddof=0, eps=0.5
        )
        np.testing.assert_allclose(got, [1 / 1.5, -1 / 1.5], rtol=1e-6)

    def test_masked_ragged_group(self):
        # Valid [3, 1, 2] (9 masked): mean 2, squared deviations 1 + 1 + 0 = 2, ddof 1 -> std 1.
        r = jnp.array([3.0, 9.0, 1.0, 2.0])
        mask = jnp.array([True, False, True, True])
        got = jax.jit(advantages.grpo_advantages)(r, mask=mask, eps=0.0)
        np.testing.assert_allclose(got, [1.0, 0.0, -1.0, 0.0], rtol=1e-6)

    @parameterized.named_parameters(
        ("all_equal", [[0.3] * 6], None),
        ("group_of_one_ddof1", [[0.7]], None),
        ("single_valid", [[0.1, 5.0, 2.0]], [[False, True, False]]),
        ("fully_masked", [[1.0, 2.0, 3.0]], [[False] * 3]),
    )
    def test_degenerate_groups_give_exact_zeros(self, r, mask):
        r = jnp.asarray(r)
        mask = None if mask is None else jnp.asarray(mask)
        for fn in (advantages.grpo_advantages, advantages.dr_grpo_advantages):
            got = jax.jit(fn)(r, mask=mask)
            np.testing.assert_array_equal(got, np.zeros(r.shape))
        g = jax.jit(jax.grad(lambda x: advantages.grpo_advantages(x, mask=mask).sum()))(r)
        assert np.all(np.isfinite(g))


class DrGrpoAdvantagesTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_hand_worked(self):
        # Group 0: mean 2 -> [-1, 0, 1]. Group 1: valid [4, 0], mean 2 -> [2, 0(masked), -2].
        r = jnp.array([[1.0, 2.0, 3.0], [4.0, 7.0, 0.0]])
        mask = jnp.array([[True] * 3, [True, False, True]])
        got = self.variant(lambda r, m: advantages.dr_grpo_advantages(r, mask=m))(r, mask)
        np.testing.assert_array_equal(got, [[-1.0, 0.0, 1.0], [2.0, 0.0, -2.0]])


class HasVarianceTest(chex.TestCase):
    def test_predicate(self):
        r = jnp.array(
            [[1.0, 1.0, 1.0], [0.0, 1.0, 0.0], [1.0, 0.0, 1.0], [1.0, 0.0, 1.0], [2.0, 2.0, 2.0]]
        )
        mask = jnp.array(
            [[True] * 3, [True] * 3, [True, False, True], [False] * 3, [True, True, True]]
        )
        got = jax.jit(advantages.has_variance)(r, mask=mask)
        np.testing.assert_array_equal(got, [False, True, False, False, False])


class UniformGroupGuardTest(chex.TestCase):
    def test_mask_by_hand(self):
        r = jnp.array([[1.0, 1.0, 1.0], [0.0, 1.0, 0.0], [1.0, 0.0, 1.0], [0.5, 0.5, 2.0]])
        mask = jnp.array([[True] * 3, [True] * 3, [True, False, True], [True, True, False]])
        got = jax.jit(advantages.varying_groups_mask)(r, mask=mask)
        # Row 2: its valid rewards are equal (the 0 is masked); row 3 likewise (2.0 is masked).
        want = [[False] * 3, [True] * 3, [False] * 3, [False] * 3]
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(advantages.varying_groups_mask(r[1:2]), [[True] * 3])

    def _case(self):
        rng = np.random.default_rng(0)
        r = np.array([[1, 1, 1, 1], [0, 0, 0, 0], [1, 0, 0, 1]], np.float32)
        return r, rng.normal(size=(3, 4, 8)).astype(np.float32)

    def test_mmr_gives_uniform_groups_advantage_and_the_guard_zeroes_it(self):
        from mmr_jax.algorithms import mmr

        r, e = self._case()
        plain = advantages.grpo_advantages(mmr.reweight("mmr", r, e))
        # The mechanism of the first study: MMR's redundancy term separates the completions of
        # a uniform group, and the normalisation scales that up to unit-size advantages.
        assert np.abs(np.asarray(plain)[:2]).mean() > 0.3
        keep = advantages.varying_groups_mask(r)
        guarded = advantages.grpo_advantages(mmr.reweight("mmr", r, e, mask=keep), mask=keep)
        np.testing.assert_array_equal(np.asarray(guarded)[:2], 0.0)
        # Where rewards differ the guard changes nothing in group scope.
        np.testing.assert_allclose(np.asarray(guarded)[2], np.asarray(plain)[2], rtol=1e-6)

    def test_batch_scope_reweights_only_the_varying_groups(self):
        from mmr_jax.algorithms import mmr

        r, e = self._case()
        keep = advantages.varying_groups_mask(r)
        got = np.asarray(mmr.reweight("mmr", r, e, mask=keep, scope="batch"))
        # Uniform groups neither set lambda nor enter the pass: the same as a batch of group 2.
        alone = np.asarray(mmr.reweight("mmr", r[2:], e[2:], scope="batch"))
        np.testing.assert_allclose(got[2:], alone, rtol=0, atol=1e-6)
        np.testing.assert_array_equal(got[:2], r[:2])  # unchanged, advantage 0 downstream


class RegistryTest(chex.TestCase):
    def test_names_and_duplicates(self):
        assert advantages.ESTIMATORS["grpo"] is advantages.grpo_advantages
        assert advantages.ESTIMATORS["dr_grpo"] is advantages.dr_grpo_advantages
        with pytest.raises(ValueError, match="already registered"):
            advantages.register("grpo")(lambda r, **k: r)
