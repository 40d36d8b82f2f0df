"""Tests for algorithms.mmr: Algorithm 1 parity, invariances, masks, DRA, validation, registry."""

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized

from mmr_jax.algorithms import mmr

jax.config.update("jax_numpy_rank_promotion", "raise")

# Eager dispatch of the greedy loop is slow; tests that are not about eager mode use these.
mmr_jit = jax.jit(mmr.mmr_reweight)
mmr_aux_jit = jax.jit(mmr.mmr_reweight_with_aux)


# --- An independent plain-Python Algorithm 1 (MMR-GRPO paper), written from the pseudo-code ---


def _unit(v):
    n = math.sqrt(sum(x * x for x in v))
    return None if n == 0 else [x / n for x in v]


def _cos(a, b):
    return 0.0 if a is None or b is None else sum(x * y for x, y in zip(a, b, strict=True))


def reference_mmr(rewards, embeddings, lam=None, mask=None):
    """Returns (reweighted list, selection order list, lam) for one group, in plain Python."""
    g = len(rewards)
    keep = [i for i in range(g) if mask is None or mask[i]]
    out = [float(x) for x in rewards]
    if not keep:
        return out, [], lam
    r = [float(rewards[i]) for i in keep]
    e = [_unit([float(x) for x in embeddings[i]]) for i in keep]
    if lam is None:
        mean = sum(r) / len(r)
        std = math.sqrt(sum((x - mean) ** 2 for x in r) / len(r))
        lam = 1.0 / (1.0 + math.exp(-std))
    m = [[_cos(a, b) for b in e] for a in e]
    first = 0
    for a in range(len(r)):  # strict > keeps the lowest index on ties
        if r[a] > r[first]:
            first = a
    selected = [first]
    new = {first: r[first]}
    for _ in range(1, len(r)):
        best_i, best_score = None, None
        for a in range(len(r)):
            if a in new:
                continue
            best_sim = max(m[a][b] for b in selected)
            score = lam * r[a] - (1 - lam) * best_sim
            if best_score is None or score > best_score:
                best_i, best_score = a, score
        selected.append(best_i)
        new[best_i] = best_score
    for a, i in enumerate(keep):
        out[i] = new[a]
    return out, [keep[a] for a in selected], lam


# --- Case generator: exact dyadic data (true ties) and Gaussian data ---


def _structured_embeddings(rng, g, d):
    """Rows from a few prototypes with four +-0.5 entries (unit norm, exact cosines), some zero."""
    protos = np.zeros((4, d))
    for p in protos:
        p[rng.choice(d, 4, replace=False)] = rng.choice([-0.5, 0.5], 4)
    emb = protos[rng.integers(0, 4, g)] * rng.choice([0.25, 1.0, 4.0], (g, 1))
    emb[rng.random(g) < 0.15] = 0.0
    return emb


def _case(rng, g, d, kind):
    if kind == "structured":
        r = rng.integers(-4, 9, g) / 4.0  # multiples of 1/4: many exact ties
        if rng.random() < 0.2:
            r[:] = r[0]  # all-equal rewards
        emb = _structured_embeddings(rng, g, d)
    else:
        r = rng.normal(size=g)
        emb = rng.normal(size=(g, d))
        emb[rng.random(g) < 0.1] = 0.0
        if g > 1 and rng.random() < 0.3:
            emb[1] = emb[0]  # identical completions
    u = rng.random()
    if u < 0.3:
        mask = np.ones(g, bool)
    elif u < 0.6:
        mask = rng.random(g) < 0.75
    elif u < 0.95:  # ragged group: only the first k of G are real completions
        mask = np.arange(g) < rng.integers(1, g + 1)
    else:
        mask = np.zeros(g, bool)
    return r, emb, mask


# Each size costs two compilations, so the sizes are few; ragged masks cover every G in 1..64.
GROUP_SIZES = (1, 2, 3, 6, 16, 17, 64)
N_PER_SIZE = 48  # 7 sizes x 48 groups x 2 lambda modes = 672 random groups


