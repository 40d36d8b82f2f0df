"""Property-based tests of algorithms.advantages (issue 19): GRPO and Dr.GRPO over fuzzed groups.

Cases (tests/support/fuzz_cases.py): padded groups in float32 or bfloat16, magnitudes 1e-30 to 1e30,
ties, a large common offset, random masks. Properties: finite output; masked entries get exactly 0
and garbage written into them changes nothing else (bit for bit); groups without variance get
exactly 0; the values match a float64 reference within the rounding the inputs' conditioning allows;
permuting a group permutes its advantages.
"""

import jax
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from mmr_jax.algorithms import advantages

from support import fuzz_cases

jax.config.update("jax_numpy_rank_promotion", "raise")

FAMILIES = ((4, 8), (2, 32))
_GRPO = jax.jit(advantages.grpo_advantages)
_DR_GRPO = jax.jit(advantages.dr_grpo_advantages)


def _reference(r, valid, *, ddof, eps):
    """float64 (grpo, dr_grpo, tolerance scale) of one group; std through scaled deviations."""
    grpo, dr = np.zeros_like(r), np.zeros_like(r)
    x = r[valid]
    if x.size == 0 or x.max() == x.min():
        return grpo, dr, 0.0
    dev = x - x.mean()
    s = np.abs(dev).max()
    std = s * np.sqrt(np.sum((dev / s) ** 2) / max(x.size - ddof, 1))
    grpo[valid], dr[valid] = dev / (std + eps), dev
    # The kernel's r - mean carries the rounding of a G-term sum of |r| up to max|x|: absolute
    # error ~ G * eps * max|x| in dr_grpo, divided by (std + eps) in grpo (cancellation when a
    # large common offset dominates the spread), plus a few roundings relative to the result.
    return grpo, dr, np.abs(x).max() / (std + eps)


@settings(max_examples=fuzz_cases.examples("advantages_properties"))
@given(fuzz_cases.reward_cases(FAMILIES), st.sampled_from([0, 1]), st.sampled_from([1e-4, 1e-6]))
def _prop_advantages(case, ddof, eps):
    dt, m, rng = case["dtype"], case["mask"], case["rng"]
    r_dt = np.asarray(case["rewards"], dt)
    r = r_dt.astype(np.float64)
    garbage = np.asarray(np.where(m, case["rewards"], fuzz_cases.garbage_like(rng, r)), dt)
    perm = np.stack([rng.permutation(r.shape[1]) for _ in range(r.shape[0])])
    r_p, m_p = np.take_along_axis(r_dt, perm, 1), np.take_along_axis(m, perm, 1)
    e_dt, g = fuzz_cases.eps(dt), r.shape[1]
    for name, fn, kw in (("grpo", _GRPO, dict(ddof=ddof, eps=eps)), ("dr_grpo", _DR_GRPO, {})):
        out = np.asarray(fn(r_dt, mask=m, **kw))
        assert out.dtype == dt
        out = out.astype(np.float64)
        assert np.all(np.isfinite(out)), name
        np.testing.assert_array_equal(out[~m], 0.0)
        out_g = np.asarray(fn(garbage, mask=m, **kw)).astype(np.float64)
        np.testing.assert_array_equal(out_g, out)
        out_p = np.asarray(fn(r_p, mask=m_p, **kw)).astype(np.float64)
        for b in range(r.shape[0]):
            grpo, dr, cond = _reference(r[b], m[b], ddof=ddof, eps=eps)
            want = grpo if name == "grpo" else dr
            if cond == 0.0:  # no variance: exact zeros
                np.testing.assert_array_equal(out[b], 0.0)
                np.testing.assert_array_equal(out_p[b], 0.0)
                continue
            scale = cond if name == "grpo" else np.abs(r[b][m[b]]).max()
            tol = 4 * (g + 4) * e_dt * (scale + np.abs(want))
            np.testing.assert_array_less(np.abs(out[b] - want), tol, err_msg=name)
            np.testing.assert_array_less(np.abs(out_p[b] - want[perm[b]]), tol[perm[b]])
    fuzz_cases.count("advantages_properties")


def test_advantages_finite_masked_permutation_and_float64_reference(record_property):
    fuzz_cases.check(_prop_advantages, "advantages_properties", record_property)


def test_grpo_std_does_not_overflow():
    # Found by fuzzing: (1e30 - mean)^2 overflowed float32, the std became inf and every
    # advantage silently 0. The std is now taken from deviations scaled by the largest one.
    r = np.asarray([[1e30, -1e30, 0.0]], np.float32)
    np.testing.assert_allclose(_GRPO(r, ddof=0), [[np.sqrt(1.5), -np.sqrt(1.5), 0.0]], rtol=1e-6)
