"""Property-based tests of mmr_jax.algorithms.mmr (issue 19): MMR and DRA over fuzzed groups.

Each case is a batch of padded groups (tests/support/fuzz_cases.py) in float32 or bfloat16 with
magnitudes from 1e-30 to 1e30, ties, duplicate, zero and antipodal embeddings and random masks.
Properties: finite output; masked entries unchanged and without influence (garbage written into them
changes no valid output, bit for bit); the greedy run certified step by step in float64 (Algorithm 1
with lowest-index ties); permuting a group permutes its output; lam = 1 returns the rewards; the
host entry rejects non-finite input naming the argument.
"""

import jax
import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from mmr_jax.algorithms import mmr

from support import fuzz_cases

jax.config.update("jax_numpy_rank_promotion", "raise")

# Two shape families: G = 8 takes the unrolled greedy loop, G = 24 the fori_loop one.
FAMILIES = ((3, 8, 6), (2, 24, 5))
_MMR = jax.jit(mmr.mmr_reweight_with_aux)
_DRA = jax.jit(mmr.dra_reweight)


def _lam(case):
    b, lam = case["rewards"].shape[0], case["lam"]
    if lam is None:
        return None
    value = case["rng"].random(b) if lam == "random" else np.full(b, lam)
    return np.asarray(value, case["dtype"])


def _run(fn, case, rewards=None, embeddings=None, mask=None, **kw):
    dt = case["dtype"]
    r = np.asarray(case["rewards"] if rewards is None else rewards, dt)
    e = np.asarray(case["embeddings"] if embeddings is None else embeddings, dt)
    # One device-to-host transfer of the whole result: indexing device arrays element by element
    # in the checks cost more than the kernels.
    return jax.device_get(fn(r, e, mask=case["mask"] if mask is None else mask, **kw))


def _with_garbage(case):
    """rewards, embeddings with every masked entry (reward and whole row) replaced by garbage."""
    rng, m = case["rng"], case["mask"]
    r = np.where(m, case["rewards"], fuzz_cases.garbage_like(rng, case["rewards"]))
    e = np.where(m[..., None], case["embeddings"], fuzz_cases.garbage_like(rng, case["embeddings"]))
    return r, e


def _f64(x):
    return np.asarray(x).astype(np.float64)


def _score_tol(dtype, lam, r, score):
    """Bound on |kernel score - float64 score|: rounding of lam * r and of the result, plus the
    cosine's error (row scaling, Gram matrix and normalisation: a few ulps of 1 per entry)."""
    e = fuzz_cases.eps(dtype)
    return 4 * e * (np.abs(lam * r) + np.abs(score)) + 16 * e * (1.0 - lam)


def certify_group(r, cos, lam, valid, order, out, dtype):
    """Checks one group's greedy run (the kernel's order and outputs) in float64.

    r, out: [G] float64 values of the kernel's input and output; cos: [G, G] float64 cosines of
    the kernel's input; lam: the kernel's lambda. Returns the smallest margin by which a pick beat
    the best other candidate (0 at an exact tie), for callers that need unambiguous runs.
    """
    idx = np.flatnonzero(valid)
    n = idx.size
    np.testing.assert_array_equal(np.sort(order[:n]), idx)
    np.testing.assert_array_equal(order[n:], -1)
    if n == 0:
        return np.inf
    first, top = order[0], r[idx].max()
    # The first pick is exact: argmax of the rewards, lowest index among ties, raw reward kept.
    assert first == idx[r[idx] == top][0] and out[first] == r[first]
    below = r[idx][r[idx] < top]
    margin = 0.0 if np.sum(r[idx] == top) > 1 else (top - below.max() if below.size else np.inf)
    best = cos[:, first].copy()
    picked = np.zeros(valid.shape, bool)
    picked[first] = True
    for p in order[1:n]:
        cand = valid & ~picked
        scores = lam * r - (1 - lam) * best
        tol = _score_tol(dtype, lam, r, scores)
        others = cand.copy()
        others[p] = False
        rival = scores[others].max() if others.any() else -np.inf
        assert cand[p], f"pick {p} is not an unpicked valid entry"
        assert scores[p] >= rival - tol[p] - tol[others].max(initial=0.0), (p, scores, rival)
        assert abs(out[p] - scores[p]) <= tol[p], (p, out[p], scores[p], tol[p])
        margin = min(margin, scores[p] - rival - 2 * tol[p] - tol[others].max(initial=0.0))
        best = np.maximum(best, cos[:, p])
        picked[p] = True
    return margin


