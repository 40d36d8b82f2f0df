"""Tests for studies.design: power against published values and a simulation; the filter."""

import numpy as np
import pytest
from scipy import stats

from mmr_jax.studies import design


class TestPairedTPower:
    # G*Power 3 ("Means: difference from constant (one sample case)", two tails, alpha 0.05,
    # power 0.80) gives these sample sizes for effect sizes d = effect / sd_diff; they are the
    # values of Cohen's (1988) table 2.4.1 corrected for the t distribution.
    @pytest.mark.parametrize("d, n_published", [(0.5, 34), (0.8, 15), (1.0, 10)])
    def test_seeds_match_published_sample_sizes(self, d, n_published):
        assert design.seeds_for_power(effect=d, sd_diff=1.0) == n_published

    def test_power_matches_a_simulation_of_the_test(self):
        # Monte Carlo of the test itself (scipy's one-sample t on simulated differences),
        # independent of the noncentral t formula: 20,000 studies of 6 pairs, effect 5, sd 4.
        rng = np.random.default_rng(0)
        diffs = rng.normal(5.0, 4.0, size=(20_000, 6))
        rejected = stats.ttest_1samp(diffs, 0.0, axis=1).pvalue < 0.05
        simulated = rejected.mean()
        exact = design.paired_t_power(6, effect=5.0, sd_diff=4.0)
        # Binomial standard error of the simulated rate is sqrt(p(1-p)/20000) <= 0.0036; 4 SE.
        assert abs(simulated - exact) < 4 * 0.0036

    def test_study_v2_had_little_power(self):
        # Study v2: 6 pairs, paired differences spread 20 points: a 5-point effect had ~8% power
        # (issue 35), far from the 80% a study needs.
        power = design.paired_t_power(6, effect=5.0, sd_diff=20.0)
        assert 0.06 < power < 0.10

    def test_detectable_effect_inverts_the_power(self):
        effect = design.detectable_effect(8, sd_diff=4.0)
        assert design.paired_t_power(8, effect=effect, sd_diff=4.0) == pytest.approx(0.8)

    def test_none_when_out_of_reach(self):
        assert design.seeds_for_power(effect=1.0, sd_diff=20.0, max_n=20) is None

    @pytest.mark.parametrize("n, sd", [(1, 1.0), (5, 0.0), (5, float("nan"))])
    def test_bad_input_is_refused(self, n, sd):
        with pytest.raises(ValueError):
            design.paired_t_power(n, effect=1.0, sd_diff=sd)


class TestSelectByPassRate:
    def test_keeps_prompts_strictly_between_never_and_always(self):
        records = [
            {"id": "a", "correct": [False] * 8},
            {"id": "b", "correct": [True] + [False] * 7},
            {"id": "c", "correct": [True] * 7 + [False]},
            {"id": "d", "correct": [True] * 8},
            {"id": 5, "correct": [True, False] * 4},
        ]
        counts = design.pass_counts(records)
        assert counts == {"a": 0, "b": 1, "c": 7, "d": 8, "5": 4}
        assert design.select_by_pass_rate(counts, n=8, low=1, high=7) == ["b", "c", "5"]

    def test_bounds_are_checked(self):
        with pytest.raises(ValueError, match="low"):
            design.select_by_pass_rate({"a": 1}, n=8, low=5, high=3)
        with pytest.raises(ValueError, match="outside"):
            design.select_by_pass_rate({"a": 9}, n=8, low=1, high=7)


class TestSeedsFromPilot:
    def test_upper_bound_and_seeds_by_hand(self):
        # finals 40, 42, 44: s = 2 (ddof 1). df 2: chi2_{0.2, 2} = -2 ln(0.8) = 0.44629 (the
        # chi-square with 2 df is exponential with mean 2), so the 80% upper bound is
        # 2 * sqrt(2 / 0.44629) = 4.2339 and sd_diff = sqrt(2) * 4.2339 = 5.9877.
        out = design.seeds_from_pilot([40.0, 42.0, 44.0], effect=5.0)
        assert out["pilot_std"] == pytest.approx(2.0)
        assert out["std_upper"] == pytest.approx(2 * (2 / (-2 * np.log(0.8))) ** 0.5)
        assert out["sd_diff"] == pytest.approx(5.9877, abs=1e-4)
        assert out["seeds"] == design.seeds_for_power(effect=5.0, sd_diff=out["sd_diff"])
        assert out["seeds"] == 14  # the power table of docs/study_v3/plan.md: sd 6 -> 14

    def test_one_run_gives_no_spread(self):
        with pytest.raises(ValueError, match="at least 2"):
            design.seeds_from_pilot([40.0], effect=5.0)
