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
        assert advantages.ESTIMATORS["rloo"] is advantages.rloo_advantages
        assert advantages.ESTIMATORS["batch_std"] is advantages.batch_std_advantages
        with pytest.raises(ValueError, match="already registered"):
            advantages.register("grpo")(lambda r, **k: r)


def _loop_rloo(r, mask):
    """RLOO one entry at a time (float64): r_i minus the mean of the group's other valid r_j."""
    out = np.zeros(r.shape)
    for idx in np.ndindex(r.shape[:-1]):
        valid = np.flatnonzero(mask[idx])
        for i in valid:
            others = [r[idx][j] for j in valid if j != i]
            if others and len(set(r[idx][valid])) > 1:
                out[idx][i] = r[idx][i] - sum(others) / len(others)
    return out


def _ragged_batch(seed):
    rng = np.random.default_rng(seed)
    r = rng.integers(0, 3, (6, 5)).astype(np.float64) + rng.normal(size=(6, 5)) * 0.1
    mask = rng.random((6, 5)) < 0.7
    mask[0] = False  # a fully masked group
    mask[1] = [True, False, False, False, False]  # a group of one
    mask[2] = True
    r[3] = 0.5  # all equal
    return r, mask


class RlooAdvantagesTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_hand_worked(self):
        # [1, 0, 0, 1]: 1 - 1/3 and 0 - 2/3. Ragged [3, (9), 1, 2]: 3 - 1.5, 1 - 2.5, 2 - 2.
        r = jnp.array([[1.0, 0.0, 0.0, 1.0], [3.0, 9.0, 1.0, 2.0]])
        mask = jnp.array([[True] * 4, [True, False, True, True]])
        got = self.variant(lambda r, m: advantages.rloo_advantages(r, mask=m))(r, mask)
        want = [[2 / 3, -2 / 3, -2 / 3, 2 / 3], [1.5, 0.0, -1.5, 0.0]]
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)

    def test_against_a_leave_one_out_loop(self):
        r, mask = _ragged_batch(3)
        with jax.enable_x64(True):
            got = jax.jit(advantages.rloo_advantages)(jnp.asarray(r), mask=jnp.asarray(mask))
        want = _loop_rloo(r, mask)
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-15)
        assert (want[4:] != 0).any() and (want[:2] == 0).all() and (want[3] == 0).all()


class BatchStdAdvantagesTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_hand_worked(self):
        # Batch [1, 0 | 3, 3], ddof 0: mean 1.75, squared deviations 0.5625 + 3.0625 + 2 *
        # 1.5625 = 6.75, std sqrt(6.75 / 4). Group 0 centred +-0.5; group 1 is uniform: 0.
        r = jnp.array([[1.0, 0.0], [3.0, 3.0]])
        fn = self.variant(lambda r: advantages.batch_std_advantages(r, ddof=0, eps=0.0))
        a = 0.5 / math.sqrt(6.75 / 4)
        np.testing.assert_allclose(fn(r), [[a, -a], [0.0, 0.0]], rtol=1e-6)

    @parameterized.parameters(0, 1)
    def test_against_numpy_over_the_valid_entries(self, ddof):
        r, mask = _ragged_batch(5)
        centred = np.zeros_like(r)
        for i in range(r.shape[0]):
            if mask[i].any():
                centred[i] = np.where(mask[i], r[i] - r[i][mask[i]].mean(), 0.0)
        want = centred / (np.std(r[mask], ddof=ddof) + 1e-4)  # masked entries left out
        with jax.enable_x64(True):
            got = jax.jit(advantages.batch_std_advantages, static_argnames="ddof")(
                jnp.asarray(r), mask=jnp.asarray(mask), ddof=ddof
            )
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-15)
        # Not the group std: GRPO's advantages of the same rewards differ.
        grpo = advantages.grpo_advantages(jnp.asarray(r), mask=jnp.asarray(mask), ddof=ddof)
        assert np.abs(np.asarray(grpo) - want).max() > 0.1

    @parameterized.named_parameters(
        ("all_equal", [[0.3] * 6], None),
        ("group_of_one", [[0.7]], None),
        ("fully_masked", [[1.0, 2.0, 3.0]], [[False] * 3]),
    )
    def test_degenerate_batches_give_exact_zeros(self, r, mask):
        r = jnp.asarray(r)
        mask = None if mask is None else jnp.asarray(mask)
        for fn in (advantages.rloo_advantages, advantages.batch_std_advantages):
            np.testing.assert_array_equal(jax.jit(fn)(r, mask=mask), np.zeros(r.shape))

    def test_the_trainer_passes_its_std_convention(self):
        # pipeline.reweighted_advantages (the whole step's groups, after MMR) gives batch_std
        # the configured ddof and eps, as grpo.
        from mmr_jax.step import pipeline

        from support import testing

        r, mask = _ragged_batch(7)
        emb = np.random.default_rng(0).normal(size=(*r.shape, 4)).astype(np.float32)
        r = r.astype(np.float32)
        for ddof, eps in ((0, 1e-4), (1, 0.5)):
            reweighted, adv, _ = pipeline.reweighted_advantages(
                r,
                emb,
                mask,
                reweight=testing.base_section("reweight", method="mmr"),
                advantage=testing.base_section(
                    "advantage", estimator="batch_std", std_ddof=ddof, eps=eps
                ),
            )
            want = advantages.batch_std_advantages(
                jnp.asarray(reweighted), mask=jnp.asarray(mask), ddof=ddof, eps=eps
            )
            np.testing.assert_allclose(adv, want, rtol=1e-6, atol=1e-7)
            assert not np.allclose(reweighted, r)  # MMR ran before the estimator
