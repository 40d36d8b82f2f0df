"""Shared pieces of the property-based tests (tests/algorithms/*_fuzz_test.py): case generators and
counts.

Hypothesis draws the structure of a case (sizes, mask density, magnitudes, which ties, duplicate,
zero or antipodal rows to plant, dtype) and a seed; NumPy fills the arrays from the seed. Drawing
every float through hypothesis costs milliseconds per case, and the structural draws are where the
edge cases live. Cases are padded into a few fixed maximum shapes with masks (and zero embedding
columns, which change no cosine), so each jitted kernel compiles once per shape family instead of
once per example.

Budgets: every property runs `examples(weight)` cases, `weight` times the profile's max_examples
(tests/conftest.py: 'ci' by default, 'deep' with HYPOTHESIS_PROFILE=deep). `check` runs a property,
asserts that it saw that many cases and records the count for the session summary.
"""

import collections

import hypothesis
import ml_dtypes
import numpy as np
from hypothesis import strategies as st

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = (np.dtype(np.float32), BF16)
# Budget weights per property (x the profile's max_examples, 100 in 'ci'): the CI suite must
# generate at least 10,000 cases (asserted in test_ci_budget).
WEIGHTS = {
    "mmr_finite_and_masked": 14,
    "mmr_certificate": 14,
    "mmr_permutation": 10,
    "mmr_lam_one": 10,
    "dra_properties": 11,
    "host_entry": 8,
    "advantages_properties": 19,
    "loss_finite_and_grad": 11,
    "loss_accumulation": 5,
}
_COUNTS = collections.Counter()


def examples(name: str) -> int:
    return hypothesis.settings().max_examples * WEIGHTS[name]


def count(name: str) -> None:
    """Marks one checked case of property `name` (call it after any `assume`)."""
    _COUNTS[name] += 1


def check(prop, name: str, record_property) -> None:
    """Runs the @given property `prop`, then asserts it checked its budget of cases."""
    _COUNTS[name] = 0
    prop()
    n = _COUNTS[name]
    record_property("fuzz_examples", n)
    assert n >= examples(name), f"{name}: only {n} of {examples(name)} cases were checked"


def eps(dtype) -> float:
    return float(ml_dtypes.finfo(dtype).eps)


# --- Rewards and embeddings ----------------------------------------------------------------------


# (base exponent, spread): values get magnitudes 10^k, k in base +- spread within [-30, 30].
MAGNITUDES = st.tuples(st.integers(-30, 30), st.sampled_from([0, 0, 1, 5, 30, 60]))


def _scales(rng, shape, mag):
    base, spread = mag
    k = np.clip(base + rng.integers(-spread, spread + 1, size=shape), -30, 30)
    return 10.0 ** k.astype(np.float64)


def make_rewards(rng, shape, kind: str, mag) -> np.ndarray:
    """float64 rewards: 'binary' (0/1, all ties), 'grid' (few distinct values), 'normal'."""
    if kind == "binary":
        r = (rng.random(shape) < 0.5).astype(np.float64)
    elif kind == "grid":
        r = rng.integers(-2, 3, size=shape).astype(np.float64)
    else:
        r = rng.normal(size=shape)
    return r * _scales(rng, shape, mag)


def make_embeddings(rng, shape, d_used: int, kind: str, mag) -> np.ndarray:
    """float64 [..., G, D] rows with planted structure; columns from d_used on are zero.

    kind: 'normal'; 'positive' (|normal|, sentence-encoder-like); 'dup' (rows copied from the
    others, scaled); 'zero' (some zero rows); 'antipodal' (rows that are minus others); 'onehot'
    (few directions, exact cosines 0 and 1).
    """
    *lead, g, d = shape
    e = np.zeros(shape)
    if kind == "onehot":
        e[..., :d_used] = np.eye(d_used)[rng.integers(0, d_used, size=(*lead, g))]
    else:
        e[..., :d_used] = rng.normal(size=(*lead, g, d_used))
    if kind == "positive":
        e = np.abs(e)
    if kind in ("dup", "antipodal") and g > 1:
        src = rng.integers(0, g, size=(*lead, g))
        take = rng.random((*lead, g)) < 0.5
        copied = np.take_along_axis(e, src[..., None], axis=-2)
        e = np.where(take[..., None], -copied if kind == "antipodal" else copied, e)
    if kind == "zero":
        e = np.where(rng.random((*lead, g, 1)) < 0.4, 0.0, e)
    return e * _scales(rng, (*lead, g, 1), mag)


