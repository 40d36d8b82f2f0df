"""Tests for the objective options of algorithms.losses (issue 47): CISPO, dual clip, the entropy
bonus, the top-entropy token mask, and GSPO / GSPO-token under token-level correction weights.

Every formula is checked against an independent float64 NumPy form with the derivative written
out by hand (no autodiff), on ragged masks with an empty row, or on hand-worked values.
"""

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

# The two sequences of losses_test: seq 0 A = +1, ratios [1, 1.5, (masked)]; seq 1 A = -2,
# ratios [1, 0.5, 1.1]; 5 loss tokens.
OLD = jnp.array([[-1.0, -2.0, -3.0], [-0.5, -1.0, -1.5]])
LOGPS = OLD + jnp.log(jnp.array([[1.0, 1.5, 7.0], [1.0, 0.5, 1.1]]))
ADV = jnp.array([1.0, -2.0])
MASK = jnp.array([[True, True, False], [True, True, True]])
CLIP = dict(eps_low=0.2, eps_high=0.2)
_settings = testing.loss_settings  # the loss section policy_loss reads


def _reference(lp, old, adv, mask, ent, *, aggregation, max_len, eps_low, eps_high, objective,
               dual_c, w, keep, coef, beta, ref):  # fmt: skip
    """(loss, d loss / d logps, d loss / d entropy) in float64, one token at a time.

    Per loss token: r = exp(lp - old); 'ppo_clip' l = max(-r A, -clip(r) A), capped at -A c
    for A < 0 (dual clip), dl/dlp = -r A where the unclipped branch is active and not capped,
    else 0; 'cispo' l = -clip(r) A lp, dl/dlp = -clip(r) A. Then l * w * keep + beta * k3 -
    coef * H (dk3/dlp = 1 - exp(ref - lp), dl/dH = -coef), and the aggregation's weight c_bt:
    1 / (n_b * #rows with a token), 1 / #tokens or 1 / (B * max_len).
    """
    b, t = lp.shape
    n_b = mask.sum(-1)
    loss, g_lp, g_ent = 0.0, np.zeros((b, t)), np.zeros((b, t))
    for i in range(b):
        for j in range(t):
            if not mask[i, j]:
                continue
            c = {
                "seq_mean_token_mean": 1 / (n_b[i] * (n_b > 0).sum()),
                "token_mean": 1 / mask.sum(),
                "seq_mean_token_sum_norm": 1 / (b * max_len),
            }[aggregation]
            r, a = math.exp(lp[i, j] - old[i, j]), adv[i]
            rc = min(max(r, 1 - eps_low), 1 + eps_high)
            if objective == "cispo":
                pg, d_pg = -rc * a * lp[i, j], -rc * a
            else:
                pg = max(-r * a, -rc * a)
                d_pg = -r * a if -r * a > -rc * a or rc == r else 0.0
                if dual_c and a < 0 and -a * dual_c < pg:
                    pg, d_pg = -a * dual_c, 0.0
            d = ref[i, j] - lp[i, j]
            term = pg * w[i, j] * keep[i, j] + beta * (math.expm1(d) - d) - coef * ent[i, j]
            loss += c * term
            g_lp[i, j] = c * (d_pg * w[i, j] * keep[i, j] + beta * (1 - math.exp(d)))
            g_ent[i, j] = -c * coef
    return loss, g_lp, g_ent


def _numpy_keep(ent, mask, quantile):
    """TRL's rule with numpy's quantile (linear, as torch.quantile): H >= q_{1 - quantile}."""
    if not mask.any():
        return np.zeros_like(mask)
    return mask & (ent >= np.quantile(ent[mask], 1 - quantile))


def _batch(seed, b=7, t=6):
    rng = np.random.default_rng(seed)
    old = -rng.random((b, t)) * 3
    lp = old + rng.normal(size=(b, t)) * 0.7  # ratios from ~0.2 to ~5: every branch is taken
    mask = rng.random((b, t)) < np.linspace(0.3, 0.95, b)[:, None]
    mask[0] = False  # a row without a loss token
    mask[1, 0] = True
    ent = rng.random((b, t)) * 2
    return dict(
        lp=lp,
        old=old,
        adv=rng.normal(size=b),
        mask=mask,
        ent=ent,
        w=rng.uniform(0.5, 2.0, (b, t)),
        ref=old + rng.normal(size=(b, t)) * 0.1,
    )


