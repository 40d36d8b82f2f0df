"""The study: aggregation by hand, config checks, resume after SIGKILL, held-out set, bands."""

import itertools
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from mmr_jax.problems import data
from mmr_jax.studies import paired_stats, reporting, study
from mmr_jax.training import checkpoint, own_process, problem_sets, trainer

from support import testing
from support.tiny_study import overrides as _overrides
from support.tiny_study import strip_wall_clock
from support.tiny_study import tiny_study as _tiny_study

REPO = pathlib.Path(__file__).resolve().parents[2]

_XLA_CACHE = testing.XLA_CACHE_DIR  # for the scripts these tests start


def _curve(steps, values, train_s=None):
    train_s = train_s if train_s is not None else [10.0 * s for s in steps]
    return {"steps": steps, "values": values, "train_s": train_s, "last_step": steps[-1]}


class TestAggregation:
    def test_run_summary_by_hand(self):
        c = _curve([0, 5, 10, 15, 20], [0.2, 0.5, 0.85, 0.75, 0.9])
        s = reporting.run_summary(c, 0.9, reference_peak=0.6)
        # own peak 0.9 at 20; 0.9 * 0.9 = 0.81 first reached at step 10 (0.85); 0.54 at 10 too
        assert s["peak"] == 0.9 and s["peak_step"] == 20
        assert s["step_to_own"] == 10 and s["train_s_to_own"] == 100.0
        assert s["step_to_ref"] == 10
        s = reporting.run_summary(c, 0.9, reference_peak=0.2)  # 0.18: the base model at 0
        assert s["step_to_ref"] == 0
        s = reporting.run_summary(c, 0.9, reference_peak=1.0)  # 0.9 first at 20
        assert s["step_to_ref"] == 20
        s = reporting.run_summary(_curve([0, 5], [0.3, 0.2]), 0.9, reference_peak=0.5)
        assert s["step_to_ref"] is None and s["peak_step"] == 0

    def test_bootstrap_exact_by_hand(self):
        # Resample sums of 3 draws from {1,2,3}: 3 (1 of 27), 4 (3), ..., 9 (1). P(mean <= 1) =
        # 1/27 >= 0.025, so the low bound is 1; P(mean <= 8/3) = 26/27 < 0.975, so the high is 3.
        b = paired_stats.bootstrap_interval([1.0, 2.0, 3.0])
        assert (b["low"], b["high"]) == (1.0, 3.0) and b["method"].startswith("exact")
        # Two pairs: P(mean = d1) = 1/4 = P(mean = d2); an 80% interval cuts 10% each side.
        b = paired_stats.bootstrap_interval([0.5, -0.25], level=0.4)  # quantiles 0.3 and 0.7
        assert (b["low"], b["high"]) == (0.125, 0.125)

    @pytest.mark.parametrize("n", [3, 4, 5])
    def test_bootstrap_matches_brute_force(self, n):
        d = np.random.default_rng(n).normal(size=n).round(3)
        means = np.sort([d[list(idx)].mean() for idx in itertools.product(range(n), repeat=n)])
        # the order statistics that the quantile rule picks: smallest v with F(v) >= q
        lo = means[int(np.ceil(0.025 * len(means) - 1e-9)) - 1]
        hi = means[int(np.ceil(0.975 * len(means) - 1e-9)) - 1]
        b = paired_stats.bootstrap_interval(d)
        assert b["low"] == pytest.approx(lo, abs=1e-8) and b["high"] == pytest.approx(hi, abs=1e-8)

    def test_t_interval_and_sign_flip_by_hand(self):
        t = paired_stats.t_interval([1.0, 2.0, 3.0])
        half = 4.302653 * 1.0 / np.sqrt(3)  # t_{0.975, 2} from a table; sd 1
        assert t["low"] == pytest.approx(2 - half, abs=1e-5)
        assert t["high"] == pytest.approx(2 + half, abs=1e-5)
        assert paired_stats.t_interval([1.0]) is None
        assert paired_stats.sign_flip_p([1.0, 2.0, 3.0]) == 0.25  # only +++ and ---
        # sums of +-1 +-2 +-3: 6 0 2 -4 4 -2 0 -6; |sum| >= |1 - 2 + 3| = 2 in 6 of 8
        assert paired_stats.sign_flip_p([1.0, -2.0, 3.0]) == 0.75

    def _runs(self):
        def run(variant, seed, values, status="finished"):
            return {
                "name": f"{variant}_s{seed}", "variant": variant, "seed": seed, "status": status,
                "curve": _curve([0, 5, 10], values),
            }  # fmt: skip

        return [
            run("grpo", 1, [0.2, 0.4, 0.5]),
            run("grpo", 2, [0.2, 0.6, 0.5]),
            run("grpo", 3, [0.2, 0.3, 0.4]),
            run("mmr", 1, [0.2, 0.6, 0.6]),
            run("mmr", 2, [0.2, 0.7, 0.8]),
            run("mmr", 3, [0.2, 0.9, float("nan")], status="diverged"),
        ]

    def test_summarise(self):
        meta = {"run": ["grpo", "mmr"], "baselines": ["grpo"], "compare": [["mmr", "grpo"]]}
        s = reporting.summarise(self._runs(), {**meta, "threshold": 0.9})
        assert s["best_baseline"] == "grpo" and s["reference_peak"] == pytest.approx(0.5)
        g, m = s["variants"]["grpo"], s["variants"]["mmr"]
        assert g["peak"]["mean"] == pytest.approx(0.5) and g["peak"]["std"] == pytest.approx(0.1)
        # own 90%: grpo 0.45 -> 10, 0.54 -> 5, 0.36 -> 10; mmr 0.54 -> 5, 0.72 -> 10
        assert s["per_run"]["grpo_s1"]["step_to_own"] == 10
        assert [s["per_run"][f"mmr_s{i}"]["step_to_own"] for i in (1, 2)] == [5, 10]
        # reference 0.9 * 0.5 = 0.45: grpo_s3 (peak 0.4) never reaches it
        assert g["reached_ref"] == 2 and s["per_run"]["grpo_s3"]["step_to_ref"] is None
        assert m["finished"] == 2 and m["diverged"][0]["seed"] == 3
        c = s["comparisons"][0]
        assert c["peak"]["seeds"] == [1, 2] and c["peak"]["left_out_seeds"] == [3]
        assert c["peak"]["diffs"] == pytest.approx([0.1, 0.2])
        assert c["step_to_ref"]["diffs"] == [5 - 10, 5 - 5]
        report = reporting.markdown(
            s, self._runs(), {**meta, "name": "t", "base_config": "x", "seeds": [1, 2, 3],
                              "total_steps": 10, "eval_every": 5, "threshold": 0.9},
        )  # fmt: skip
        assert "| mmr | 2/3 |" in report and "seed 3 (last logged step 10)" in report
        assert "| mmr_s3 | diverged |" in report


