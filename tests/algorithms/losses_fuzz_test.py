"""Property-based tests of algorithms.losses (issue 19): the policy loss over fuzzed batches.

Cases: [B, T] = [8, 12] batches (fewer rows and tokens by masking), float32 or bfloat16, every
aggregation, no KL or k1/k2/k3, token ratios or GSPO's sequence ratios (issue 37), log-probs
down to about -60 with policy/old differences up to 5 nats, advantages of magnitude 1e-30 to
1e30 (ratio * A stays far from overflow: finite input the objective can represent).
Properties: finite loss, metrics and gradient; zero gradient on masked tokens; garbage (NaN,
inf, 1e30) at masked positions changes nothing, bit for bit; the loss matches a float64
reference; summing minibatch losses and gradients over `minibatch.split` minibatches with the
full batch's `loss_denominator` as normaliser gives the full batch's.
"""

import functools

import jax
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from mmr_jax.algorithms import losses
from mmr_jax.step import minibatch

from support import fuzz_cases, testing

jax.config.update("jax_numpy_rank_promotion", "raise")

B, T = 8, 12
KLS = (None, "k1", "k2", "k3")
BETA = 0.1
_settings = testing.loss_settings  # the loss section policy_loss reads


# (aggregation, KL estimator, importance sampling level): every token-level variant, and GSPO
# (no KL: its paper's setting) and GSPO-token (with k3) over every aggregation.
VARIANTS = [(a, kl, "token") for a in losses.AGGREGATIONS for kl in KLS] + [
    (a, kl, level)
    for a in losses.AGGREGATIONS
    for kl, level in ((None, "sequence"), ("k3", "sequence_token"))
]


def _loss_grad_all(logps, old, adv, mask, ref, eps_low, eps_high, mcl, normalisers, *, variants):
    """{'aggregation/kl/level': (loss, metrics, grad wrt logps)} for every variant on one batch:
    one compiled program per dtype and shape instead of one per variant (compiles dominate).
    normalisers: None, or [3] float32, the normaliser of each aggregation (AGGREGATIONS order)."""
    out = {}
    for aggregation, kl, level in variants:
        i = losses.AGGREGATIONS.index(aggregation)
        normaliser = None if normalisers is None else normalisers[i]

        def f(x, aggregation=aggregation, kl=kl, normaliser=normaliser, level=level):
            return losses.policy_loss(
                x,
                old,
                adv,
                mask,
                settings=_settings(
                    eps_low=eps_low,
                    eps_high=eps_high,
                    aggregation=aggregation,
                    beta=0.0 if kl is None else BETA,
                    kl_estimator=kl or "k3",
                    importance_sampling_level=level,
                ),
                ref_logps_NxT=None if kl is None else ref,
                max_completion_len=mcl,
                normaliser=normaliser,
            )

        (loss, metrics), grad = jax.value_and_grad(f, has_aux=True)(logps)
        out[f"{aggregation}/{kl}/{level}"] = (loss, metrics, grad)
    return out


_LOSS_GRAD = jax.jit(functools.partial(_loss_grad_all, variants=VARIANTS))
# Accumulation depends on the aggregation, not on the KL estimator: one KL variant keeps the
# vmapped program (compiled per minibatch count) small.
ACC_VARIANTS = [(a, kl, "token") for a in losses.AGGREGATIONS for kl in (None, "k3")] + [
    (a, None, "sequence") for a in losses.AGGREGATIONS
]
# Minibatches as the train step forms them (`_split`): each gets the full batch's normaliser.
_MINIBATCH_LOSS_GRAD = jax.jit(
    jax.vmap(
        functools.partial(_loss_grad_all, variants=ACC_VARIANTS),
        in_axes=(0, 0, 0, 0, 0, None, None, None, None),
    )
)

CASES = st.tuples(
    st.integers(0, 2**32 - 1),
    st.integers(-30, 30),  # advantage magnitude exponent
    st.sampled_from([0.0, 0.0, 1e-3, 0.3, 5.0]),  # spread of logp - old (0: the first pass)
    st.sampled_from([0.0, 1e-3, 0.1, 2.0]),  # spread of ref - logp
    st.sampled_from([1.0, 0.9, 0.5, 0.1, 0.0]),  # token density
    st.sampled_from([(0.2, 0.2), (0.2, 0.28), (0.0, 0.0), (1.0, 10.0)]),
)