_OPTIONS = {
    "ppo": dict(),
    "dual_clip": dict(dual_clip_c=1.5),
    "cispo": dict(objective="cispo", eps_low=1.0, eps_high=1.0),
    "cispo_two_sided": dict(objective="cispo"),
    "entropy_bonus": dict(entropy_coef=0.03),
    "top_entropy": dict(top_entropy_quantile=0.4),
    "everything": dict(
        dual_clip_c=1.5, entropy_coef=0.01, top_entropy_quantile=0.6, tis=True, beta=0.05
    ),
    "cispo_everything": dict(
        objective="cispo", entropy_coef=0.01, top_entropy_quantile=0.3, tis=True, beta=0.05
    ),
}


class ReferenceTest(parameterized.TestCase):
    @parameterized.product(option=sorted(_OPTIONS), aggregation=losses.AGGREGATIONS)
    def test_loss_and_gradients_against_float64(self, option, aggregation):
        opts = dict(_OPTIONS[option])
        tis, beta = opts.pop("tis", False), opts.pop("beta", 0.0)
        clip = dict(CLIP, eps_low=opts.pop("eps_low", 0.2), eps_high=opts.pop("eps_high", 0.28))
        x = _batch(3)
        keep = _numpy_keep(x["ent"], x["mask"], opts.get("top_entropy_quantile", 1.0))
        w = x["w"] if tis else np.ones_like(x["w"])
        want, want_lp, want_ent = _reference(
            x["lp"], x["old"], x["adv"], x["mask"], x["ent"], aggregation=aggregation,
            max_len=9, objective=opts.get("objective", "ppo_clip"),
            dual_c=opts.get("dual_clip_c", 0.0), w=w, keep=keep,
            coef=opts.get("entropy_coef", 0.0), beta=beta, ref=x["ref"], **clip,
        )  # fmt: skip
        loss_keys = {k: v for k, v in opts.items() if k != "entropy_coef"}  # the call's own
        with jax.enable_x64(True):

            def f(lp, ent):
                return losses.policy_loss(
                    lp,
                    jnp.asarray(x["old"]),
                    jnp.asarray(x["adv"]),
                    jnp.asarray(x["mask"]),
                    settings=_settings(aggregation=aggregation, beta=beta, **clip, **loss_keys),
                    max_completion_len=9,
                    is_weights_NxT=jnp.asarray(w) if tis else None,
                    ref_logps_NxT=jnp.asarray(x["ref"]),
                    entropy_NxT=ent,
                    entropy_coef=opts.get("entropy_coef", 0.0),
                )

            (loss, metrics), (g_lp, g_ent) = jax.jit(
                jax.value_and_grad(f, argnums=(0, 1), has_aux=True)
            )(jnp.asarray(x["lp"]), jnp.asarray(x["ent"]))
        np.testing.assert_allclose(loss, want, rtol=1e-12)
        np.testing.assert_allclose(g_lp, want_lp, rtol=1e-12, atol=1e-15)
        np.testing.assert_allclose(g_ent, want_ent, rtol=1e-12, atol=1e-15)
        if "top_entropy_quantile" in opts:
            np.testing.assert_allclose(metrics["entropy_kept_frac"], keep.sum() / x["mask"].sum())
        if "dual_clip_c" in opts:
            r = np.exp(x["lp"] - x["old"])
            bound = x["mask"] & (x["adv"][:, None] < 0) & (r > opts["dual_clip_c"])
            assert bound.any()  # the cap binds somewhere in this batch
            np.testing.assert_allclose(metrics["dual_clip_frac"], bound.sum() / x["mask"].sum())

    @parameterized.parameters(*losses.AGGREGATIONS)
    def test_options_off_are_bit_identical(self, aggregation):
        # The defaults, and every option set to its 'off' value with an entropy array given, run
        # the graph of before this change: the same bits of loss, metrics and gradient.
        x = {k: jnp.asarray(v, jnp.float32) for k, v in _batch(5).items()}
        x["mask"] = x["mask"].astype(bool)
        base = dict(aggregation=aggregation, beta=0.04, **CLIP)

        def run(entropy_NxT=None, entropy_coef=0.0, **loss_keys):
            fn = jax.jit(
                jax.value_and_grad(
                    lambda lp: losses.policy_loss(
                        lp,
                        x["old"],
                        x["adv"],
                        x["mask"],
                        settings=_settings(**base, **loss_keys),
                        ref_logps_NxT=x["ref"],
                        is_weights_NxT=x["w"],
                        entropy_NxT=entropy_NxT,
                        entropy_coef=entropy_coef,
                    ),
                    has_aux=True,
                )
            )
            (loss, metrics), grad = fn(x["lp"])
            return loss, metrics, grad

        loss, metrics, grad = run()
        off = run(
            objective="ppo_clip",
            dual_clip_c=0.0,
            entropy_NxT=x["ent"],
            entropy_coef=0.0,
            top_entropy_quantile=1.0,
        )
        np.testing.assert_array_equal(off[0], loss)
        np.testing.assert_array_equal(off[2], grad)
        assert off[1].keys() == metrics.keys()
        for k in metrics:
            np.testing.assert_array_equal(off[1][k], metrics[k], err_msg=k)
        on = run(entropy_NxT=x["ent"], entropy_coef=1e-3)
        assert float(on[0]) != float(loss)  # the comparison can fail


class CispoTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_hand_worked(self):
        # No lower bound (eps_low = 1), cap 1 + 0.2: weights [1, 1.2 | 1, 0.5, 1.1]. Loss per
        # token -w A logp; gradient -w A / 5 (token mean), clipped tokens included, unlike PPO
        # whose clip zeroes seq 0 token 1 and seq 1 token 1.
        settings = _settings(aggregation="token_mean", objective="cispo", eps_low=1.0, eps_high=0.2)
        fn = self.variant(
            jax.value_and_grad(
                lambda lp: losses.policy_loss(lp, OLD, ADV, MASK, settings=settings), has_aux=True
            )
        )
        (loss, metrics), grad = fn(LOGPS)
        w = np.array([[1.0, 1.2, 0.0], [1.0, 0.5, 1.1]])
        lp = np.where(MASK, np.asarray(LOGPS, np.float64), 0.0)
        want = np.sum(-w * np.asarray(ADV)[:, None] * lp) / 5
        np.testing.assert_allclose(loss, want, rtol=1e-6)
        np.testing.assert_allclose(grad, [[-0.2, -0.24, 0.0], [0.4, 0.2, 0.44]], rtol=1e-6)
        np.testing.assert_allclose(metrics["clip_frac_high"], 1 / 5, rtol=1e-6)  # r = 1.5
        np.testing.assert_array_equal(metrics["clip_frac_low"], 0.0)  # no lower bound

    def test_lower_bound_clips_whatever_the_sign(self):
        # eps_low = 0.2: the r = 0.5 token of seq 1 (A < 0) gets weight 0.8, still a gradient.
        grad = jax.grad(
            lambda lp: losses.policy_loss(
                lp,
                OLD,
                ADV,
                MASK,
                settings=_settings(aggregation="token_mean", objective="cispo", **CLIP),
            )[0]
        )(LOGPS)
        np.testing.assert_allclose(grad[1], [0.4, 2 * 0.8 / 5, 0.44], rtol=1e-6)

    @parameterized.parameters(*losses.AGGREGATIONS)
    def test_first_pass_gradient_is_ppos(self, aggregation):
        # On-policy the weight is exactly 1: -A grad logp, the plain policy gradient.
        x = {k: jnp.asarray(v, jnp.float32) for k, v in _batch(6).items()}

        def f(lp, objective):
            return losses.policy_loss(
                lp,
                jax.lax.stop_gradient(lp),
                x["adv"],
                x["mask"].astype(bool),
                settings=_settings(aggregation=aggregation, objective=objective, **CLIP),
            )[0]

        np.testing.assert_allclose(
            jax.grad(f)(x["lp"], "cispo"), jax.grad(f)(x["lp"], "ppo_clip"), rtol=1e-6, atol=1e-9
        )

    def test_refused_combinations(self):
        kw = dict(aggregation="token_mean", objective="cispo", **CLIP)
        with pytest.raises(ValueError, match="token ratios"):
            losses.policy_loss(
                LOGPS,
                OLD,
                ADV,
                MASK,
                settings=_settings(importance_sampling_level="sequence", **kw),
            )
        with pytest.raises(ValueError, match="unknown objective 'gpg'"):
            losses.policy_loss(
                LOGPS,
                OLD,
                ADV,
                MASK,
                settings=_settings(aggregation="token_mean", objective="gpg", **CLIP),
            )