class TestConfigChecks:
    def test_changed_config_refused_naming_the_key(self, tmp_path):
        c = _tiny_study("ckpt", tmp_path / "s")
        specs = study.plan(c)
        study.check_folder(c.folder, study.resolved(c, specs))
        study.check_folder(c.folder, study.resolved(c, specs))  # the same config: accepted
        c.train.optim.lr = 2e-3
        with pytest.raises(study.StudyMismatchError, match=r"runs\.grpo_s1\.optim\.lr: 0\.001 -> "):
            study.check_folder(c.folder, study.resolved(c, study.plan(c)))

    def test_folder_of_another_study_refused(self, tmp_path):
        a = _tiny_study("ckpt", tmp_path / "s")
        study.check_folder(a.folder, study.resolved(a, study.plan(a)))
        b = _tiny_study("ckpt", tmp_path / "s")
        b.seeds, b.threshold = (1, 2), 0.8
        with pytest.raises(study.StudyMismatchError) as e:
            study.check_folder(b.folder, study.resolved(b, study.plan(b)))
        msg = str(e.value)
        assert "study.seeds: [1] -> [1, 2]" in msg and "study.threshold: 0.9 -> 0.8" in msg
        assert "runs.mmr_grpo_s2: (absent) ->" in msg

    def test_plan_checks(self):
        c = _tiny_study("ckpt", "x")
        assert [s.name for s in study.plan(c)] == ["grpo_s1", "mmr_grpo_s1"]
        assert study.plan(c)[1].cfg.reweight.method == "mmr" and study.plan(c)[1].cfg.seed == 1
        c.run = ("grpo", "nope")
        with pytest.raises(ValueError, match=r"variants \['nope'\] not in"):
            study.plan(c)
        c.run = ("grpo",)
        with pytest.raises(ValueError, match=r"compare names \['mmr_grpo'\], not in study.run"):
            study.plan(c)
        c = _tiny_study("ckpt", "x", **{"eval.every": 0})
        with pytest.raises(ValueError, match="eval.every > 0"):
            study.plan(c)
        c = _tiny_study("ckpt", "x")
        c.variants.grpo = {"reweight": {"methd": "mmr"}}
        with pytest.raises(KeyError, match="methd"):
            study.plan(c)

    @pytest.mark.slow
    def test_skips_finished_and_records_diverged(self, tmp_path):
        c = _tiny_study("ckpt", tmp_path / "s")
        c.seeds = (1, 2)
        calls = []

        def fake_train(cfg, workdir):
            calls.append(pathlib.Path(workdir).name)
            if cfg.seed == 2 and cfg.reweight.method == "mmr":
                raise trainer.NonFiniteLossError("step 2: non-finite loss nan")

        lines = []
        study.run_study(c, train_fn=fake_train, log=lines.append)
        assert calls == ["grpo_s1", "mmr_grpo_s1", "grpo_s2", "mmr_grpo_s2"]  # seed-major
        assert lines[0] == "study: 0/4 runs done | now grpo_s1 | ETA ?"
        assert lines[1].startswith("study: 1/4 runs done | now mmr_grpo_s1 | ETA ")
        status = study.run_status(c.folder, study.plan(c)[3])
        assert status["status"] == "diverged" and "non-finite" in status["error"]
        calls.clear()
        study.run_study(c, train_fn=fake_train, log=lines.append)
        assert calls == [] and lines[-1] == "study: 4/4 runs done"

    @pytest.mark.slow
    @pytest.mark.parametrize("drop", [True, False])
    def test_ended_runs_checkpoints_dropped_on_request(self, tmp_path, drop):
        c = _tiny_study("ckpt", tmp_path / "s")

        def fake_train(cfg, workdir):
            step = pathlib.Path(workdir) / "checkpoints" / "2"
            step.mkdir(parents=True)
            (step / "weights").write_bytes(b"x" * 1000)
            (pathlib.Path(workdir) / "metrics.jsonl").write_text("{}\n")
            if cfg.reweight.method == "mmr":
                raise trainer.NonFiniteLossError("step 2: non-finite loss nan")

        lines = []
        study.run_study(c, train_fn=fake_train, log=lines.append, drop_checkpoints=drop)
        for name in ("grpo_s1", "mmr_grpo_s1"):  # finished and diverged alike
            run = tmp_path / "s" / name
            assert (run / "checkpoints").exists() is not drop
            assert (run / "metrics.jsonl").exists() and (run / study.RUN_FILE).exists()
        dropped = [line for line in lines if "dropped" in line]
        assert len(dropped) == (2 if drop else 0)