def _make(args, dtype):
    seed, adv_exp, spread, ref_spread, density, (eps_low, eps_high) = args
    rng = np.random.default_rng(seed)
    b, t = int(rng.integers(1, B + 1)), int(rng.integers(1, T + 1))
    old = -rng.exponential(10.0 ** rng.uniform(-3, 1), size=(B, T))
    logps = np.minimum(old + np.clip(rng.normal(size=(B, T)) * spread, -5, 5), 0.0)
    ref = np.minimum(logps + np.clip(rng.normal(size=(B, T)) * ref_spread, -5, 5), 0.0)
    adv = rng.normal(size=B) * 10.0**adv_exp
    adv[rng.random(B) < 0.2] = 0.0
    mask = rng.random((B, T)) < density
    mask[b:], mask[:, t:] = False, False
    arrays = {"logps": logps, "old": old if spread else logps, "adv": adv, "ref": ref}
    arrays = {k: np.asarray(v, dtype) for k, v in arrays.items()}
    scalars = (eps_low, eps_high, int(rng.integers(T, 2 * T)))
    return arrays, mask, scalars, rng


def _args(arrays, mask):
    return arrays["logps"], arrays["old"], arrays["adv"], mask, arrays["ref"]


def _reference(arrays, mask, scalars, aggregation, kl, level="token"):
    """float64 (loss, error scale) from the module docstring's formulas. The scale sums each
    token's pieces times (1 + the log-probs it subtracts): exp(logp - old) and the KL inherit
    the rounding of those differences, relative to the log-probs' magnitudes."""
    lp, old, ref = (arrays[k].astype(np.float64) for k in ("logps", "old", "ref"))
    adv = arrays["adv"].astype(np.float64)[:, None]
    eps_low, eps_high, mcl = scalars
    ratio = np.exp(lp - old)
    if level != "token":  # GSPO: exp of the mean log-ratio of each sequence's valid tokens
        n = np.maximum(mask.sum(-1, keepdims=True), 1)
        ratio = np.exp(np.sum(np.where(mask, lp - old, 0.0), -1, keepdims=True) / n)
        ratio = np.broadcast_to(ratio, lp.shape)
    term = -np.minimum(ratio * adv, np.clip(ratio, 1 - eps_low, 1 + eps_high) * adv)
    mag = np.abs(ratio * adv) * (1 + np.abs(lp) + np.abs(old))
    if kl is not None:
        d = ref - lp
        term = term + BETA * {"k1": -d, "k2": 0.5 * d**2, "k3": np.expm1(d) - d}[kl]
        mag = mag + BETA * (np.abs(d) + d**2 + np.exp(d)) * (1 + np.abs(lp) + np.abs(ref))
    m = mask.astype(np.float64)
    weight = m
    if aggregation == "seq_mean_token_mean":
        weight = m / np.maximum(m.sum(-1, keepdims=True), 1)
        den = np.sum(mask.any(-1))
    elif aggregation == "token_mean":
        den = m.sum()
    else:
        den = B * mcl
    den = max(den, 1.0)
    return np.sum(np.where(mask, weight * term, 0.0)) / den, np.sum(weight * mag) / den