def _adaptive_lam_ref(r, valid):
    x = r[valid]
    if x.size == 0:
        return 0.5
    # float64 std through a scaled sum: the magnitudes here overflow a float64 square too.
    dev = x - x.mean()
    s = np.abs(dev).max()
    std = 0.0 if s == 0 else s * np.sqrt(np.mean((dev / s) ** 2))
    return 1 / (1 + np.exp(-std)) if std < 700 else 1.0


# --- MMR ---------------------------------------------------------------------------------------


@settings(max_examples=fuzz_cases.examples("mmr_finite_and_masked"))
@given(fuzz_cases.mmr_cases(FAMILIES))
def _prop_mmr_finite_and_masked(case):
    lam = _lam(case)
    out, aux = _run(_MMR, case, lam=lam)
    m, r = case["mask"], fuzz_cases.cast(case["rewards"], case["dtype"])
    assert out.dtype == case["dtype"] and np.all(np.isfinite(_f64(out)))
    np.testing.assert_array_equal(_f64(out)[~m], r[~m])
    lam_got = _f64(aux.lam)
    assert np.all((lam_got >= (0.5 if lam is None else 0.0)) & (lam_got <= 1.0))
    g_r, g_e = _with_garbage(case)
    out2, aux2 = _run(_MMR, case, rewards=g_r, embeddings=g_e, lam=lam)
    np.testing.assert_array_equal(_f64(out2)[m], _f64(out)[m])
    np.testing.assert_array_equal(aux2.order, aux.order)
    np.testing.assert_array_equal(aux2.lam, aux.lam)
    fuzz_cases.count("mmr_finite_and_masked")


def test_mmr_finite_and_masked_entries_without_influence(record_property):
    fuzz_cases.check(_prop_mmr_finite_and_masked, "mmr_finite_and_masked", record_property)


@settings(max_examples=fuzz_cases.examples("mmr_certificate"))
@given(fuzz_cases.mmr_cases(FAMILIES))
def _prop_mmr_certificate(case):
    dt, m = case["dtype"], case["mask"]
    out, aux = _run(_MMR, case, lam=_lam(case))
    r, e = fuzz_cases.cast(case["rewards"], dt), fuzz_cases.cast(case["embeddings"], dt)
    out, lam, order = _f64(out), _f64(aux.lam), np.asarray(aux.order)
    for b in range(r.shape[0]):
        if case["lam"] is None:
            want = _adaptive_lam_ref(r[b], m[b])
            spread = np.abs(r[b][m[b]]).max(initial=0.0)
            # lam = sigmoid(std): the std's rounding (sums of G terms) times the slope.
            tol = 4 * fuzz_cases.eps(dt) + want * (1 - want) * (r.shape[1] + 4) * (
                fuzz_cases.eps(dt) * spread
            )
            assert abs(lam[b] - want) <= tol, (lam[b], want)
        certify_group(r[b], fuzz_cases.cosines(e[b]), lam[b], m[b], order[b], out[b], dt)
    fuzz_cases.count("mmr_certificate")


def test_mmr_greedy_run_certified_in_float64(record_property):
    fuzz_cases.check(_prop_mmr_certificate, "mmr_certificate", record_property)


def _permute(x, perm_BxG):
    """x [B, G, ...] with each group's entries reordered by perm_BxG."""
    return np.take_along_axis(x, perm_BxG.reshape(perm_BxG.shape + (1,) * (x.ndim - 2)), 1)


