"""The study report's statistics: final accuracy, AUC, fixed thresholds, no bootstrap below 5
pairs, the mechanism of a run; and the archived first study recomputed from its raw records."""

import json
import pathlib

import numpy as np
import pytest

from mmr_jax.studies import paired_stats, reporting, run_curves

ARCHIVE = pathlib.Path(__file__).resolve().parents[2] / "docs" / "study_cpu"


def _curve(steps, values):
    return {"steps": steps, "values": values, "train_s": [float(s) for s in steps],
            "last_step": steps[-1]}  # fmt: skip


class TestRunStatistics:
    def test_final_is_the_mean_of_the_last_five(self):
        assert reporting.final_accuracy([0.0, 0.1, 0.2, 0.3, 0.4, 0.5]) == pytest.approx(0.3)
        assert reporting.final_accuracy([0.5, 0.6, 0.7, 0.8]) is None

    def test_auc_is_the_trapezoid_mean_height(self):
        # (0 + 1) / 2 * 2 + (1 + 1) / 2 * 2 = 3 over 4 steps.
        assert reporting.curve_auc([0, 2, 4], [0.0, 1.0, 1.0]) == pytest.approx(0.75)
        # Unequal spacing weighs by the steps: 0.5 for 1 step, then 1.0 for 3.
        assert reporting.curve_auc([0, 1, 4], [0.5, 0.5, 1.0]) == pytest.approx(
            (0.5 + 3 * 0.75) / 4
        )
        assert reporting.curve_auc([3], [0.4]) is None

    def test_fixed_thresholds_are_the_same_bar_for_every_run(self):
        low = _curve([0, 2, 4, 6, 8, 10], [0.1, 0.55, 0.62, 0.63, 0.64, 0.64])
        high = _curve([0, 2, 4, 6, 8, 10], [0.1, 0.3, 0.5, 0.7, 0.85, 0.9])
        s_low = reporting.run_summary(low, 0.9, None, (0.6, 0.8))
        s_high = reporting.run_summary(high, 0.9, None, (0.6, 0.8))
        # Relative to its own (low) peak the low run looks sooner: 0.576 at step 4 vs 0.81 at 8.
        assert (s_low["step_to_own"], s_high["step_to_own"]) == (4, 8)
        # Against fixed bars it is not: 60% at 4 vs 6, and 80% never vs 8.
        assert (s_low["step_to_60"], s_high["step_to_60"]) == (4, 6)
        assert (s_low["step_to_80"], s_high["step_to_80"]) == (None, 8)
        assert s_low["final"] == pytest.approx(np.mean([0.55, 0.62, 0.63, 0.64, 0.64]))


class TestNoBootstrapBelowFive:
    def test_paired_has_no_bootstrap_below_five_pairs(self):
        three = paired_stats.paired({1: 1.0, 2: 2.0, 3: 4.0}, {1: 0.0, 2: 0.0, 3: 0.0})
        assert three["bootstrap"] is None and three["t"] is not None
        assert three["sign_flip_p"] == 0.25
        five = paired_stats.paired(dict.fromkeys(range(5), 1.0), dict.fromkeys(range(5), 0.0))
        assert five["bootstrap"] == {**five["bootstrap"], "low": 1.0, "high": 1.0}

    def test_report_of_three_seeds_prints_no_bootstrap_interval(self):
        study = json.loads((ARCHIVE / "study.json").read_text())
        summary = reporting.summarise(study["runs"], study["study"])
        text = reporting.markdown(summary, study["runs"], study["study"])
        rows = [line for line in text.splitlines() if line.startswith("| mmr_grpo - ")]
        assert len(rows) == 14  # 7 quantities x 2 comparisons
        assert all(row.rstrip().endswith("| n < 5: none |") for row in rows)