class DualClipTest(parameterized.TestCase):
    # Seq 1 (A = -2) with ratios [1, 0.5, 4]: PPO's token losses max(2r, 2 clip(r)) = [2, 1.6, 8];
    # with c = 3 the last is capped at -A c = 6 and its gradient (8 / 5 without the cap) is 0.
    LP = OLD + jnp.log(jnp.array([[1.0, 1.5, 7.0], [1.0, 0.5, 4.0]]))

    def _run(self, **kw):
        return jax.value_and_grad(
            lambda lp: losses.policy_loss(
                lp, OLD, ADV, MASK, settings=_settings(aggregation="token_mean", **kw)
            ),
            has_aux=True,
        )(self.LP)

    def test_hand_worked(self):
        (loss, metrics), grad = self._run(dual_clip_c=3.0, **CLIP)
        np.testing.assert_allclose(loss, (-1 - 1.2 + 2 + 1.6 + 6) / 5, rtol=1e-6)
        np.testing.assert_allclose(grad, [[-0.2, 0.0, 0.0], [0.4, 0.0, 0.0]], rtol=1e-6)
        np.testing.assert_allclose(metrics["dual_clip_frac"], 1 / 5, rtol=1e-6)
        (plain, _), plain_grad = self._run(**CLIP)
        np.testing.assert_allclose(plain, (-1 - 1.2 + 2 + 1.6 + 8) / 5, rtol=1e-6)
        np.testing.assert_allclose(plain_grad[1, 2], 8 / 5, rtol=1e-6)

    @parameterized.parameters(1.3, 2.0, 3.0)
    def test_equals_trls_two_sided_delta(self, c):
        # TRL: coef_1 = min(r, delta); -min(coef_1 A, clip(r) A). The same loss as verl's dual
        # clip for every ratio when delta >= 1 + eps_high (TRL: "recommended > 1 + eps").
        r = np.exp(np.linspace(-2.0, 2.0, 41))
        lp = jnp.asarray(np.log(r))[None]
        for a in (1.0, -1.0):
            got = losses.ppo_clip_loss(jnp.exp(lp), jnp.array([[a]]), dual_clip_c=c, **CLIP)
            trl = -np.minimum(np.minimum(r, c) * a, np.clip(r, 0.8, 1.2) * a)
            np.testing.assert_allclose(got[0], trl, rtol=1e-6)


class EntropyTest(parameterized.TestCase):
    @parameterized.named_parameters(
        # TRL's own test: 10 valid entropies 0.1..1.0 (two padded), top 20%: 0.9 and 1.0.
        ("trl_top_20", 0.2, [0.9, 1.0]),
        # q_{0.6} of 0.1..1.0 = 0.1 + 0.6 * 9 * 0.1 = 0.64: 0.7 .. 1.0.
        ("top_40", 0.4, [0.7, 0.8, 0.9, 1.0]),
        ("all", 1.0, [0.1 * i for i in range(1, 11)]),
    )
    def test_high_entropy_mask_hand_worked(self, quantile, kept):
        ent = jnp.array([[0.1, 0.2, 0.3, 0.4, 0.5, 9.0], [0.6, 0.7, 0.8, 0.9, 1.0, 9.0]])
        mask = jnp.array([[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 0]], bool)  # padding: 9.0
        got = losses.high_entropy_mask(ent, mask, quantile=quantile)
        np.testing.assert_allclose(np.sort(np.asarray(ent)[np.asarray(got)]), kept, rtol=1e-6)

    def test_ties_are_all_kept_and_empty_keeps_none(self):
        ent = jnp.array([[1.0, 1.0, 1.0, 0.5]])
        mask = jnp.ones((1, 4), bool)
        np.testing.assert_array_equal(
            losses.high_entropy_mask(ent, mask, quantile=0.25), [[True, True, True, False]]
        )
        none = losses.high_entropy_mask(ent, jnp.zeros((1, 4), bool), quantile=0.5)
        np.testing.assert_array_equal(none, False)

    @parameterized.parameters(0.05, 0.2, 0.5, 0.8)
    def test_high_entropy_mask_against_numpy_quantile(self, quantile):
        x = _batch(11, b=9, t=13)
        got = jax.jit(losses.high_entropy_mask, static_argnames="quantile")(
            jnp.asarray(x["ent"], jnp.float32), jnp.asarray(x["mask"]), quantile=quantile
        )
        want = _numpy_keep(x["ent"].astype(np.float32), x["mask"], quantile)
        np.testing.assert_array_equal(got, want)
        assert 0 < want.sum() < x["mask"].sum()

    def test_entropy_bonus_hand_worked(self):
        # On-policy, A = 0: only -coef * H remains, aggregated as the loss: seq mean of token
        # means over the two rows with a token = -coef * ((0.1 + 0.3) / 2 + 0.5 / 1) / 2.
        ent = jnp.array([[0.1, 0.3, 7.0], [0.5, 7.0, 7.0], [7.0, 7.0, 7.0]])
        mask = jnp.array([[1, 1, 0], [1, 0, 0], [0, 0, 0]], bool)  # 7.0: padding, an empty row
        lp = jnp.full((3, 3), -1.0)

        def f(coef):
            settings = _settings(aggregation="seq_mean_token_mean", **CLIP)
            return losses.policy_loss(
                lp, lp, jnp.zeros(3), mask, settings=settings, entropy_NxT=ent, entropy_coef=coef
            )[0]

        want = -0.02 * (0.2 + 0.5) / 2
        np.testing.assert_allclose(f(0.02), want, rtol=1e-6)
        np.testing.assert_allclose(jax.jit(f)(jnp.float32(0.02)), want, rtol=1e-6)  # traced

    def test_missing_entropy_raises(self):
        kw = dict(aggregation="token_mean", **CLIP)
        with pytest.raises(ValueError, match="need entropy_NxT"):
            losses.policy_loss(LOGPS, OLD, ADV, MASK, settings=_settings(**kw), entropy_coef=0.1)
        with pytest.raises(ValueError, match="need entropy_NxT"):
            losses.policy_loss(
                LOGPS, OLD, ADV, MASK, settings=_settings(top_entropy_quantile=0.2, **kw)
            )
        with pytest.raises(ValueError, match=r"top_entropy_quantile must lie in \(0, 1\]"):
            losses.policy_loss(
                LOGPS, OLD, ADV, MASK, settings=_settings(top_entropy_quantile=0.0, **kw)
            )