class _Stopped(Exception):
    """Stands for a study stopped mid-run (Ctrl-C, a lost session)."""


class TestArchive:
    @pytest.mark.slow
    def test_archive_restored_elsewhere_skips_ended_runs_and_keeps_curves(self, tmp_path):
        c = _tiny_study("ckpt", tmp_path / "s")
        c.seeds = (1, 2)
        calls = []

        def fake_train(cfg, workdir):  # a run that logs two evaluations and a checkpoint
            calls.append(pathlib.Path(workdir).name)
            workdir = pathlib.Path(workdir)
            (workdir / checkpoint.CKPT_DIR / "1").mkdir(parents=True)
            rows = [{"step": s, study.EVAL_METRIC: 0.1 * s + cfg.seed, "time/step": 2.0}
                    for s in (1, 2)]  # fmt: skip
            (workdir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
            if workdir.name == "mmr_grpo_s2" and workdir.parent.name == "s":
                raise _Stopped  # the study stops during its last run

        with pytest.raises(_Stopped):
            study.run_study(c, train_fn=fake_train, log=lambda s: None)
        specs = study.plan(c)
        before = study.collect(c, specs)
        kept = study.archive(c.folder, tmp_path / "archive")
        assert kept == ["grpo_s1", "grpo_s2", "mmr_grpo_s1"]  # not the unfinished mmr_grpo_s2
        assert not list((tmp_path / "archive").glob("*/" + checkpoint.CKPT_DIR))
        assert not (tmp_path / "archive" / "mmr_grpo_s2").exists()

        c.folder = str(tmp_path / "elsewhere")
        shutil.copytree(tmp_path / "archive", c.folder)
        after = study.collect(c, study.plan(c))
        assert after["runs"][:3] == before["runs"][:3]  # the ended runs, curves and markers
        assert after["runs"][3]["status"] == "pending"
        calls.clear()
        study.run_study(c, train_fn=fake_train, log=lambda s: None)
        assert calls == ["mmr_grpo_s2"]  # only the run that had not ended
        with pytest.raises(FileNotFoundError, match="holds no study"):
            study.archive(tmp_path / "nothing", tmp_path / "a2")


# A run body for `train_in_child`: module level, so the spawned child can import it by name.
def _child_diverges(cfg, workdir):
    raise trainer.NonFiniteLossError("step 3: non-finite loss nan")


class TestRunInChild:
    @pytest.mark.slow
    def test_a_diverged_child_marks_the_run_diverged(self, tmp_path):
        c = _tiny_study("ckpt", tmp_path / "s")
        c.run, c.compare = ("grpo",), ()

        def in_child(cfg, workdir):
            own_process.train_in_child(cfg, workdir, train_fn=_child_diverges)

        study.run_study(c, train_fn=in_child, log=lambda s: None)
        status = study.run_status(c.folder, study.plan(c)[0])
        assert status["status"] == "diverged" and "step 3" in status["error"]


class TestHeldOut:
    def test_heldout_set_fixed_distinct_and_left_out_of_training(self, tmp_path):
        h = data.heldout_arithmetic(200, 5, max_operand=20, ops=("+", "-"))
        assert len({p.problem for p in h}) == 200
        assert h == data.heldout_arithmetic(200, 5, max_operand=20, ops=("+", "-"))
        with pytest.raises(ValueError, match="only 100 distinct"):
            data.heldout_arithmetic(101, 5, max_operand=10, ops=("+",))
        tok_dir = testing.make_tiny_checkpoint(tmp_path / "ckpt")
        import transformers

        tok = transformers.AutoTokenizer.from_pretrained(tok_dir)
        c = _tiny_study(tok_dir, tmp_path / "s")
        c.train.data.arithmetic_max_operand = 20
        cfg = study.plan(c)[0].cfg
        heldout = {p.problem for p in problem_sets.eval_problems(cfg)["heldout"]}
        train_all = data.arithmetic_problems(2000, cfg.seed, max_operand=20, ops=("+",))
        assert heldout & {p.problem for p in train_all}  # the raw draws do overlap (400 sums)
        prompts, answers, _ = problem_sets.load_prompts(cfg, tok, problem_sets.eval_problems(cfg))
        texts = {tok.decode(p) for p in prompts}
        assert not any(q in t for q in heldout for t in texts)
        assert len(prompts) == sum(p.problem not in heldout for p in train_all)


class TestResume:
    @pytest.mark.slow
    def test_sigkill_mid_study_then_rerun_gives_the_same_study_json(self, tmp_path, tiny_llama_dir):
        env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=_XLA_CACHE)

        def cmd(folder):
            c = _tiny_study(tiny_llama_dir, folder)
            return [sys.executable, str(REPO / "scripts" / "study.py"),
                    f"--config={REPO / 'configs' / 'study.py'}:pilot", *_overrides(c)]  # fmt: skip

        ref, run = tmp_path / "ref", tmp_path / "run"
        res = subprocess.run(cmd(ref), env=env, capture_output=True, text=True)
        assert res.returncode == 0, res.stderr[-3000:]
        proc = subprocess.Popen(
            cmd(run), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        second = run / "mmr_grpo_s1" / checkpoint.CKPT_DIR / "1"
        deadline = time.time() + 300
        while not second.exists() and time.time() < deadline:
            time.sleep(0.1)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        assert (run / "grpo_s1" / study.RUN_FILE).exists()
        assert (
            not (run / "mmr_grpo_s1" / study.RUN_FILE).exists()
            and not (run / "study.json").exists()
        )
        res = subprocess.run(cmd(run), env=env, capture_output=True, text=True)
        assert res.returncode == 0, res.stderr[-3000:]
        assert "study: 1/2 runs done | now mmr_grpo_s1" in res.stdout
        assert f"workdir {run / 'mmr_grpo_s1'} | resuming from step" in res.stdout
        a = json.loads((ref / "study.json").read_text())
        b = json.loads((run / "study.json").read_text())
        assert [r["curve"]["steps"] for r in b["runs"]] == [[0, 1, 2, 3]] * 2
        assert strip_wall_clock(a) == strip_wall_clock(b)
        assert (run / "report.md").exists() and (run / "curves.png").stat().st_size > 1000
        # the same command again: nothing to train; a changed config: refused, key named
        res = subprocess.run([*cmd(run), "--config.train.optim.lr=0.002"], env=env,
                             capture_output=True, text=True)  # fmt: skip
        assert res.returncode != 0 and "optim.lr: 0.001 -> 0.002" in res.stderr