class TestMechanism:
    def test_stall_tail_and_times_by_hand(self):
        rows = [{"step": 0, "time/eval": 10.0}]
        for step, g in enumerate([2.0, 1.0, 0.0, 3.0, 0.0, 0.0, 0.0, 0.0], start=1):
            rows.append({"step": step, "grad_norm": g, "advantage/abs_mean": g / 10,
                         "groups/zero_variance_frac": 1.0 if g == 0 else 0.5,
                         "time/train": 100.0 if step == 1 else float(step),
                         "time/rollout": 1.0})  # fmt: skip
        rows.append({"step": 8, "time/eval": 30.0})  # same step, another row: merged
        m = run_curves.run_mechanism(rows)
        assert m["stalled_from"] == 5  # steps 5-8 all zero; step 3's zero is not a stall
        assert m["tail_from"] == 7 and m["tail_grad_norm"] == 0.0  # last quarter: 7, 8
        assert m["tail_zero_variance_frac"] == 1.0
        assert m["tail_uniform_adv_abs_mean"] is None  # not logged by these rows
        rows[-2]["advantage/uniform_abs_mean"] = 0.5  # step 8 only
        assert run_curves.run_mechanism(rows)["tail_uniform_adv_abs_mean"] == 0.5
        assert m["train_s_median"] == pytest.approx(5.0)  # steps 2..8, compile step left out
        assert m["eval_s"] == [10.0, 30.0] and m["eval_total_s"] == 40.0
        rows.append({"step": 9, "grad_norm": 0.5})
        assert run_curves.run_mechanism(rows)["stalled_from"] is None
        rows.append({"step": 10, "grad_norm": 0.0})  # 10 steps, tail 8-10: one zero is no stall
        assert run_curves.run_mechanism(rows)["stalled_from"] is None
        rows += [{"step": 11, "grad_norm": 0.0}, {"step": 12, "grad_norm": 0.0}]
        assert run_curves.run_mechanism(rows)["stalled_from"] == 10  # tail 10-12: all zero

    def test_lengths_and_whole_run_means_by_hand(self):
        rows = []
        for step in range(1, 9):  # last quarter: steps 7 and 8
            rows.append({"step": step, "grad_norm": 1.0, "completion/length_mean": float(step),
                         "completion/truncated_frac": 0.5 if step == 8 else 0.0,
                         "advantage/uniform_abs_mean": 0.1 * step,
                         "groups/zero_variance_frac": 0.25 if step < 5 else 0.75})  # fmt: skip
        m = run_curves.run_mechanism(rows)
        assert m["tail_length_mean"] == pytest.approx(7.5)
        assert m["tail_truncated_frac"] == pytest.approx(0.25)
        assert m["all_uniform_adv_abs_mean"] == pytest.approx(0.45)  # 0.1 x mean(1..8)
        assert m["tail_uniform_adv_abs_mean"] == pytest.approx(0.75)
        assert m["all_zero_variance_frac"] == pytest.approx(0.5)

    def test_per_variant_mechanism_over_finished_runs_only(self):
        def mech(length, stalled, eval_s):
            return {"tail_length_mean": length, "stalled_from": stalled, "eval_total_s": eval_s,
                    **{k: None for _, k, _ in run_curves.ARM_MECHANISM
                       if k not in ("tail_length_mean", "eval_total_min", "wall_min")}}  # fmt: skip

        runs = [
            {"name": "a_s1", "variant": "a", "status": "finished", "wall_s": 600.0},
            {"name": "a_s2", "variant": "a", "status": "finished", "wall_s": 1200.0},
            {"name": "a_s3", "variant": "a", "status": "diverged", "wall_s": 60.0},
            {"name": "b_s1", "variant": "b", "status": "finished", "wall_s": None},
        ]
        mechanism = {"a_s1": mech(8.0, None, 60.0), "a_s2": mech(12.0, 31, 180.0),
                     "a_s3": mech(32.0, None, 0.0), "b_s1": mech(20.0, None, 0.0)}  # fmt: skip
        arms = run_curves.arm_mechanism(runs, mechanism, ["a", "b"])
        a = arms["a"]
        assert a["runs"] == 2 and a["stalled"] == 1  # the diverged run is left out
        assert a["tail_length_mean"]["mean"] == pytest.approx(10.0)
        assert a["tail_length_mean"]["n"] == 2
        assert a["wall_min"]["mean"] == pytest.approx(15.0)
        assert a["eval_total_min"]["mean"] == pytest.approx(2.0)
        assert arms["b"]["wall_min"]["n"] == 0 and arms["b"]["tail_grad_norm"]["n"] == 0