def mmr_cases(families, *, reward_kinds=("binary", "grid", "normal"), dtypes=DTYPES):
    """Strategy: a batch of padded groups, a dict of float64 arrays plus dtype, lam and rng.

    families: (B, G, D) maximum shapes; the case uses b <= B groups of g <= G entries in d <= D
    dimensions, the rest masked (rewards there are garbage, not zero, to catch leaks). lam is
    None (adaptive), a fixed value or 'random' (one per group). The strategies are built once
    here: building them inside a composite on every draw cost more than the kernels.
    """
    return st.tuples(
        st.sampled_from(families),
        st.integers(0, 2**32 - 1),
        st.sampled_from(reward_kinds),
        st.sampled_from(EMBEDDING_KINDS),
        MAGNITUDES,
        MAGNITUDES,
        st.sampled_from([1.0, 1.0, 0.8, 0.5, 0.2]),
        st.booleans(),
        st.sampled_from(dtypes),
        st.sampled_from([None, 0.0, 0.3, 0.7, 1.0, "random"]),
    ).map(_build_case)


def _build_case(args):
    (bmax, gmax, dmax), seed, r_kind, e_kind, r_mag, e_mag, keep, first, dtype, lam = args
    rng = np.random.default_rng(seed)
    b, g, d = (int(rng.integers(1, n + 1)) for n in (bmax, gmax, dmax))
    r = make_rewards(rng, (bmax, gmax), r_kind, r_mag)
    e = make_embeddings(rng, (bmax, gmax, dmax), d, e_kind, e_mag)
    mask = rng.random((bmax, gmax)) < keep
    if first:  # else some groups may be fully masked
        mask[:, 0] = True
    mask[b:], mask[:, g:] = False, False
    return {"rewards": r, "embeddings": e, "mask": mask, "dtype": dtype, "lam": lam, "rng": rng}


EMBEDDING_KINDS = ("normal", "positive", "dup", "zero", "antipodal", "onehot")


def garbage_like(rng, x: np.ndarray) -> np.ndarray:
    """Finite values of wildly varying magnitude to write into masked entries."""
    return rng.normal(size=x.shape) * 10.0 ** rng.integers(-30, 31, size=x.shape)


def cast(x: np.ndarray, dtype) -> np.ndarray:
    """float64 -> dtype, then back to float64: the values the kernel actually sees."""
    return np.asarray(x, dtype).astype(np.float64)


# --- Independent float64 references -------------------------------------------------------------


def cosines(e: np.ndarray) -> np.ndarray:
    """[G, D] float64 -> [G, G] cosines, 0 for zero rows (np.linalg.norm does not overflow)."""
    scale = np.max(np.abs(e), axis=-1, keepdims=True)
    u = e / np.where(scale > 0, scale, 1.0)
    n = np.linalg.norm(u, axis=-1, keepdims=True)
    u = np.where(n > 0, u / np.where(n > 0, n, 1.0), 0.0)
    return u @ u.T


def reward_cases(families, *, dtypes=DTYPES):
    """Strategy: padded groups of rewards only (advantages), as `mmr_cases`; 'offset' adds a
    large common value to every reward (cancellation in r - mean)."""
    return st.tuples(
        st.sampled_from(families),
        st.integers(0, 2**32 - 1),
        st.sampled_from(("binary", "grid", "normal")),
        MAGNITUDES,
        st.sampled_from([None, None, 3, 8, 30]),
        st.sampled_from([1.0, 1.0, 0.8, 0.5, 0.2]),
        st.booleans(),
        st.sampled_from(dtypes),
    ).map(_build_reward_case)


def _build_reward_case(args):
    (bmax, gmax), seed, r_kind, r_mag, offset, keep, first, dtype = args
    rng = np.random.default_rng(seed)
    b, g = (int(rng.integers(1, n + 1)) for n in (bmax, gmax))
    r = make_rewards(rng, (bmax, gmax), r_kind, r_mag)
    if offset is not None:
        r = r + rng.choice([-1.0, 1.0]) * 10.0**offset
    mask = rng.random((bmax, gmax)) < keep
    if first:
        mask[:, 0] = True
    mask[b:], mask[:, g:] = False, False
    return {"rewards": r, "mask": mask, "dtype": dtype, "rng": rng}
