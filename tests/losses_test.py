"""Tests for mmr_jax.losses: hand-worked surrogate, aggregation modes, KL, masks, accumulation."""

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized

from mmr_jax import losses

jax.config.update("jax_numpy_rank_promotion", "raise")

# Two sequences, T = 3, eps_low = eps_high = 0.2.
#   seq 0: A = +1, mask [1, 1, 0], ratio [1, 1.5, (masked)]; clip -> [1, 1.2];
#          token loss -min(r A, clip(r) A) = [-1, -1.2].
#   seq 1: A = -2, mask [1, 1, 1], ratio [1, 0.5, 1.1]; clip -> [1, 0.8, 1.1];
#          r A = [-2, -1, -2.2], clip A = [-2, -1.6, -2.2], min = [-2, -1.6, -2.2];
#          token loss [2, 1.6, 2.2].
#   seq_mean_token_mean: (mean(-1, -1.2) + mean(2, 1.6, 2.2)) / 2 = (-1.1 + 5.8 / 3) / 2
#   token_mean: (-2.2 + 5.8) / 5 = 0.72
#   seq_mean_token_sum_norm with max_completion_len 4: 3.6 / (2 * 4) = 0.45
OLD = jnp.array([[-1.0, -2.0, -3.0], [-0.5, -1.0, -1.5]])
LOGPS = OLD + jnp.log(jnp.array([[1.0, 1.5, 7.0], [1.0, 0.5, 1.1]]))
ADV = jnp.array([1.0, -2.0])
MASK = jnp.array([[True, True, False], [True, True, True]])
CLIP = dict(eps_low=0.2, eps_high=0.2)


class PolicyLossTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.named_parameters(
        ("grpo", "seq_mean_token_mean", (-1.1 + 5.8 / 3) / 2),
        ("dapo", "token_mean", 0.72),
        ("dr_grpo", "seq_mean_token_sum_norm", 0.45),
    )
    def test_hand_worked(self, aggregation, want):
        fn = self.variant(
            lambda lp, old, a, m: losses.policy_loss(
                lp, old, a, m, aggregation=aggregation, max_completion_len=4, **CLIP
            )
        )
        loss, metrics = fn(LOGPS, OLD, ADV, MASK)
        np.testing.assert_allclose(loss, want, rtol=1e-6)
        # Clip binds at seq 1 token 1 (0.5 < 0.8, A < 0) and seq 0 token 1 (1.5 > 1.2, A > 0).
        np.testing.assert_allclose(metrics["clip_frac_low"], 1 / 5, rtol=1e-6)
        np.testing.assert_allclose(metrics["clip_frac_high"], 1 / 5, rtol=1e-6)
        np.testing.assert_allclose(metrics["ratio_mean"], (1 + 1.5 + 1 + 0.5 + 1.1) / 5, rtol=1e-6)
        np.testing.assert_allclose(metrics["ratio_min"], 0.5, rtol=1e-6)
        np.testing.assert_allclose(metrics["ratio_max"], 1.5, rtol=1e-6)
        np.testing.assert_array_equal(metrics["num_tokens"], 5.0)

    def test_aggregations_differ_as_their_formulas_say(self):
        def run(agg):
            return losses.policy_loss(LOGPS, OLD, ADV, MASK, aggregation=agg, **CLIP)[1]

        tm, sn, sm = run("token_mean"), run("seq_mean_token_sum_norm"), run("seq_mean_token_mean")
        # Same numerator (sum of masked token losses), different denominators: 5 tokens vs B*T=6.
        np.testing.assert_array_equal(tm["loss_numerator"], sn["loss_numerator"])
        np.testing.assert_array_equal(tm["loss_denominator"], 5.0)
        np.testing.assert_array_equal(sn["loss_denominator"], 6.0)
        # Sequence mean weights each sequence's mean token loss equally (2 sequences).
        np.testing.assert_allclose(sm["loss_numerator"], -1.1 + 5.8 / 3, rtol=1e-6)
        np.testing.assert_array_equal(sm["loss_denominator"], 2.0)

    def test_gradient_zero_on_masked_and_clipped_tokens(self):
        bad = LOGPS.at[0, 2].set(jnp.inf)  # garbage at the masked position must not leak

        def loss(lp):
            return losses.policy_loss(lp, OLD, ADV, MASK, aggregation="token_mean", **CLIP)[0]

        grad = jax.jit(jax.grad(loss))(bad)
        # d/dlogp of -ratio * A / 5 where unclipped: seq 0 t0: -1 * 1 / 5; seq 1 t0: 1 * 2 / 5;
        # seq 1 t2: 1.1 * 2 / 5. Clipped tokens (seq 0 t1, seq 1 t1) and the masked one get 0.
        np.testing.assert_allclose(grad, [[-0.2, 0.0, 0.0], [0.4, 0.0, 0.44]], rtol=1e-6)

    def test_first_pass_ratio_is_exactly_one(self):
        rng = np.random.default_rng(0)
        lp = jnp.asarray(-rng.random((4, 5)) * 3, jnp.float32)
        adv = jnp.asarray(rng.normal(size=4), jnp.float32)
        mask = jnp.asarray(rng.random((4, 5)) < 0.8).at[:, 0].set(True)

        def f(x):
            return losses.policy_loss(
                x,
                jax.lax.stop_gradient(x),
                adv,
                mask,
                aggregation="token_mean",
                eps_low=0.2,
                eps_high=0.28,
            )

        (loss, metrics), grad = jax.jit(jax.value_and_grad(f, has_aux=True))(lp)
        for k in ("ratio_min", "ratio_max", "ratio_mean"):
            np.testing.assert_array_equal(metrics[k], 1.0)
        np.testing.assert_array_equal(metrics["clip_frac_low"], 0.0)
        np.testing.assert_array_equal(metrics["clip_frac_high"], 0.0)
        n = np.sum(mask)
        np.testing.assert_allclose(loss, -np.sum(np.asarray(adv)[:, None] * mask) / n, rtol=1e-6)
        # Plain policy gradient: -A / (number of tokens) on every real token.
        np.testing.assert_allclose(grad, -np.asarray(adv)[:, None] * mask / n, rtol=1e-6)

    @parameterized.named_parameters(
        ("k1", "k1", 1.0), ("k2", "k2", 0.5), ("k3", "k3", math.exp(-1.0))
    )
    def test_kl_estimators(self, estimator, want):
        # logp = -1, ref = -2: d = ref - logp = -1. k1 = 1, k2 = 1/2, k3 = e^-1 + 1 - 1.
        lp, ref = jnp.full((1, 2), -1.0), jnp.full((1, 2), -2.0)
        np.testing.assert_allclose(
            losses.kl_divergence(lp, ref, estimator=estimator), want, rtol=1e-6
        )
        # Added to the surrogate with beta; ratio 1 and A = 0 leave only the KL term.
        loss, metrics = losses.policy_loss(
            lp,
            lp,
            jnp.zeros(1),
            jnp.ones((1, 2), bool),
            aggregation="token_mean",
            ref_logps_BxT=ref,
            beta=0.1,
            kl_estimator=estimator,
            **CLIP,
        )
        np.testing.assert_allclose(loss, 0.1 * want, rtol=1e-6)
        np.testing.assert_allclose(metrics["kl"], want, rtol=1e-6)

    @parameterized.parameters(*losses.AGGREGATIONS)
    def test_microbatch_accumulation_equals_full_batch(self, aggregation):
        rng = np.random.default_rng(1)
        with jax.enable_x64(True):
            b, t = 8, 7
            old = jnp.asarray(-rng.random((b, t)) * 3)
            lp = old + jnp.asarray(rng.normal(size=(b, t)) * 0.3)
            ref = old + jnp.asarray(rng.normal(size=(b, t)) * 0.1)
            adv = jnp.asarray(rng.normal(size=b))
            mask = jnp.asarray(rng.random((b, t)) < np.linspace(0.2, 0.95, b)[:, None])
            kw = dict(aggregation=aggregation, beta=0.05, max_completion_len=9, **CLIP)

            @jax.jit
            @jax.value_and_grad
            def f(x, old, adv, mask, ref, norm):
                return losses.policy_loss(
                    x, old, adv, mask, ref_logps_BxT=ref, normaliser=norm, **kw
                )[0]

            full, full_grad = f(lp, old, adv, mask, ref, None)
            norm = losses.loss_denominator(mask, aggregation=aggregation, max_completion_len=9)
            chunks = [slice(i, i + 2) for i in range(0, b, 2)]
            parts = [f(lp[c], old[c], adv[c], mask[c], ref[c], norm) for c in chunks]
            np.testing.assert_allclose(sum(p[0] for p in parts), full, rtol=1e-12)
            grads = np.concatenate([p[1] for p in parts])  # each chunk's grad covers its rows
            np.testing.assert_allclose(grads, full_grad, rtol=1e-12, atol=1e-15)
            if aggregation == "token_mean":
                # Averaging per-microbatch token means is not the batch token mean (ragged masks).
                naive = np.mean(
                    [f(lp[c], old[c], adv[c], mask[c], ref[c], None)[0] for c in chunks]
                )
                assert abs(naive - full) > 1e-6

    def test_bad_arguments_raise(self):
        with pytest.raises(ValueError, match="aggregation"):
            losses.policy_loss(LOGPS, OLD, ADV, MASK, aggregation="sum", **CLIP)
        with pytest.raises(ValueError, match="ref_logps"):
            losses.policy_loss(LOGPS, OLD, ADV, MASK, aggregation="token_mean", beta=0.1, **CLIP)
        with pytest.raises(ValueError, match="KL estimator"):
            losses.kl_divergence(LOGPS, OLD, estimator="k4")
        with pytest.raises(AssertionError):
            losses.policy_loss(LOGPS, OLD, ADV[:1], MASK, aggregation="token_mean", **CLIP)


