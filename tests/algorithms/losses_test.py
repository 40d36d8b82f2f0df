"""Tests for algorithms.losses: hand-worked surrogate, aggregations, KL, masks, accumulation."""

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized

from mmr_jax.algorithms import losses

from support import testing

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
_settings = testing.loss_settings  # the loss section policy_loss reads


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
                lp,
                old,
                a,
                m,
                settings=_settings(aggregation=aggregation, **CLIP),
                max_completion_len=4,
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
            return losses.policy_loss(
                LOGPS, OLD, ADV, MASK, settings=_settings(aggregation=agg, **CLIP)
            )[1]

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
            return losses.policy_loss(
                lp, OLD, ADV, MASK, settings=_settings(aggregation="token_mean", **CLIP)
            )[0]

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
                settings=_settings(aggregation="token_mean", eps_low=0.2, eps_high=0.28),
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
            settings=_settings(aggregation="token_mean", beta=0.1, kl_estimator=estimator, **CLIP),
            ref_logps_NxT=ref,
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
            settings = _settings(aggregation=aggregation, beta=0.05, **CLIP)

            @jax.jit
            @jax.value_and_grad
            def f(x, old, adv, mask, ref, norm):
                return losses.policy_loss(
                    x,
                    old,
                    adv,
                    mask,
                    settings=settings,
                    ref_logps_NxT=ref,
                    normaliser=norm,
                    max_completion_len=9,
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
            losses.policy_loss(LOGPS, OLD, ADV, MASK, settings=_settings(aggregation="sum", **CLIP))
        with pytest.raises(ValueError, match="ref_logps"):
            losses.policy_loss(
                LOGPS,
                OLD,
                ADV,
                MASK,
                settings=_settings(aggregation="token_mean", beta=0.1, **CLIP),
            )
        with pytest.raises(ValueError, match="KL estimator"):
            losses.kl_divergence(LOGPS, OLD, estimator="k4")
        with pytest.raises(AssertionError):
            losses.policy_loss(
                LOGPS, OLD, ADV[:1], MASK, settings=_settings(aggregation="token_mean", **CLIP)
            )


# GSPO on the same two sequences, eps 0.2. Sequence ratio s = exp(mean of the valid log-ratios):
#   seq 0: ratios [1, 1.5] (the masked 7 must not count): s0 = sqrt(1.5) = 1.2247 > 1.2 with
#          A = +1: clipped to 1.2, token loss -1.2 on both tokens, zero gradient.
#   seq 1: ratios [1, 0.5, 1.1]: s1 = 0.55^(1/3) = 0.8193 inside [0.8, 1.2]; A = -2: token loss
#          -min(-2 s1, -2 s1) = 2 s1 = 1.6386 on its 3 tokens.
S0, S1 = math.sqrt(1.5), 0.55 ** (1 / 3)


def _loop_gspo_grad(lp, old, adv, mask, *, eps_low, eps_high, aggregation, max_len):
    """d loss / d logps of GSPO, one sequence at a time (float64 numpy, no autodiff).

    Unclipped, each token's loss is -s A with ds / dlogp_t = s / n (s = exp(mean_t of the n
    log-ratios)); clipped, it is constant. The aggregation scales a sequence's n equal token
    losses: by 1 / (n * #sequences) (seq-mean-token-mean), 1 / #tokens, or 1 / (B * max_len).
    """
    b = lp.shape[0]
    grad = np.zeros_like(lp)
    n_seq, n_tok = sum(mask[i].any() for i in range(b)), mask.sum()
    for i in range(b):
        n = mask[i].sum()
        if n == 0:
            continue
        s = math.exp(sum(lp[i, t] - old[i, t] for t in range(lp.shape[1]) if mask[i, t]) / n)
        if (adv[i] > 0 and s > 1 + eps_high) or (adv[i] < 0 and s < 1 - eps_low):
            continue
        per_token = {
            "seq_mean_token_mean": 1 / (n * n_seq),
            "token_mean": 1 / n_tok,
            "seq_mean_token_sum_norm": 1 / (b * max_len),
        }[aggregation]
        for t in range(lp.shape[1]):
            if mask[i, t]:
                grad[i, t] = n * per_token * (-adv[i] * s / n)
    return grad


class GspoTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.named_parameters(
        ("seq_mean", "seq_mean_token_mean", (-1.2 + 2 * S1) / 2),
        ("token_mean", "token_mean", (2 * -1.2 + 3 * 2 * S1) / 5),
    )
    def test_hand_worked(self, aggregation, want):
        for level in ("sequence", "sequence_token"):
            fn = self.variant(
                lambda lp, old, a, m, level=level: losses.policy_loss(
                    lp,
                    old,
                    a,
                    m,
                    settings=_settings(
                        aggregation=aggregation, importance_sampling_level=level, **CLIP
                    ),
                )
            )
            loss, metrics = fn(LOGPS, OLD, ADV, MASK)
            np.testing.assert_allclose(loss, want, rtol=1e-6)
            np.testing.assert_allclose(metrics["clip_frac_high"], 2 / 5, rtol=1e-6)  # seq 0
            np.testing.assert_array_equal(metrics["clip_frac_low"], 0.0)
            np.testing.assert_allclose(metrics["ratio_mean"], (2 * S0 + 3 * S1) / 5, rtol=1e-6)
            np.testing.assert_allclose(metrics["ratio_min"], S1, rtol=1e-6)
            np.testing.assert_allclose(metrics["ratio_max"], S0, rtol=1e-6)

    def test_log_ratio_hand_worked(self):
        got = losses.log_importance_ratio(LOGPS, OLD, MASK, level="sequence")
        want = [[math.log(S0)] * 2 + [0.0], [math.log(S1)] * 3]
        np.testing.assert_allclose(got, want, rtol=1e-6)
        with pytest.raises(ValueError, match="unknown importance sampling level 'seq'"):
            losses.log_importance_ratio(LOGPS, OLD, MASK, level="seq")

    @parameterized.parameters(*losses.AGGREGATIONS)
    def test_gradient_against_a_plain_loop(self, aggregation):
        rng = np.random.default_rng(7)
        b, t = 8, 6
        with jax.enable_x64(True):
            old = -rng.random((b, t)) * 3
            # Ratios within a few percent of 1 with eps 0.02 / 0.03: some sequences clip.
            lp = old + rng.normal(size=(b, t)) * 0.05
            adv = rng.normal(size=b)
            mask = rng.random((b, t)) < np.linspace(0.2, 0.95, b)[:, None]
            mask[0] = False  # a sequence without a token
            kw = dict(eps_low=0.02, eps_high=0.03, aggregation=aggregation)
            want = _loop_gspo_grad(lp, old, adv, mask, max_len=t, **kw)
            assert (want == 0).sum() > (~mask).sum() and (want != 0).any()  # some clip
            for level in ("sequence", "sequence_token"):
                grad = jax.jit(
                    jax.grad(
                        lambda x, level=level: losses.policy_loss(
                            x,
                            old,
                            adv,
                            mask,
                            settings=_settings(importance_sampling_level=level, **kw),
                        )[0]
                    )
                )(jnp.asarray(lp))
                np.testing.assert_allclose(grad, want, rtol=1e-12, atol=1e-15, err_msg=level)

    @parameterized.parameters("sequence", "sequence_token")
    def test_one_token_per_completion_is_the_token_form(self, level):
        rng = np.random.default_rng(2)
        b, t = 6, 4
        old = jnp.asarray(-rng.random((b, t)) * 3, jnp.float32)
        lp = old + jnp.asarray(rng.normal(size=(b, t)) * 0.3, jnp.float32)
        adv = jnp.asarray(rng.normal(size=b), jnp.float32)
        mask = jnp.asarray(np.eye(b, t, k=0, dtype=bool) | np.eye(b, t, k=-4, dtype=bool))
        assert (np.asarray(mask).sum(-1) == 1).all()

        def f(x, lvl):
            return losses.policy_loss(
                x,
                old,
                adv,
                mask,
                settings=_settings(aggregation="token_mean", importance_sampling_level=lvl, **CLIP),
            )

        (tok, tok_m), g_tok = jax.value_and_grad(f, has_aux=True)(lp, "token")
        (seq, seq_m), g_seq = jax.value_and_grad(f, has_aux=True)(lp, level)
        assert float(tok_m["clip_frac_low"] + tok_m["clip_frac_high"]) > 0  # clipping exercised
        np.testing.assert_allclose(seq, tok, rtol=1e-6)
        np.testing.assert_allclose(g_seq, g_tok, rtol=1e-6, atol=1e-8)
        for k in tok_m:
            np.testing.assert_allclose(seq_m[k], tok_m[k], rtol=1e-6, err_msg=k)

    @parameterized.parameters("sequence", "sequence_token")
    def test_masked_tokens_get_zero_gradient(self, level):
        bad = LOGPS.at[0, 2].set(jnp.inf)  # garbage at the masked position must not leak

        def loss(lp):
            return losses.policy_loss(
                lp,
                OLD,
                ADV,
                MASK,
                settings=_settings(
                    aggregation="token_mean", importance_sampling_level=level, **CLIP
                ),
            )[0]

        value, grad = jax.jit(jax.value_and_grad(loss))(bad)
        np.testing.assert_allclose(value, (2 * -1.2 + 3 * 2 * S1) / 5, rtol=1e-6)
        # Seq 0 is clipped (zero gradient); seq 1: -A s1 / 5 on each token = 2 s1 / 5.
        np.testing.assert_allclose(grad, [[0.0, 0.0, 0.0], [2 * S1 / 5] * 3], rtol=1e-6)

    @parameterized.parameters(*losses.AGGREGATIONS)
    def test_on_policy_gradient_is_grpos(self, aggregation):
        # On the first pass (old = stop_gradient(logps)) s = 1 exactly and the gradient is the
        # plain policy gradient, as GRPO's (TRL: "equivalent to no modification" on-policy).
        rng = np.random.default_rng(4)
        lp = jnp.asarray(-rng.random((5, 7)) * 3, jnp.float32)
        adv = jnp.asarray(rng.normal(size=5), jnp.float32)
        mask = jnp.asarray(rng.random((5, 7)) < 0.7).at[:, 0].set(True)

        def f(x, level):
            return losses.policy_loss(
                x,
                jax.lax.stop_gradient(x),
                adv,
                mask,
                settings=_settings(
                    aggregation=aggregation, importance_sampling_level=level, **CLIP
                ),
            )[0]

        g_tok = jax.grad(f)(lp, "token")
        for level in ("sequence", "sequence_token"):
            np.testing.assert_allclose(jax.grad(f)(lp, level), g_tok, rtol=1e-6, atol=1e-9)


class DescribeTest(parameterized.TestCase):
    def test_the_options_on_are_named_in_order(self):
        words = losses.describe(
            _settings(aggregation="token_mean", beta=0.04, dual_clip_c=3.0, eps_high=0.28)
        )
        assert words == [
            "objective clipped surrogate, token ratio, clip [0.8, 1.28]",
            "loss token_mean",
            "KL k3 beta 0.04",
            "dual clip c 3",
        ]
        assert losses.describe(_settings(top_entropy_quantile=0.2))[-1] == "top 0.2 entropy tokens"

    @parameterized.product(objective=losses.OBJECTIVES, level=losses.IS_LEVELS)
    def test_every_choice_has_words(self, objective, level):
        words = losses.describe(_settings(objective=objective, importance_sampling_level=level))
        assert words[0].startswith("objective ") and len(words) == 2  # beta 0: no option on
