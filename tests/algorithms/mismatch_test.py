"""Tests for algorithms.mismatch: correction modes on constructed mismatches, and the statistics."""

import math
import types

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized

from mmr_jax.algorithms import losses, mismatch

from support import testing

jax.config.update("jax_numpy_rank_promotion", "raise")

e = math.exp
# Two sequences, T = 3 (as tests/algorithms/losses_test.py). d = trainer - engine per token:
#   seq 0: [0.1, 1.0, (masked: 5.0)], seq 1: [-0.2, 0.0, 0.5]  -> 5 tokens.
#   |d| mean = (0.1 + 1 + 0.2 + 0 + 0.5) / 5 = 0.36, max 1.0 (the masked 5.0 must not count).
#   Token ratios r = [e^0.1, e^1], [e^-0.2, 1, e^0.5].
#   Sequence (sum) log-ratios: 1.1, 0.3; geometric (mean): 0.55, 0.1.
OLD = jnp.array([[-1.0, -2.0, -3.0], [-0.5, -1.0, -1.5]])
LOGPS = OLD + jnp.log(jnp.array([[1.0, 1.5, 7.0], [1.0, 0.5, 1.1]]))
ADV = jnp.array([1.0, -2.0])
MASK = jnp.array([[True, True, False], [True, True, True]])
CLIP = dict(eps_low=0.2, eps_high=0.2)
_settings = testing.loss_settings  # the loss section policy_loss reads


def _tis(cap, mode="token_truncate", low=0.0):
    """The loss section's correction keys, as `mismatch.TisSettings` reads them."""
    return types.SimpleNamespace(tis_cap=cap, tis_mode=mode, tis_mask_low=low)


D = jnp.array([[0.1, 1.0, 5.0], [-0.2, 0.0, 0.5]])
ENGINE = OLD - D
VALID_D = [0.1, 1.0, -0.2, 0.0, 0.5]

# (mode, cap, low) -> (weights, capped share, masked share), worked by hand from the above.
HAND = {
    # Truncate each token at 2: only e^1 = 2.72 is capped.
    ("token_truncate", 2.0, 0.0): ([[e(0.1), 2.0, 0], [e(-0.2), 1.0, e(0.5)]], 1 / 5, 0.0),
    # Keep 0.85 <= r <= 2: e^1 (above) and e^-0.2 = 0.82 (below) are rejected.
    ("token_mask", 2.0, 0.85): ([[e(0.1), 0.0, 0], [0.0, 1.0, e(0.5)]], 0.0, 2 / 5),
    # Sequence ratios e^1.1 = 3.00 (capped to 2 on both its tokens) and e^0.3 = 1.35.
    ("sequence_truncate", 2.0, 0.0): ([[2.0, 2.0, 0], [e(0.3)] * 3], 2 / 5, 0.0),
    # Sequence 0 (3.00 > 2) rejected whole: its 2 tokens of 5.
    ("sequence_mask", 2.0, 0.0): ([[0.0, 0.0, 0], [e(0.3)] * 3], 0.0, 2 / 5),
    # Geometric ratios e^0.55 = 1.73 (capped to 1.5) and e^0.1 = 1.11.
    ("geometric_truncate", 1.5, 0.0): ([[1.5, 1.5, 0], [e(0.1)] * 3], 2 / 5, 0.0),
    # Above 1.5 (sequence 0) rejected; e^0.1 kept; a lower bound of 0.9 rejects nothing more.
    ("geometric_mask", 1.5, 0.9): ([[0.0, 0.0, 0], [e(0.1)] * 3], 0.0, 2 / 5),
}


class TisWeightsTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.parameters(*HAND)
    def test_hand_worked(self, mode, cap, low):
        want, capped, masked = HAND[(mode, cap, low)]
        w = self.variant(
            lambda o, en, m: mismatch.tis_weights(o, en, m, settings=_tis(cap, mode, low))
        )(OLD, ENGINE, MASK)
        np.testing.assert_allclose(w, want, rtol=1e-6)
        got = mismatch.mismatch_metrics(
            mismatch.mismatch_stats(OLD, ENGINE, MASK, settings=_tis(cap, mode, low))
        )
        np.testing.assert_allclose(got["tis/clipped_frac"], capped, rtol=1e-6)
        np.testing.assert_allclose(got["tis/masked_frac"], masked, rtol=1e-6)

    def test_modes_are_the_anchors_names(self):
        # TRL's vllm_importance_sampling_mode values (its default: sequence_mask, cap 3), plus
        # the geometric (mean) level of verl's rejection sampling.
        assert set(mismatch.TIS_MODES) == {
            "token_truncate",
            "token_mask",
            "sequence_truncate",
            "sequence_mask",
            "geometric_truncate",
            "geometric_mask",
        }

    def test_a_cap_above_every_ratio_leaves_the_plain_ratios(self):
        w = mismatch.tis_weights(OLD, ENGINE, MASK, settings=_tis(10.0))
        np.testing.assert_allclose(w, [[e(0.1), e(1.0), 0.0], [e(-0.2), 1.0, e(0.5)]], rtol=1e-6)
        w = mismatch.tis_weights(OLD, ENGINE, MASK, settings=_tis(10.0, "sequence_mask"))
        np.testing.assert_allclose(w, [[e(1.1)] * 2 + [0.0], [e(0.3)] * 3], rtol=1e-6)

    @parameterized.parameters("sequence_truncate", "sequence_mask")
    def test_long_sequences_do_not_overflow(self, mode):
        # 200 tokens of d = 1: exp(200) is inf in fp32; the weight is the cap, or a rejection.
        trainer = jnp.zeros((2, 200))
        engine = trainer - jnp.array([[1.0], [0.001]])
        w = mismatch.tis_weights(
            trainer, engine, jnp.ones((2, 200), bool), settings=_tis(3.0, mode)
        )
        assert np.isfinite(np.asarray(w)).all()
        np.testing.assert_allclose(w[0], 3.0 if mode.endswith("truncate") else 0.0)
        np.testing.assert_allclose(w[1], e(0.2), rtol=1e-5)  # sum of 200 x 0.001

    @parameterized.parameters(
        (0.0, "token_truncate", 0.0, "cap must be finite and >= 1"),
        (0.9, "token_truncate", 0.0, "cap must be finite and >= 1"),
        (-2.0, "token_mask", 0.0, "cap must be finite and >= 1"),
        (float("nan"), "token_truncate", 0.0, "cap must be finite and >= 1"),
        (float("inf"), "sequence_mask", 0.0, "cap must be finite and >= 1"),
        (2.0, "token_clip", 0.0, "unknown TIS mode 'token_clip'"),
        (2.0, "token_mask", 1.0, r"lower bound must lie in \[0, 1\)"),
        (2.0, "token_mask", float("nan"), r"lower bound must lie in \[0, 1\)"),
        (2.0, "sequence_truncate", 0.5, "only applies to the '_mask' modes"),
    )
    def test_bad_arguments_raise(self, cap, mode, low, match):
        with pytest.raises(ValueError, match=match):
            mismatch.tis_weights(OLD, ENGINE, MASK, settings=_tis(cap, mode, low))
        if cap != 0:  # 0 is "no correction" to the statistics
            with pytest.raises(ValueError, match=match):
                mismatch.mismatch_stats(OLD, ENGINE, MASK, settings=_tis(cap, mode, low))
        mismatch.tis_weights(OLD, ENGINE, MASK, settings=_tis(1.0))  # the edge is allowed

    def test_unknown_level_raises(self):
        with pytest.raises(ValueError, match="unknown TIS level 'tokens'"):
            mismatch.tis_log_ratio(OLD, ENGINE, MASK, level="tokens")


class TisInTheLossTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_loss_hand_worked(self):
        # token_mean per-token losses (tests/algorithms/losses_test.py): [-1, -1.2, _], [2, 1.6,
        # 2.2].
        want = (-1 * e(0.1) - 1.2 * 2.0 + 2 * e(-0.2) + 1.6 * 1.0 + 2.2 * e(0.5)) / 5
        w = mismatch.tis_weights(OLD, ENGINE, MASK, settings=_tis(2.0))
        fn = self.variant(
            lambda w: losses.policy_loss(
                LOGPS,
                OLD,
                ADV,
                MASK,
                settings=_settings(aggregation="token_mean", **CLIP),
                is_weights_NxT=w,
            )[0]
        )
        np.testing.assert_allclose(fn(w), want, rtol=1e-6)

    def test_rejected_tokens_stay_in_the_normaliser(self):
        # TRL's semantics (mismatch module docstring), not verl's rejection sampling: on-policy,
        # sequence_mask at cap 2 rejects seq 0 (e^1.1 > 2); seq 1 (A = -2, weight e^0.3) has
        # token losses 2 e^0.3. Token mean over all 5 tokens, not over the 3 kept ones.
        w = mismatch.tis_weights(OLD, ENGINE, MASK, settings=_tis(2.0, "sequence_mask"))
        loss = losses.policy_loss(
            OLD,
            OLD,
            ADV,
            MASK,
            settings=_settings(aggregation="token_mean", **CLIP),
            is_weights_NxT=w,
        )[0]
        np.testing.assert_allclose(loss, 3 * 2 * e(0.3) / 5, rtol=1e-6)
        assert abs(float(loss) - 3 * 2 * e(0.3) / 3) > 0.5

    @parameterized.parameters(*HAND)
    def test_weights_scale_the_gradient_per_token_not_the_kl(self, mode, cap, low):
        w = mismatch.tis_weights(OLD, ENGINE, MASK, settings=_tis(cap, mode, low))
        ref = OLD - 0.3

        def loss(x, w, beta):
            return losses.policy_loss(
                x,
                OLD,
                ADV,
                MASK,
                settings=_settings(aggregation="token_mean", beta=beta, **CLIP),
                is_weights_NxT=w,
                ref_logps_NxT=ref,
            )

        g_plain = jax.grad(lambda x: loss(x, None, 0.0)[0])(LOGPS)
        g_tis = jax.grad(lambda x: loss(x, w, 0.0)[0])(LOGPS)
        # Rejected tokens / sequences get no policy gradient; the others their weight's share.
        np.testing.assert_allclose(g_tis, w * g_plain, rtol=1e-6, atol=1e-7)
        if mode.endswith("_mask"):
            assert (np.asarray(g_tis)[np.asarray(w) == 0] == 0).all()
        # The KL penalty adds the same amount with and without weights (verl: separate term).
        kl_plain = loss(LOGPS, None, 0.1)[0] - loss(LOGPS, None, 0.0)[0]
        kl_tis = loss(LOGPS, w, 0.1)[0] - loss(LOGPS, w, 0.0)[0]
        # Differences of O(1) fp32 losses agree to a few ulp; a weighted KL would differ by 1e-2.
        np.testing.assert_allclose(kl_tis, kl_plain, atol=1e-6)
        assert abs(float(kl_plain)) > 1e-3

    def test_off_is_todays_loss(self):
        settings = _settings(aggregation="seq_mean_token_mean", beta=0.1, **CLIP)
        kw = dict(settings=settings, ref_logps_NxT=OLD - 0.3)
        base, base_m = losses.policy_loss(LOGPS, OLD, ADV, MASK, **kw)
        ones, ones_m = losses.policy_loss(
            LOGPS, OLD, ADV, MASK, is_weights_NxT=jnp.ones_like(OLD), **kw
        )
        assert float(base) == float(ones)
        assert all(float(base_m[k]) == float(ones_m[k]) for k in base_m)


def _metrics(trainer, engine, mask, **kw):
    return mismatch.mismatch_metrics(mismatch.mismatch_stats(trainer, engine, mask, **kw))