@settings(max_examples=fuzz_cases.examples("mmr_permutation"))
@given(fuzz_cases.mmr_cases(FAMILIES, reward_kinds=("normal",), dtypes=(np.dtype(np.float32),)))
def _prop_mmr_permutation(case):
    # Ties make the lowest-index rule depend on the order, so the property holds where every
    # pick wins by more than the rounding (certify_group's margin); lam = 0 ties zero rows.
    assume(case["lam"] != 0.0)
    lam = _lam(case)
    dt, m = case["dtype"], case["mask"]
    out, aux = _run(_MMR, case, lam=lam)
    out, lam_used = _f64(out), _f64(aux.lam)
    r, e = fuzz_cases.cast(case["rewards"], dt), fuzz_cases.cast(case["embeddings"], dt)
    margins = [
        certify_group(r[b], fuzz_cases.cosines(e[b]), lam_used[b], m[b], aux.order[b], out[b], dt)
        for b in range(r.shape[0])
    ]
    assume(min(margins) > 0)
    perm = np.stack([case["rng"].permutation(r.shape[1]) for _ in range(r.shape[0])])
    out_p, aux_p = _run(
        _MMR,
        case,
        rewards=_permute(case["rewards"], perm),
        embeddings=_permute(case["embeddings"], perm),
        mask=_permute(m, perm),
        lam=lam,
    )
    tol = _score_tol(dt, lam_used[:, None], _permute(r, perm), _permute(out, perm))
    np.testing.assert_array_less(np.abs(_f64(out_p) - _permute(out, perm)), tol + 1e-300)
    # The same completions are picked in the same order, under their new indices.
    inv = np.argsort(perm, axis=1)
    picked = aux.order >= 0
    moved = np.take_along_axis(inv, np.where(picked, aux.order, 0), 1)
    np.testing.assert_array_equal(aux_p.order, np.where(picked, moved, -1))
    fuzz_cases.count("mmr_permutation")


def test_mmr_permuting_a_group_permutes_its_output(record_property):
    fuzz_cases.check(_prop_mmr_permutation, "mmr_permutation", record_property)


@settings(max_examples=fuzz_cases.examples("mmr_lam_one"))
@given(fuzz_cases.mmr_cases(FAMILIES), st.booleans())
def _prop_mmr_lam_one(case, adaptive):
    dt, m = case["dtype"], case["mask"]
    r = fuzz_cases.cast(case["rewards"], dt)
    if adaptive:
        # The adaptive lambda is 1 exactly once sigmoid(std) rounds to 1 (std > ~17 in float32).
        out, aux = _run(_MMR, case, lam=None)
        hit = _f64(aux.lam) == 1.0
        np.testing.assert_array_equal(_f64(out)[hit], r[hit])
    else:
        out, aux = _run(_MMR, case, lam=np.ones(r.shape[0], dt))
        np.testing.assert_array_equal(_f64(out), r)
        # Order: valid entries by decreasing reward, lowest index first among ties.
        for b in range(r.shape[0]):
            n = m[b].sum()
            key = np.lexsort((np.arange(r.shape[1]), -r[b]))
            np.testing.assert_array_equal(aux.order[b][:n], key[m[b][key]])
    fuzz_cases.count("mmr_lam_one")


def test_mmr_lam_one_returns_the_rewards(record_property):
    fuzz_cases.check(_prop_mmr_lam_one, "mmr_lam_one", record_property)


# --- DRA ---------------------------------------------------------------------------------------


def _dra_ref(r, e, valid, dtype):
    """float64 DRA of one group, with the kernel's floor; also each entry's tolerance."""
    cos = fuzz_cases.cosines(e)
    pair = valid[:, None] & valid[None, :] & ~np.eye(r.size, dtype=bool)
    denom = np.maximum(1 + np.sum(np.where(pair, cos, 0.0), axis=-1), fuzz_cases.eps(dtype))
    want = np.where(valid, r / denom, r)
    # out = r / denom: the denominator's error (G cosines) relative to it, plus two roundings.
    e_ = fuzz_cases.eps(dtype)
    tol = np.abs(want) * (16 * e_ * r.size / denom + 4 * e_)
    return want, tol


@settings(max_examples=fuzz_cases.examples("dra_properties"))
@given(fuzz_cases.mmr_cases(FAMILIES))
def _prop_dra(case):
    dt, m = case["dtype"], case["mask"]
    out = _f64(_run(_DRA, case))
    r, e = fuzz_cases.cast(case["rewards"], dt), fuzz_cases.cast(case["embeddings"], dt)
    assert np.all(np.isfinite(out))
    assert np.all(out * r >= 0), "the reward's sign flipped"
    np.testing.assert_array_equal(out[~m], r[~m])
    g_r, g_e = _with_garbage(case)
    np.testing.assert_array_equal(_f64(_run(_DRA, case, rewards=g_r, embeddings=g_e))[m], out[m])
    perm = np.stack([case["rng"].permutation(r.shape[1]) for _ in range(r.shape[0])])
    out_p = _f64(
        _run(
            _DRA,
            case,
            rewards=_permute(case["rewards"], perm),
            embeddings=_permute(case["embeddings"], perm),
            mask=_permute(m, perm),
        )
    )
    for b in range(r.shape[0]):
        want, tol = _dra_ref(r[b], e[b], m[b], dt)
        np.testing.assert_array_less(np.abs(out[b] - want), tol + 1e-300)
        np.testing.assert_array_less(np.abs(out_p[b] - want[perm[b]]), tol[perm[b]] + 1e-300)
    fuzz_cases.count("dra_properties")