# Rollout/trainer mismatch on the same two sequences. d = trainer - engine per token:
#   seq 0: [0.1, 1.0, (masked: 5.0)], seq 1: [-0.2, 0.0, 0.5]  -> 5 tokens.
#   |d| mean = (0.1 + 1 + 0.2 + 0 + 0.5) / 5 = 0.36, max 1.0 (the masked 5.0 must not count).
#   r = exp(d) = [e^0.1, e^1], [e^-0.2, 1, e^0.5]; with cap 2 the TIS weights are
#   [e^0.1, 2, 0 (masked)], [e^-0.2, 1, e^0.5], and 1 of 5 tokens (e^1 = 2.718) is capped.
D = jnp.array([[0.1, 1.0, 5.0], [-0.2, 0.0, 0.5]])
ENGINE = OLD - D
VALID_D = [0.1, 1.0, -0.2, 0.0, 0.5]


class TruncatedImportanceSamplingTest(chex.TestCase):
    def test_weights_hand_worked(self):
        w = losses.tis_weights(OLD, ENGINE, MASK, cap=2.0)
        e = math.exp
        want = [[e(0.1), 2.0, 0.0], [e(-0.2), 1.0, e(0.5)]]
        np.testing.assert_allclose(w, want, rtol=1e-6)
        # A cap above every ratio leaves the plain ratios.
        w10 = losses.tis_weights(OLD, ENGINE, MASK, cap=10.0)
        np.testing.assert_allclose(w10, [[e(0.1), e(1.0), 0.0], [e(-0.2), 1.0, e(0.5)]], rtol=1e-6)

    @chex.variants(with_jit=True, without_jit=True)
    def test_loss_hand_worked(self):
        # token_mean per-token losses (module comment): [-1, -1.2, _], [2, 1.6, 2.2].
        e = math.exp
        want = (-1 * e(0.1) - 1.2 * 2.0 + 2 * e(-0.2) + 1.6 * 1.0 + 2.2 * e(0.5)) / 5
        w = losses.tis_weights(OLD, ENGINE, MASK, cap=2.0)
        fn = self.variant(
            lambda w: losses.policy_loss(
                LOGPS, OLD, ADV, MASK, aggregation="token_mean", is_weights_BxT=w, **CLIP
            )[0]
        )
        np.testing.assert_allclose(fn(w), want, rtol=1e-6)

    def test_weights_scale_the_gradient_per_token_not_the_kl(self):
        w = losses.tis_weights(OLD, ENGINE, MASK, cap=2.0)
        ref = OLD - 0.3

        def loss(x, w, beta):
            return losses.policy_loss(
                x,
                OLD,
                ADV,
                MASK,
                aggregation="token_mean",
                is_weights_BxT=w,
                ref_logps_BxT=ref,
                beta=beta,
                **CLIP,
            )

        g_plain = jax.grad(lambda x: loss(x, None, 0.0)[0])(LOGPS)
        g_tis = jax.grad(lambda x: loss(x, w, 0.0)[0])(LOGPS)
        np.testing.assert_allclose(g_tis, w * g_plain, rtol=1e-6, atol=1e-7)
        # The KL penalty adds the same amount with and without weights (verl: separate term).
        kl_plain = loss(LOGPS, None, 0.1)[0] - loss(LOGPS, None, 0.0)[0]
        kl_tis = loss(LOGPS, w, 0.1)[0] - loss(LOGPS, w, 0.0)[0]
        # Differences of O(1) fp32 losses agree to a few ulp; a weighted KL would give 0.0136.
        np.testing.assert_allclose(kl_tis, kl_plain, atol=1e-6)
        assert abs(float(kl_plain)) > 1e-3

    def test_off_is_todays_loss(self):
        kw = dict(aggregation="seq_mean_token_mean", ref_logps_BxT=OLD - 0.3, beta=0.1, **CLIP)
        base, base_m = losses.policy_loss(LOGPS, OLD, ADV, MASK, **kw)
        ones, ones_m = losses.policy_loss(
            LOGPS, OLD, ADV, MASK, is_weights_BxT=jnp.ones_like(OLD), **kw
        )
        assert float(base) == float(ones)
        assert all(float(base_m[k]) == float(ones_m[k]) for k in base_m)

    @parameterized.parameters(0.0, 0.9, -2.0)
    def test_cap_below_one_raises(self, cap):
        # A cap below 1 would scale down tokens where trainer and engine agree (w = 1).
        with pytest.raises(ValueError, match="cap must be >= 1"):
            losses.tis_weights(OLD, ENGINE, MASK, cap=cap)
        losses.tis_weights(OLD, ENGINE, MASK, cap=1.0)


class MismatchStatsTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_hand_worked(self):
        stats = self.variant(lambda a, b, m: losses.mismatch_stats(a, b, m, tis_cap=2.0))(
            OLD, ENGINE, MASK
        )
        got = losses.mismatch_metrics(stats)
        r = [math.exp(x) for x in VALID_D]
        mean = sum(r) / 5
        std = math.sqrt(sum((x - mean) ** 2 for x in r) / 5)
        want = {
            "mismatch/logp_abs_mean": 0.36,
            "mismatch/logp_abs_max": 1.0,
            "mismatch/ratio_mean": mean,
            "mismatch/ratio_std": std,
            "mismatch/ratio_min": math.exp(-0.2),
            "mismatch/ratio_max": math.exp(1.0),
            "tis/clipped_frac": 0.2,
        }
        assert set(got) == set(want)
        for k, v in want.items():
            np.testing.assert_allclose(got[k], v, rtol=1e-6, err_msg=k)
        assert "tis/clipped_frac" not in losses.mismatch_metrics(
            losses.mismatch_stats(OLD, ENGINE, MASK)
        )

    def test_small_spread_keeps_fp32_precision(self):
        # fp32 engines differ from the trainer by ~1e-6; the std of r must not drown in 1 + x.
        rng = np.random.default_rng(0)
        d = rng.normal(size=(6, 40)) * 1e-6
        mask = rng.random((6, 40)) < 0.8
        got = losses.mismatch_metrics(
            losses.mismatch_stats(
                jnp.asarray(d, jnp.float32), jnp.zeros((6, 40), jnp.float32), jnp.asarray(mask)
            )
        )
        r = np.exp(d[mask])
        np.testing.assert_allclose(got["mismatch/ratio_std"], r.std(), rtol=1e-3)
        np.testing.assert_allclose(got["mismatch/logp_abs_mean"], np.abs(d[mask]).mean(), rtol=1e-5)

    def test_minibatch_accumulation_equals_full_batch(self):
        rng = np.random.default_rng(3)
        b, t, m = 8, 6, 4
        trainer = jnp.asarray(-rng.random((b, t)) * 4, jnp.float32)
        engine = trainer + jnp.asarray(rng.normal(size=(b, t)) * 0.4, jnp.float32)
        mask = jnp.asarray(rng.random((b, t)) < np.linspace(0.1, 0.9, b)[:, None])
        full = losses.mismatch_metrics(losses.mismatch_stats(trainer, engine, mask, tis_cap=1.3))
        split = lambda x: x.reshape(m, b // m, t)
        stacked = jax.vmap(lambda a, e, k: losses.mismatch_stats(a, e, k, tis_cap=1.3))(
            split(trainer), split(engine), split(mask)
        )
        acc = losses.mismatch_metrics(losses.combine_mismatch_stats(stacked))
        assert set(acc) == set(full)
        for k in full:
            np.testing.assert_allclose(acc[k], full[k], rtol=1e-6, err_msg=k)
        # Against numpy on the masked tokens.
        d = np.asarray(trainer - engine)[np.asarray(mask)]
        np.testing.assert_allclose(full["mismatch/ratio_std"], np.exp(d).std(), rtol=1e-5)
        np.testing.assert_allclose(full["mismatch/ratio_max"], np.exp(d).max(), rtol=1e-6)
        np.testing.assert_allclose(full["tis/clipped_frac"], np.mean(np.exp(d) > 1.3), rtol=1e-6)

    def test_no_tokens_gives_neutral_values(self):
        got = losses.mismatch_metrics(
            losses.mismatch_stats(OLD, ENGINE, jnp.zeros_like(MASK), tis_cap=2.0)
        )
        assert {k: float(v) for k, v in got.items()} == {
            "mismatch/logp_abs_mean": 0.0,
            "mismatch/logp_abs_max": 0.0,
            "mismatch/ratio_mean": 1.0,
            "mismatch/ratio_std": 0.0,
            "mismatch/ratio_min": 1.0,
            "mismatch/ratio_max": 1.0,
            "tis/clipped_frac": 0.0,
        }