def _combined(trainer, engine, mask, m, **kw):
    """Metrics of `m` equal row-minibatches, each measured alone and then combined."""
    split = lambda x: jnp.asarray(x).reshape(m, x.shape[0] // m, *x.shape[1:])
    stacked = jax.vmap(lambda a, b, k: mismatch.mismatch_stats(a, b, k, **kw))(
        split(trainer), split(engine), split(mask)
    )
    return mismatch.mismatch_metrics(mismatch.combine_mismatch_stats(stacked))


class MismatchStatsTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_hand_worked(self):
        stats = self.variant(lambda a, b, m: mismatch.mismatch_stats(a, b, m, settings=_tis(2.0)))(
            OLD, ENGINE, MASK
        )
        got = mismatch.mismatch_metrics(stats)
        r = [e(x) for x in VALID_D]
        mean = sum(r) / 5
        std = math.sqrt(sum((x - mean) ** 2 for x in r) / 5)
        want = {
            "mismatch/logp_abs_mean": 0.36,
            "mismatch/logp_abs_max": 1.0,
            "mismatch/ratio_mean": mean,
            "mismatch/ratio_std": std,
            "mismatch/ratio_min": e(-0.2),
            "mismatch/ratio_max": e(1.0),
            "tis/clipped_frac": 0.2,
            "tis/masked_frac": 0.0,
        }
        assert set(got) == set(want)
        for k, v in want.items():
            np.testing.assert_allclose(got[k], v, rtol=1e-6, err_msg=k)
        assert "tis/clipped_frac" not in _metrics(OLD, ENGINE, MASK)

    def test_chan_combination_hand_worked(self):
        # r = [1, 2 | 3, 4]: halves with means 1.5, 3.5 and M2 0.5 each; mean 2.5 and
        # M2 = 0.5 + 0.5 + 2 * 1^2 + 2 * 1^2 = 5, std sqrt(5 / 4) (numpy: std([1, 2, 3, 4])).
        trainer = jnp.log(jnp.array([[1.0, 2.0], [3.0, 4.0]]))
        mask = jnp.ones((2, 2), bool)
        stacked = jax.vmap(lambda a, m: mismatch.mismatch_stats(a, jnp.zeros_like(a), m))(
            trainer[:, None], mask[:, None]
        )
        np.testing.assert_allclose(stacked["ratio_m2"], [0.5, 0.5], rtol=1e-6)
        both = mismatch.combine_mismatch_stats(stacked)
        np.testing.assert_allclose(both["ratio_m2"], 5.0, rtol=1e-6)
        got = mismatch.mismatch_metrics(both)
        np.testing.assert_allclose(got["mismatch/ratio_mean"], 2.5, rtol=1e-6)
        np.testing.assert_allclose(got["mismatch/ratio_std"], math.sqrt(5 / 4), rtol=1e-6)
        np.testing.assert_allclose(got["mismatch/ratio_std"], np.std([1, 2, 3, 4]), rtol=1e-6)

    # Cases of r = exp(d) against numpy's float64 std of the same (fp32) d. In the first two the
    # spread is small against the mean, where E[r^2] - E[r]^2 cancels in fp32: 'issue40' is the
    # layout test's case (trainer ~ -5.7 nats, engine ~ -0.5: r ~ 0.007 +- 0.008), 'far' ratios
    # near 1000 apart by 1e-5 relative; then fp32 engines (1e-7) and a wide spread.
    CASES = {
        "issue40": lambda rng, n: np.log(np.abs(0.0068 + 0.0084 * rng.standard_normal(n)) + 1e-4),
        "far": lambda rng, n: np.log(1000.0) + 1e-5 * rng.standard_normal(n),
        "fp32_engine": lambda rng, n: 1e-7 * rng.standard_normal(n),
        "spread": lambda rng, n: 0.4 * rng.standard_normal(n),
    }

    @parameterized.parameters(*CASES)
    def test_std_and_mean_against_float64(self, case):
        rng = np.random.default_rng(0)
        b, t, m = 8, 40, 4
        d = self.CASES[case](rng, b * t).astype(np.float32).reshape(b, t)
        mask = rng.random((b, t)) < np.linspace(0.3, 0.95, b)[:, None]
        mask[2:4] = False  # a minibatch without a token joins the combination
        r = np.exp(d.astype(np.float64))[mask]
        zeros = np.zeros_like(d)
        for got in (_metrics(d, zeros, mask), _combined(d, zeros, mask, m)):
            np.testing.assert_allclose(got["mismatch/ratio_std"], r.std(), rtol=1e-6)
            np.testing.assert_allclose(got["mismatch/ratio_mean"], r.mean(), rtol=1e-6)
        if case in ("issue40", "far"):
            # The replaced formula, in fp32, on the same values: over 100 times the error above.
            dev = np.expm1(d[mask]).astype(np.float32)
            naive = np.mean(dev * dev, dtype=np.float32) - np.mean(dev, dtype=np.float32) ** 2
            assert abs(np.sqrt(max(naive, 0)) / r.std() - 1) > 1e-4

    def test_minibatch_accumulation_equals_full_batch(self):
        rng = np.random.default_rng(3)
        b, t, m = 8, 6, 4
        trainer = jnp.asarray(-rng.random((b, t)) * 4, jnp.float32)
        engine = trainer + jnp.asarray(rng.normal(size=(b, t)) * 0.4, jnp.float32)
        mask = jnp.asarray(rng.random((b, t)) < np.linspace(0.1, 0.9, b)[:, None])
        for mode in mismatch.TIS_MODES:
            kw = dict(settings=_tis(1.3, mode))
            full, acc = (
                _metrics(trainer, engine, mask, **kw),
                _combined(trainer, engine, mask, m, **kw),
            )
            assert set(acc) == set(full)
            for k in full:
                np.testing.assert_allclose(acc[k], full[k], rtol=1e-6, err_msg=k)
        # Against numpy on the masked tokens.
        d = np.asarray(trainer - engine)[np.asarray(mask)]
        full = _metrics(trainer, engine, mask, settings=_tis(1.3))
        np.testing.assert_allclose(full["mismatch/ratio_std"], np.exp(d).std(), rtol=1e-6)
        np.testing.assert_allclose(full["mismatch/ratio_max"], np.exp(d).max(), rtol=1e-6)
        np.testing.assert_allclose(full["tis/clipped_frac"], np.mean(np.exp(d) > 1.3), rtol=1e-6)

    def test_no_tokens_gives_neutral_values(self):
        got = _metrics(OLD, ENGINE, jnp.zeros_like(MASK), settings=_tis(2.0))
        assert {k: float(v) for k, v in got.items()} == {
            "mismatch/logp_abs_mean": 0.0,
            "mismatch/logp_abs_max": 0.0,
            "mismatch/ratio_mean": 1.0,
            "mismatch/ratio_std": 0.0,
            "mismatch/ratio_min": 1.0,
            "mismatch/ratio_max": 1.0,
            "tis/clipped_frac": 0.0,
            "tis/masked_frac": 0.0,
        }
        none = _combined(OLD, ENGINE, jnp.zeros_like(MASK), 2, settings=_tis(2.0))
        assert all(np.isfinite(float(v)) for v in none.values()), none
