"""The benchmark's baselines compute what the kernel computes: its ratios compare like with like."""

import numpy as np
import pytest

from mmr_jax.algorithms import mmr
from mmr_jax.infra import bench_harness

bench = bench_harness.load("bench_mmr")  # the benchmark and its siblings load
forms = bench_harness.load("mmr_forms")
baselines = bench_harness.load("mmr_baselines")


@pytest.mark.parametrize("g", [1, 2, 6, 16])
def test_numpy_baselines_match_kernel(g):
    rng = np.random.default_rng(g)
    for _ in range(20):
        # Binary rewards plus noise; a few groups with exact ties (all-equal binary rewards).
        r = (rng.random(g) < 0.5).astype(np.float64)
        if rng.random() < 0.7:
            r = r + rng.normal(size=g)
        e = rng.normal(size=(g, 8))
        want = np.asarray(mmr.mmr_reweight(r[None], e[None])[0])
        np.testing.assert_allclose(baselines.numpy_plain_loop(r, e), want, rtol=0, atol=1e-6)
        np.testing.assert_allclose(baselines.numpy_vectorised(r, e), want, rtol=0, atol=1e-6)


def test_torch_port_matches_kernel_when_cosines_are_positive():
    # The released loop clamps the running max similarity at 0; with only positive cosines that
    # clamp never acts, so on one group it must agree with Algorithm 1.
    import torch  # here: collecting this module needs no torch

    rng = np.random.default_rng(0)
    for _ in range(20):
        r = rng.normal(size=6).astype(np.float32)
        e = np.abs(rng.normal(size=(6, 8))).astype(np.float32)
        got = baselines.torch_released(torch.from_numpy(r), torch.from_numpy(e)).numpy()
        want = np.asarray(mmr.mmr_reweight(r[None], e[None])[0])
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)


def test_cosine_forms_agree_and_are_timed():
    # bench_forms checks that the three forms give the same output before timing them.
    args = type("Args", (), {"max_plain_groups": 2})()
    row = forms.bench_forms(4, 6, 16, args, rounds=1)
    assert set(row["forms_ms"]) == {
        "unscaled (before the fuzz fixes)",
        "always scaled (fuzz fixes)",
        "guarded (now)",
    }
    assert all(v > 0 for v in row["forms_ms"].values()) and row["numpy_plain_ms"] > 0