class MmrReweightTest(chex.TestCase):
    @parameterized.parameters(*GROUP_SIZES)
    def test_matches_reference_loop(self, g):
        rng = np.random.default_rng(g)
        d = 8
        kinds = ["structured" if i % 2 else "gaussian" for i in range(N_PER_SIZE)]
        cases = [_case(rng, g, d, k) for k in kinds]
        r = np.stack([c[0] for c in cases])
        emb = np.stack([c[1] for c in cases])
        mask = np.stack([c[2] for c in cases])
        # Fixed lambdas are dyadic for dyadic data so real-number ties stay exact ties.
        fixed = np.array(
            [
                rng.choice([0.0, 0.25, 0.5, 0.75, 1.0])
                if k == "structured"
                else rng.choice([0.3, 0.7, 0.9])
                for k in kinds
            ]
        )
        # float64 so that non-tied candidates are never within rounding of each other.
        with jax.enable_x64(True):
            for lam in (None, fixed):
                got, aux = mmr_aux_jit(
                    jnp.asarray(r),
                    jnp.asarray(emb),
                    lam=None if lam is None else jnp.asarray(lam),
                    mask=jnp.asarray(mask),
                )
                got, order, lam_used = np.asarray(got), np.asarray(aux.order), np.asarray(aux.lam)
                for b in range(N_PER_SIZE):
                    want, want_order, want_lam = reference_mmr(
                        r[b], emb[b], None if lam is None else float(lam[b]), mask[b]
                    )
                    np.testing.assert_array_equal(order[b][: len(want_order)], want_order)
                    np.testing.assert_array_equal(order[b][len(want_order) :], -1)
                    np.testing.assert_allclose(got[b], want, rtol=0, atol=1e-12)
                    if want_lam is not None:
                        np.testing.assert_allclose(lam_used[b], want_lam, rtol=1e-12)

    @chex.variants(with_jit=True, without_jit=True)
    def test_hand_worked_example(self):
        # r = [1, 1, 0, 0.5]; rows 0 and 1 identical, row 2 orthogonal, row 3 zero; lam = 0.5.
        # pick 0 (argmax, lowest index of the tie), r~0 = 1. best_sim = [1, 1, 0, 0].
        # scores 0.5 r - 0.5 best: i=1: 0, i=2: 0, i=3: 0.25 -> pick 3, r~3 = 0.25.
        # best_sim unchanged (row 3 is zero); i=1: 0, i=2: 0 -> pick 1 (lower index), r~1 = 0.
        # last: i=2 -> r~2 = 0.
        r = jnp.array([1.0, 1.0, 0.0, 0.5])
        e = jnp.array([[3.0, 0.0], [3.0, 0.0], [0.0, 2.0], [0.0, 0.0]])
        fn = self.variant(lambda r, e: mmr.mmr_reweight_with_aux(r, e, lam=0.5))
        got, aux = fn(r, e)
        np.testing.assert_array_equal(got, [1.0, 0.0, 0.0, 0.25])
        np.testing.assert_array_equal(aux.order, [0, 3, 1, 2])

    @chex.variants(with_jit=True, without_jit=True)
    def test_jit_and_eager_agree(self):
        rng = np.random.default_rng(0)
        r = jnp.asarray(rng.normal(size=(3, 5)), jnp.float32)
        e = jnp.asarray(rng.normal(size=(3, 5, 16)), jnp.float32)
        mask = jnp.asarray(rng.random((3, 5)) < 0.8)
        got = self.variant(lambda r, e, m: mmr.mmr_reweight(r, e, mask=m))(r, e, mask)
        want = [reference_mmr(r[b], e[b], None, mask[b])[0] for b in range(3)]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)

    def test_lam_one_returns_rewards_in_descending_order(self):
        rng = np.random.default_rng(1)
        r = jnp.asarray(rng.integers(0, 3, (8, 16)) / 2.0, jnp.float32)  # ties on purpose
        e = jnp.asarray(rng.normal(size=(8, 16, 4)), jnp.float32)
        got, aux = mmr_aux_jit(r, e, lam=1.0)
        np.testing.assert_array_equal(got, r)
        # lam = 1 is plain reward ordering: a stable descending sort.
        np.testing.assert_array_equal(aux.order, np.argsort(-np.asarray(r), axis=-1, kind="stable"))

    def test_permuting_a_group_permutes_the_output(self):
        rng = np.random.default_rng(2)
        with jax.enable_x64(True):
            for g in (6, 64):
                r, e = rng.normal(size=g), rng.normal(size=(g, 12))
                perm = rng.permutation(g)
                base = np.asarray(mmr_jit(jnp.asarray(r), jnp.asarray(e)))
                permuted = mmr_jit(jnp.asarray(r[perm]), jnp.asarray(e[perm]))
                np.testing.assert_allclose(permuted, base[perm], rtol=0, atol=1e-12)

    def test_masked_entries_unchanged_and_without_influence(self):
        rng = np.random.default_rng(3)
        r, e = rng.normal(size=10).astype(np.float32), rng.normal(size=(10, 8)).astype(np.float32)
        mask = np.array([1, 0, 1, 1, 0, 1, 1, 1, 0, 1], bool)
        r_junk, e_junk = r.copy(), e.copy()
        r_junk[~mask], e_junk[~mask] = 1e3, e[0]  # would dominate argmax, std and similarity
        got = np.asarray(mmr_jit(jnp.asarray(r_junk), jnp.asarray(e_junk), mask=jnp.asarray(mask)))
        compact = mmr_jit(jnp.asarray(r[mask]), jnp.asarray(e[mask]))
        np.testing.assert_array_equal(got[~mask], r_junk[~mask])
        np.testing.assert_allclose(got[mask], compact, rtol=1e-6, atol=1e-6)

    @parameterized.parameters(None, 0.5)
    def test_fully_masked_group_unchanged(self, lam):
        r = jnp.array([[0.3, -1.0, 2.0], [1.0, 0.0, 1.0]])
        e = jnp.ones((2, 3, 4))
        mask = jnp.array([[False] * 3, [True] * 3])
        got, aux = mmr_aux_jit(r, e, lam=lam, mask=mask)
        np.testing.assert_array_equal(got[0], r[0])
        np.testing.assert_array_equal(aux.order[0], [-1, -1, -1])
        assert not np.array_equal(got[1], r[1])

    def test_group_of_one_keeps_its_reward(self):
        got = mmr_jit(jnp.array([[0.7]]), jnp.array([[[0.0, 1.0]]]))
        np.testing.assert_array_equal(got, np.float32([[0.7]]))

    def test_zero_and_identical_embeddings(self):
        # All-zero rows: every similarity is 0, so later picks get lam * r in reward order.
        r = jnp.array([0.5, 2.0, 1.0])
        got = mmr_jit(r, jnp.zeros((3, 5)), lam=0.75)
        np.testing.assert_array_equal(got, [0.375, 2.0, 0.75])
        # Identical rows: similarity 1 to the first pick: lam * r - (1 - lam).
        got = mmr_jit(r, jnp.ones((3, 5)), lam=0.75)
        np.testing.assert_allclose(got, [0.375 - 0.25, 2.0, 0.75 - 0.25], rtol=1e-6)

    def test_any_leading_shape(self):
        rng = np.random.default_rng(4)
        r = jnp.asarray(rng.normal(size=(5, 9, 5)), jnp.float32)
        e = jnp.asarray(rng.normal(size=(5, 9, 5, 7)), jnp.float32)
        got = mmr_jit(r, e)
        # Positive embeddings for DRA: Gaussian ones can put its denominator near 0.
        e_pos = jnp.abs(e)
        got_dra = jax.jit(mmr.dra_reweight)(r, e_pos)
        chex.assert_shape([got, got_dra], (5, 9, 5))
        for i in range(5):
            for j in range(9):
                # Batched and single Gram matmuls round differently (float32).
                np.testing.assert_allclose(got[i, j], mmr_jit(r[i, j], e[i, j]), rtol=1e-5)
                np.testing.assert_allclose(
                    got_dra[i, j], mmr.dra_reweight(r[i, j], e_pos[i, j]), rtol=1e-5
                )

    def test_gradients_are_finite(self):
        # Group 0 mixes a zero row and identical rows; group 1 has all-equal rewards (std 0).
        r = jnp.array([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
        e = jnp.array([[[1.0, 0.0], [0.0, 0.0], [1.0, 0.0], [0.0, 1.0]]] * 2)
        loss = lambda a, b: mmr.mmr_reweight(a, b).sum()
        g_r, g_e = jax.jit(jax.grad(loss, argnums=(0, 1)))(r, e)
        assert np.all(np.isfinite(g_r)) and np.all(np.isfinite(g_e))


class AdaptiveLambdaTest(chex.TestCase):
    def test_hand_values(self):
        # [0, 1]: mean 0.5, population std 0.5. [2, 2, 2]: std 0 -> sigmoid(0) = 0.5.
        # [0, 3, 9(masked)]: valid [0, 3], std 1.5.
        r = jnp.array([[0.0, 1.0, 0.0], [2.0, 2.0, 2.0], [0.0, 3.0, 9.0]])
        mask = jnp.array([[True, True, False], [True] * 3, [True, True, False]])
        got = mmr.adaptive_lambda(r, mask=mask)
        want = [1 / (1 + math.exp(-0.5)), 0.5, 1 / (1 + math.exp(-1.5))]
        np.testing.assert_allclose(got, want, rtol=1e-6)

    def test_fully_masked_group_gives_half(self):
        got = mmr.adaptive_lambda(jnp.array([[1.0, 5.0]]), mask=jnp.zeros((1, 2), bool))
        np.testing.assert_array_equal(got, [0.5])


class DraReweightTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_hand_worked_example(self):
        # rows: e0 = e1 = (1, 0), e2 = (0, 1), e3 = 0. cos(0,1) = 1, others 0.
        # r0 / (1 + 1) = 0.5, r1 / 2 = 1, r2 / 1 = 3, r3 / 1 = 4; masked entry 4 untouched and
        # its row (identical to e0) adds nothing to the sums.
        r = jnp.array([1.0, 2.0, 3.0, 4.0, 5.0])
        e = jnp.array([[2.0, 0.0], [5.0, 0.0], [0.0, 1.0], [0.0, 0.0], [1.0, 0.0]])
        mask = jnp.array([True, True, True, True, False])
        got = self.variant(lambda r, e, m: mmr.dra_reweight(r, e, mask=m))(r, e, mask)
        np.testing.assert_array_equal(got, [0.5, 1.0, 3.0, 4.0, 5.0])

    def test_matches_loop(self):
        rng = np.random.default_rng(5)
        r, e = rng.normal(size=(4, 6)), np.abs(rng.normal(size=(4, 6, 3)))
        got = jax.jit(mmr.dra_reweight)(jnp.asarray(r, jnp.float32), jnp.asarray(e, jnp.float32))
        for b in range(4):
            u = [_unit(row) for row in e[b]]
            want = [
                r[b, i] / (1 + sum(_cos(u[i], u[j]) for j in range(6) if j != i)) for i in range(6)
            ]
            np.testing.assert_allclose(got[b], want, rtol=1e-5)


class ReweightEntryTest(chex.TestCase):
    def test_registry_names(self):
        assert set(mmr.REWEIGHTERS) == {"none", "mmr", "dra"}
        with pytest.raises(ValueError, match="already registered"):
            mmr.register("mmr")(lambda *a, **k: None)

    def test_methods_dispatch(self):
        rng = np.random.default_rng(6)
        r, e = (
            rng.normal(size=(3, 4)).astype(np.float32),
            rng.normal(size=(3, 4, 5)).astype(np.float32),
        )
        np.testing.assert_array_equal(mmr.reweight("none", r, None), r)
        np.testing.assert_array_equal(mmr.reweight("mmr", r, e, lam=0.7), mmr_jit(r, e, lam=0.7))
        np.testing.assert_array_equal(mmr.reweight("dra", r, e), jax.jit(mmr.dra_reweight)(r, e))

    def test_batch_scope_is_one_group_over_all_completions(self):
        rng = np.random.default_rng(7)
        r, e = (
            rng.normal(size=(3, 4)).astype(np.float32),
            rng.normal(size=(3, 4, 5)).astype(np.float32),
        )
        got = mmr.reweight("mmr", r, e, scope="batch")
        want = mmr_jit(r.reshape(1, 12), e.reshape(1, 12, 5)).reshape(3, 4)
        np.testing.assert_array_equal(got, want)
        assert not np.allclose(got, mmr.reweight("mmr", r, e, scope="group"))

    @parameterized.named_parameters(
        ("nan_rewards", (2, 3), (2, 3, 4), "rewards", "nan_r"),
        ("inf_embeddings", (2, 3), (2, 3, 4), "embeddings", "inf_e"),
        ("embeddings_rank", (2, 3), (2, 3), "embeddings must have rank 3", None),
        ("mismatched_g", (2, 3), (2, 4, 4), r"embeddings of shape \(2, 4, 4\)", None),
        ("mismatched_lead", (2, 3), (5, 3, 4), r"rewards of shape \(2, 3\)", None),
        ("scalar_rewards", (), (4,), "rewards must have rank", None),
    )
    def test_bad_inputs_raise(self, r_shape, e_shape, match, poison):
        r, e = np.zeros(r_shape, np.float32), np.ones(e_shape, np.float32)
        if poison == "nan_r":
            r[0, 1] = np.nan
        if poison == "inf_e":
            e[1, 0, 2] = np.inf
        with pytest.raises(ValueError, match=match):
            mmr.reweight("mmr", r, e)

    def test_bad_mask_lam_method_scope_raise(self):
        r, e = np.zeros((2, 3), np.float32), np.ones((2, 3, 4), np.float32)
        with pytest.raises(ValueError, match=r"mask of shape \(3,\)"):
            mmr.reweight("mmr", r, e, mask=np.ones(3, bool))
        with pytest.raises(ValueError, match="lam"):
            mmr.reweight("mmr", r, e, lam=1.5)
        with pytest.raises(ValueError, match="unknown reweighting method"):
            mmr.reweight("smi", r, e)
        with pytest.raises(ValueError, match="scope"):
            mmr.reweight("mmr", r, e, scope="prompt")
        with pytest.raises(ValueError, match="dra reweighting takes no lam"):
            mmr.reweight("dra", r, e, lam=0.5)


def _cos64(e):
    """float64 cosines of [G, D] rows after max-abs scaling (exact enough at any scale)."""
    e = np.asarray(e, np.float64)
    amax = np.abs(e).max(-1, keepdims=True)
    u = e / np.where(amax > 0, amax, 1.0)
    n = np.linalg.norm(u, axis=-1, keepdims=True)
    u = np.divide(u, n, out=np.zeros_like(u), where=n > 0)
    return u @ u.T


class ReweightWithLambdaTest(chex.TestCase):
    """The lambda a step logs is the one the selection used (`MmrAux.lam`), in either scope."""

    def test_adaptive_lambda_is_the_selections_own(self):
        rng = np.random.default_rng(5)
        r = rng.normal(size=(3, 4)).astype(np.float32)
        e = rng.normal(size=(3, 4, 6)).astype(np.float32)
        mask = np.ones((3, 4), bool)
        mask[1, 2] = False
        out, lam = mmr.reweight_with_lambda("mmr", r, e, mask=mask)
        np.testing.assert_array_equal(out, mmr.reweight("mmr", r, e, mask=mask))
        # sigmoid of each group's population std over its valid rewards, by hand.
        want = [1 / (1 + math.exp(-np.std(r[i][mask[i]]))) for i in range(3)]
        np.testing.assert_allclose(lam, want, rtol=1e-6)
        _, lam_batch = mmr.reweight_with_lambda("mmr", r, e, mask=mask, scope="batch")
        np.testing.assert_allclose(lam_batch, [1 / (1 + math.exp(-np.std(r[mask])))], rtol=1e-6)

    def test_fixed_lambda_and_the_methods_without_one(self):
        r = np.array([[1.0, 0.0, 0.5]], np.float32)
        e = np.eye(3, dtype=np.float32)[None]
        np.testing.assert_array_equal(mmr.reweight_with_lambda("mmr", r, e, lam=0.25)[1], [0.25])
        assert mmr.reweight_with_lambda("dra", r, e)[1] is None
        assert mmr.reweight_with_lambda("none", r, None)[1] is None


class CosineSimilarityTest(chex.TestCase):
    def test_fast_path_agrees_with_the_scaled_form(self):
        e = np.random.default_rng(0).normal(size=(5, 6, 32)).astype(np.float32)
        fast = np.asarray(jax.jit(mmr.cosine_similarity)(e))
        scaled = np.asarray(jax.jit(mmr.cosine_similarity_scaled)(e))
        np.testing.assert_allclose(fast, scaled, rtol=0, atol=2e-6)
        np.testing.assert_allclose(fast[2], _cos64(e[2]), rtol=0, atol=2e-6)

    @parameterized.named_parameters(
        ("huge_row", 1e30),
        ("large_row", 1e20),
        ("tiny_row", 1e-30),
        ("small_row", 1e-18),
        ("zero_row", 0.0),
    )
    def test_extreme_rows_give_the_true_cosine(self, scale):
        # Unscaled, a 1e30 row overflows the Gram matrix (NaN) and a 1e-30 row underflows to a
        # zero diagonal (cosine 0): the guard must send such inputs to the scaled form. (XLA:CPU
        # flushes subnormals to zero, so rows below ~1e-38 are zero rows in either form.)
        rng = np.random.default_rng(1)
        e = rng.normal(size=(4, 16)).astype(np.float32)
        e[1] = (e[1] * np.float32(scale)).astype(np.float32)
        got = np.asarray(jax.jit(mmr.cosine_similarity)(e))
        want = _cos64(e)
        assert np.all(np.isfinite(got))
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-5)
        if scale:
            assert abs(got[1, 0]) > 1e-3  # the row is read as a real row, not as a zero row

    def test_masked_garbage_row_changes_no_real_cosine(self):
        e = np.random.default_rng(2).normal(size=(6, 16)).astype(np.float32)
        bad = e.copy()
        bad[3] = 1e35  # a padded slot holding garbage: it must not switch the path
        mask = np.array([1, 1, 1, 0, 1, 1], bool)
        f = jax.jit(mmr.cosine_similarity)
        real = np.ix_(mask, mask)
        np.testing.assert_array_equal(
            np.asarray(f(bad, mask=mask))[real], np.asarray(f(e, mask=mask))[real]
        )


# --- Batch scope: the released code's rule, written independently from its description ---


def released_batch_loop(rewards_bxg, embeddings_bxgxd):
    """One greedy MMR pass over all B*G completions of a micro-batch, as the released code does:
    lambda = sigmoid(population std of all B*G rewards); the first pick (argmax, lowest index)
    keeps its raw reward; each later pick (greedy, lowest index on ties) gets
    lam * r - (1 - lam) * max cosine to the picks so far. Plain Python over flat lists."""
    b, g = len(rewards_bxg), len(rewards_bxg[0])
    r = [float(x) for row in rewards_bxg for x in row]
    e = [_unit([float(x) for x in v]) for grp in embeddings_bxgxd for v in grp]
    n = len(r)
    mean = sum(r) / n
    lam = 1.0 / (1.0 + math.exp(-math.sqrt(sum((x - mean) ** 2 for x in r) / n)))
    first = max(range(n), key=lambda i: (r[i], -i))
    out, picked = list(r), [first]
    while len(picked) < n:
        best = None
        for i in range(n):
            if i in picked:
                continue
            score = lam * r[i] - (1 - lam) * max(_cos(e[i], e[j]) for j in picked)
            if best is None or score > best[1]:
                best = (i, score)
        out[best[0]] = best[1]
        picked.append(best[0])
    return [out[k * g : (k + 1) * g] for k in range(b)], lam


class BatchScopeTest(chex.TestCase):
    @parameterized.parameters((2, 4), (3, 6), (4, 8))
    def test_batch_scope_matches_the_released_rule(self, b, g):
        rng = np.random.default_rng(b * g)
        for trial in range(4):
            # Binary rewards (many ties, some uniform groups) and continuous ones.
            r = (rng.random((b, g)) < 0.5).astype(np.float32)
            if trial % 2:
                r = (r + rng.normal(size=(b, g))).astype(np.float32)
            e = rng.normal(size=(b, g, 8)).astype(np.float32)
            want, lam = released_batch_loop(r.tolist(), e.tolist())
            got = np.asarray(mmr.reweight("mmr", r, e, scope="batch"))
            np.testing.assert_allclose(got, np.array(want), rtol=0, atol=1e-5)
            # One lambda for the batch, from the std of all its rewards (not per group).
            np.testing.assert_allclose(
                float(mmr.adaptive_lambda(r.reshape(1, -1))[0]), lam, rtol=1e-6
            )
            # The single first pick of the batch keeps its raw reward; in group scope every
            # group's own first pick does, so the two scopes differ.
            top = np.unravel_index(np.argmax(r), r.shape)
            assert got[top] == r[top]
            assert not np.allclose(got, np.asarray(mmr.reweight("mmr", r, e, scope="group")))