def _loop_gspo_grad(lp, old, adv, mask, w, *, level, eps_low, eps_high, aggregation, max_len):
    """d loss / d logps of GSPO ('sequence') and GSPO-token with token weights w (float64).

    Unclipped sequence i (n tokens, ratio s = exp(mean log-ratio)), per token weight c_i of the
    aggregation: 'sequence' d/dlogp_t = c_i (sum_u w_u) (-A s / n) (the ratio's gradient is
    through the mean); 'sequence_token' d/dlogp_t = c_i w_t (-A s). Clipped: 0.
    """
    b = lp.shape[0]
    grad = np.zeros_like(lp)
    n_seq, n_tok = (mask.sum(-1) > 0).sum(), mask.sum()
    for i in range(b):
        n = mask[i].sum()
        if n == 0:
            continue
        s = math.exp(np.sum((lp[i] - old[i])[mask[i]]) / n)
        if (adv[i] > 0 and s > 1 + eps_high) or (adv[i] < 0 and s < 1 - eps_low):
            continue
        c = {
            "seq_mean_token_mean": 1 / (n * n_seq),
            "token_mean": 1 / n_tok,
            "seq_mean_token_sum_norm": 1 / (b * max_len),
        }[aggregation]
        for t in np.flatnonzero(mask[i]):
            if level == "sequence":
                grad[i, t] = c * np.sum(w[i][mask[i]]) * (-adv[i] * s / n)
            else:
                grad[i, t] = c * w[i, t] * (-adv[i] * s)
    return grad


class GspoTokenWeightsTest(parameterized.TestCase):
    @parameterized.parameters(*losses.AGGREGATIONS)
    def test_both_gradients_against_their_written_forms(self, aggregation):
        rng = np.random.default_rng(8)
        b, t = 8, 6
        old = -rng.random((b, t)) * 3
        lp = old + rng.normal(size=(b, t)) * 0.05
        adv = rng.normal(size=b)
        mask = rng.random((b, t)) < np.linspace(0.2, 0.95, b)[:, None]
        mask[0] = False
        mask[1, :3] = True
        w = rng.uniform(0.3, 2.0, (b, t))  # token-level weights (tis_mode='token_*')
        kw = dict(eps_low=0.02, eps_high=0.03, aggregation=aggregation)
        grads = {}
        for level in ("sequence", "sequence_token"):
            want = _loop_gspo_grad(lp, old, adv, mask, w, level=level, max_len=t, **kw)
            with jax.enable_x64(True):
                grads[level] = jax.jit(
                    jax.grad(
                        lambda x, level=level: losses.policy_loss(
                            x,
                            old,
                            adv,
                            mask,
                            settings=_settings(importance_sampling_level=level, **kw),
                            is_weights_NxT=jnp.asarray(w),
                        )[0]
                    )
                )(jnp.asarray(lp))
            np.testing.assert_allclose(grads[level], want, rtol=1e-12, atol=1e-15, err_msg=level)
        # They differ (the issue measured 21-61%); with weights constant per sequence they agree.
        diff = np.abs(grads["sequence"] - grads["sequence_token"]).max()
        assert diff > 0.1 * np.abs(grads["sequence_token"]).max()
        w_seq = np.repeat(w[:, :1], t, axis=1)
        a = _loop_gspo_grad(lp, old, adv, mask, w_seq, level="sequence", max_len=t, **kw)
        b_ = _loop_gspo_grad(lp, old, adv, mask, w_seq, level="sequence_token", max_len=t, **kw)
        np.testing.assert_allclose(a, b_, rtol=1e-12, atol=1e-15)