@settings(max_examples=fuzz_cases.examples("loss_finite_and_grad"))
@given(CASES, st.sampled_from(fuzz_cases.DTYPES))
def _prop_loss(args, dtype):
    arrays, mask, scalars, rng = _make(args, dtype)
    # One device-to-host transfer per call: per-element transfers cost more than the kernels.
    got = jax.device_get(_LOSS_GRAD(*_args(arrays, mask), *scalars, None))
    # Garbage at masked positions (NaN, inf or huge) must change nothing, bit for bit.
    poison = rng.choice([np.nan, np.inf, -np.inf, 1e30, -1e30], size=mask.shape)
    dirty = {k: np.where(mask, v, poison).astype(dtype) if v.ndim == 2 else v
             for k, v in arrays.items()}  # fmt: skip
    got_dirty = jax.device_get(_LOSS_GRAD(*_args(dirty, mask), *scalars, None))
    tol = 4 * (B * T) * fuzz_cases.eps(dtype)  # a sum of up to B * T terms in the input dtype
    for aggregation, kl, level in VARIANTS:
        loss, metrics, grad = got[f"{aggregation}/{kl}/{level}"]
        loss, grad = np.float64(loss), np.asarray(grad).astype(np.float64)
        assert np.isfinite(loss) and np.all(np.isfinite(grad))
        assert not np.any(grad[~mask]), "gradient on a masked token"
        metrics = {k: np.float64(v) for k, v in metrics.items()}
        if not mask.any():
            # No token: min / max over nothing are the identities of the train step's min / max
            # reduction over minibatches; every other metric is finite.
            assert metrics.pop("ratio_min") == np.inf and metrics.pop("ratio_max") == -np.inf
        assert all(np.isfinite(v) for v in metrics.values()), metrics
        if kl in ("k2", "k3"):
            assert metrics["kl"] >= 0, "k2 and k3 estimate KL with terms >= 0"
        want, scale = _reference(arrays, mask, scalars, aggregation, kl, level)
        assert abs(loss - want) <= tol * scale + 1e-300, (aggregation, kl, level, loss, want)
        loss2, _, grad2 = got_dirty[f"{aggregation}/{kl}/{level}"]
        assert loss2 == loss and np.array_equal(grad2, grad), "masked garbage leaked"
    fuzz_cases.count("loss_finite_and_grad")


def test_loss_and_gradient_finite_zero_on_masked_and_garbage_proof(record_property):
    fuzz_cases.check(_prop_loss, "loss_finite_and_grad", record_property)


@settings(max_examples=fuzz_cases.examples("loss_accumulation"))
@given(CASES, st.sampled_from([2, 4]))
def _prop_accumulation(args, m):
    arrays, mask, scalars, _ = _make(args, np.float32)
    full = jax.device_get(_LOSS_GRAD(*_args(arrays, mask), *scalars, None))
    split = [minibatch.split(x, m) for x in _args(arrays, mask)]
    e = fuzz_cases.eps(np.float32)
    normalisers = np.stack([
        losses.loss_denominator(mask, aggregation=a, max_completion_len=scalars[2])
        for a in losses.AGGREGATIONS
    ])  # fmt: skip
    parts = jax.device_get(_MINIBATCH_LOSS_GRAD(*split, *scalars, normalisers))
    for aggregation, kl, level in ACC_VARIANTS:
        key = f"{aggregation}/{kl}/{level}"
        loss_m, _, grad_m = parts[key]
        full_loss, _, full_grad = full[key]
        _, scale = _reference(arrays, mask, scalars, aggregation, kl, level)
        # Both sums add the same terms in different orders; each token's gradient is the same
        # product (its weight, the shared normaliser), so it agrees to rounding.
        err = abs(np.sum(np.float64(loss_m)) - np.float64(full_loss))
        assert err <= 4 * B * T * e * scale + 1e-300, key
        np.testing.assert_allclose(
            np.asarray(grad_m).reshape(B, T), full_grad, rtol=4 * e, atol=1e-30, err_msg=key
        )
    fuzz_cases.count("loss_accumulation")


def test_minibatch_accumulation_equals_full_batch(record_property):
    fuzz_cases.check(_prop_accumulation, "loss_accumulation", record_property)


def test_k3_is_non_negative_near_zero():
    # Found by fuzzing: exp(d) - d - 1 in bfloat16 gave -0.0039 for d = 0.01 (true 5e-5).
    lp = np.asarray([[-0.5, -0.01, -2.0]], fuzz_cases.BF16)
    ref = np.asarray(lp.astype(np.float32) + [[1e-4, 0.01, -3e-3]], fuzz_cases.BF16)
    got = np.asarray(losses.kl_divergence(lp, ref, estimator="k3")).astype(np.float64)
    d = ref.astype(np.float64) - lp.astype(np.float64)
    assert np.all(got >= 0)
    # bfloat16 rounds expm1(d) to 2^-8 relative: an absolute error up to ~eps * |d|.
    np.testing.assert_array_less(
        np.abs(got - (np.expm1(d) - d)), 2 * fuzz_cases.eps(lp.dtype) * np.abs(d) + 1e-30
    )