def test_dra_finite_masked_permutation_and_float64_reference(record_property):
    fuzz_cases.check(_prop_dra, "dra_properties", record_property)


# --- Host entry --------------------------------------------------------------------------------

_HOST_SHAPE = FAMILIES[0]  # the kernels compiled for the first family serve as the reference


@settings(max_examples=fuzz_cases.examples("host_entry"))
@given(
    st.sampled_from(["rewards", "embeddings", "mask", "lam", None]),
    st.sampled_from([np.nan, np.inf, -np.inf]),
    st.sampled_from(["mmr", "dra"]),
    st.sampled_from([np.dtype(np.float32), fuzz_cases.BF16, np.dtype(np.float64)]),
    st.integers(0, 2**32 - 1),
)
def _prop_host_entry(where, bad, method, dtype, seed):
    rng = np.random.default_rng(seed)
    b, g, d = _HOST_SHAPE
    r = np.asarray(rng.normal(size=(b, g)), dtype)
    e = np.asarray(rng.normal(size=(b, g, d)), dtype)
    mask = rng.random((b, g)) < 0.7
    lam = None
    if where == "rewards":
        r[rng.integers(b), rng.integers(g)] = bad  # masked or not: rejected either way
    elif where == "embeddings":
        e[rng.integers(b), rng.integers(g), rng.integers(d)] = bad
    elif where == "mask":
        mask = mask.astype(np.float32)
        mask[rng.integers(b), rng.integers(g)] = bad
    elif where == "lam":
        lam, method = float(bad), "mmr"
    if where is None:
        # Clean input in any float dtype, bfloat16 included, goes through to the kernel.
        got = mmr.reweight(method, r, e, mask=mask)
        assert got.dtype == jax.dtypes.canonicalize_dtype(r.dtype)  # float64 -> float32 without x64
        want = _MMR(r, e, mask=mask)[0] if method == "mmr" else _DRA(r, e, mask=mask)
        np.testing.assert_array_equal(_f64(got), _f64(want))
    else:
        with pytest.raises(ValueError, match=f"^{where} "):
            mmr.reweight(method, r, e, mask=mask, lam=lam)
    fuzz_cases.count("host_entry")


def test_host_entry_rejects_non_finite_input_naming_it(record_property):
    fuzz_cases.check(_prop_host_entry, "host_entry", record_property)


@pytest.mark.parametrize(
    "r, e",
    [
        # The inputs that failed before the fixes (issue 19 fuzzing), as regression cases.
        ([[1.0, 0.0, 0.5]], [[[1e30, 1e30], [-1e30, 1e30], [1e30, -1e30]]]),  # Gram overflow: NaN
        ([[1.0, 0.0, 0.5]], [[[1e-30, 0.0], [1e-30, 0.0], [0.0, 1e-30]]]),  # underflow: cos 0
    ],
)
def test_cosine_is_scale_invariant_at_extreme_magnitudes(r, e):
    r, e = np.asarray(r, np.float32), np.asarray(e, np.float32)
    want = _MMR(r, e / np.abs(e).max(axis=-1, keepdims=True))[0]
    np.testing.assert_allclose(_MMR(r, e)[0], want, rtol=1e-6)
    assert np.all(np.isfinite(want))


def test_dra_antipodal_pair_stays_finite():
    # 1 + cos = 1 - 1 = 0 exactly: r / 0 was inf before the floor.
    got = _DRA(np.ones((1, 2), np.float32), np.asarray([[[1.0, 0.0], [-1.0, 0.0]]], np.float32))
    assert np.all(np.isfinite(got)) and np.all(np.asarray(got) > 0)


def test_ci_budget_is_at_least_10000_cases():
    assert sum(fuzz_cases.WEIGHTS.values()) * 100 >= 10_000
    assert settings.get_profile("ci").max_examples == 100