def _records(run):
    by_step = {}
    for line in (ARCHIVE / run / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        by_step.setdefault(row["step"], {}).update(row)
    return by_step


class TestFirstStudyFromItsRecords:
    """The figures docs/study_cpu.md quotes, recomputed from the raw metrics (not study.json)."""

    def test_final_accuracy_differences_and_grpo_stall(self):
        final = {}
        for variant in ("grpo", "mmr_grpo", "dra_grpo"):
            for seed in (1, 2, 3):
                rows = _records(f"{variant}_s{seed}")
                evals = [rows[s]["eval/average/pass@1"] for s in sorted(rows)
                         if "eval/average/pass@1" in rows[s]]  # fmt: skip
                assert len(evals) == 21
                final[variant, seed] = 100 * np.mean(evals[-5:])
        vs_grpo = [final["mmr_grpo", s] - final["grpo", s] for s in (1, 2, 3)]
        vs_dra = [final["mmr_grpo", s] - final["dra_grpo", s] for s in (1, 2, 3)]
        np.testing.assert_allclose(vs_grpo, [-13.8, -2.7, -8.7], atol=0.05)
        np.testing.assert_allclose(vs_dra, [-5.7, -6.2, -13.0], atol=0.05)
        study = json.loads((ARCHIVE / "study.json").read_text())
        summary = reporting.summarise(study["runs"], study["study"])
        for (variant, seed), value in final.items():
            got = summary["per_run"][f"{variant}_s{seed}"]["final"]
            assert 100 * got == pytest.approx(value)
        # GRPO stopped learning in seeds 1 and 2: grad_norm exactly 0 at every step from 27 / 29.
        for seed, start in ((1, 27), (2, 29)):
            rows = _records(f"grpo_s{seed}")
            assert all(rows[s]["grad_norm"] == 0.0 for s in range(start, 41))
            assert rows[start - 1]["grad_norm"] > 0.0
            assert run_curves.run_mechanism(list(rows.values()))["stalled_from"] == start

    def test_mechanism_and_format_figures_quoted_in_the_docs(self):
        runs = {f"{v}_s{s}": _records(f"{v}_s{s}") for v in ("grpo", "mmr_grpo", "dra_grpo")
                for s in (1, 2, 3)}  # fmt: skip

        def mean(run, key, steps):
            return np.mean([runs[run][t][key] for t in steps])

        late = range(30, 41)
        stds = [mean(f"mmr_grpo_s{s}", "reward/reweighted_std", late) for s in (1, 2, 3)]
        assert 0.335 <= min(stds) and max(stds) < 0.385  # "0.34-0.38"
        assert round(mean("mmr_grpo_s1", "reward/mean", late), 2) == 0.76
        assert round(mean("grpo_s1", "reward/mean", late), 2) == 0.95
        first = [runs[f"mmr_grpo_s{s}"][1]["advantage/abs_mean"] for s in (1, 2, 3)]
        assert [round(x, 2) for x in first] == [0.65, 0.68, 0.70]
        step4 = [100 * r[4]["eval/average/pass@1"] for r in runs.values()]
        assert round(min(step4)) == 63 and round(max(step4)) == 78
        assert round(100 * runs["grpo_s2"][4]["eval/average/pass@1"], 1) == 77.3
        assert round(100 * runs["mmr_grpo_s2"][4]["eval/average/pass@1"], 1) == 77.3
        assert (
            sum(r["grad_norm"] == 0.0 for r in runs["grpo_s3"].values() if "grad_norm" in r) == 22
        )
