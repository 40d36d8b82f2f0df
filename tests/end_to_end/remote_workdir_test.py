"""A run whose workdir is a bucket (gs://, issue 36 item 6), on a fake bucket: a local folder
that epath and Orbax's TensorStore specs are redirected to (tests/support/fake_bucket.py).

Orbax writes through epath (its folders, metadata and commit files) and TensorStore (the array
data); both must land in the bucket, and nothing may make a local folder named 'gs:'."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from mmr_jax.config import checks
from mmr_jax.infra import metrics, run_paths
from mmr_jax.studies import study
from mmr_jax.training import checkpoint, hf_export, workdir_guard

from support import checkpoint_trees as trees
from support import fake_bucket, train_script
from support.tiny_study import tiny_study

REPO = train_script.REPO


@pytest.fixture
def bucket(tmp_path, monkeypatch):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    with fake_bucket.installed(tmp_path / "gcs") as root:
        yield root / "bucket"
    assert list(cwd.iterdir()) == [], "a local folder was made for a bucket path"


class TestCheckpointerOnBucket:
    def test_round_trip_keep_and_files_in_the_bucket(self, bucket):
        ck = checkpoint.Checkpointer("gs://bucket/run/checkpoints", keep=2)
        assert str(ck.directory) == "gs://bucket/run/checkpoints"
        for step in (1, 2, 3):
            ck.save(step, trees.state(step), {"step": step})
        ck.wait()
        assert ck.all_steps() == [2, 3]
        out, meta = ck.restore(trees.abstract(trees.state()))
        assert meta == {"step": 3}
        jax.tree.map(np.testing.assert_array_equal, out, trees.state(3))
        ck.close()
        steps = bucket / "run" / "checkpoints"
        assert sorted(p.name for p in steps.iterdir()) == ["2", "3"]
        # Orbax took the path for a bucket (commit files, not renames), and TensorStore wrote
        # the array data there.
        assert (steps / "3" / "commit_success.txt").is_file()
        assert [p for p in (steps / "3" / "state").rglob("d/*") if p.is_file()]

    def test_unreadable_step_moved_aside_in_the_bucket(self, bucket):
        ck = checkpoint.Checkpointer("gs://bucket/ck", keep=None)
        for step in (1, 2):
            ck.save(step, trees.state(step), {"step": step})
        ck.close()
        trees.CORRUPTIONS["data_truncated"](bucket / "ck" / "2")
        ck = checkpoint.Checkpointer("gs://bucket/ck", keep=None)
        out, meta = ck.restore(trees.abstract(trees.state()))
        assert meta == {"step": 1}
        np.testing.assert_array_equal(out["params"]["w"], np.ones((3, 4)))
        assert (bucket / "ck" / f"2{checkpoint.UNREADABLE_SUFFIX}").is_dir()
        assert ck.all_steps() == [1]
        ck.close()


class TestStudyOnBucket:
    def test_runs_markers_curves_dropped_checkpoints_and_archive(self, bucket):
        c = tiny_study("ckpt", "gs://bucket/s")

        def fake_train(cfg, workdir):  # a run that logs two evaluations and a checkpoint
            workdir = run_paths.as_path(workdir)
            (workdir / checkpoint.CKPT_DIR / "1").mkdir(parents=True)
            (workdir / checkpoint.CKPT_DIR / "1" / "w").write_bytes(b"x" * 1000)
            rows = [{"step": s, study.EVAL_METRIC: 0.1 * s, "time/step": 2.0} for s in (1, 2)]
            (workdir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

        lines = []
        study.run_study(c, train_fn=fake_train, log=lines.append, drop_checkpoints=True)
        assert (bucket / "s" / study.STUDY_FILE).is_file()
        for name in ("grpo_s1", "mmr_grpo_s1"):
            assert json.loads((bucket / "s" / name / study.RUN_FILE).read_text())["status"] == (
                "finished"
            )
            assert not (bucket / "s" / name / checkpoint.CKPT_DIR).exists()
        assert sum("dropped" in line and "0.00 GiB" in line for line in lines) == 2
        result = study.collect(c, study.plan(c))
        assert [r["curve"]["values"] for r in result["runs"]] == [[0.1, 0.2], [0.1, 0.2]]
        assert study.archive("gs://bucket/s", "gs://bucket/archive") == ["grpo_s1", "mmr_grpo_s1"]
        assert (bucket / "archive" / "grpo_s1" / "metrics.jsonl").is_file()
        lines.clear()
        study.run_study(c, train_fn=fake_train, log=lines.append)  # ended runs: skipped
        assert lines == ["study: 2/2 runs done"]


def _in_bucket(root, script_args, env):
    """scripts/train.py with the fake bucket installed, in a child process."""
    cmd = [sys.executable, str(REPO / "tests" / "support" / "fake_bucket.py"), str(root)]
    return subprocess.run(cmd + script_args, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_train_killed_and_resumed_in_a_bucket_matches_local(tmp_path, tiny_llama_dir):
    """3 steps into gs://bucket/run, SIGKILLed at step 3, resumed from the bucket: the same
    parameters, data position and metrics as the same run in a local folder."""
    steps, gcs, cwd = 3, tmp_path / "gcs", tmp_path / "cwd"
    cwd.mkdir()
    extra = ["--config.checkpoint.export_hf=True"]
    env = dict(os.environ, JAX_PLATFORMS="cpu", MMR_JAX_STAGING_DIR=str(tmp_path / "staging"))
    env.pop("MMR_JAX_KILL_AT", None)
    ref = tmp_path / "ref"
    res = subprocess.run(
        train_script.train_cmd(ref, tiny_llama_dir, steps) + extra,
        env=env,
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    args = train_script.train_cmd("gs://bucket/run", tiny_llama_dir, steps)[1:] + extra
    killed = _in_bucket(gcs, args, {**env, "MMR_JAX_KILL_AT": "train:3"})
    assert killed.returncode == -9, killed.stderr[-3000:]
    run = gcs / "bucket" / "run"
    done = checkpoint.Checkpointer(run / checkpoint.CKPT_DIR, keep=None)
    killed_at = done.latest_step()
    done.close()
    assert killed_at in (1, 2)
    # Mirrored before each checkpoint: the bucket holds every step up to the last checkpoint.
    rows = metrics.read_jsonl(run / metrics.METRICS_FILE)
    assert [r["step"] for r in rows][:killed_at] == list(range(1, killed_at + 1))
    res = _in_bucket(gcs, args, env)
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"workdir gs://bucket/run | resuming from step {killed_at}" in res.stdout
    assert not (cwd / "gs:").exists() and not (REPO / "gs:").exists()
    assert not list(tmp_path.glob("**/gs:"))
    # Everything in the bucket: checkpoints, exports, metadata, metrics, the console log.
    cfg = checks.from_config_dict(workdir_guard.read_run_config(run))
    _, a, meta_a = train_script.params(ref, cfg)
    _, b, meta_b = train_script.params(run, cfg)
    assert meta_a == meta_b  # same step and data-iterator position
    jax.tree.map(
        lambda x, y: np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=1e-6), a, b
    )
    assert (run / f"step_{steps}" / "config.json").is_file()
    assert not list(run.glob("*.partial"))
    log = (run / "train.log").read_text()
    assert "resuming from step" in log and "new run" in log  # both processes' lines kept
    with fake_bucket.installed(gcs):  # --export_hf from the bucket's checkpoint to the bucket
        out = hf_export.export_hf(cfg, "gs://bucket/run", "gs://bucket/hf", step=2)
    assert out == "gs://bucket/hf"
    for name in ("config.json", "model.safetensors"):
        assert (gcs / "bucket" / "hf" / name).read_bytes() == (run / "step_2" / name).read_bytes()
    rows_a = metrics.read_jsonl(ref / metrics.METRICS_FILE)
    rows_b = metrics.read_jsonl(run / metrics.METRICS_FILE)
    assert [r["step"] for r in rows_b] == list(range(1, steps + 1))
    for x, y in zip(rows_a, rows_b, strict=True):  # same data order and samples
        assert x["reward/mean"] == pytest.approx(y["reward/mean"], abs=1e-6)
        assert x["completion/length_mean"] == y["completion/length_mean"]


@pytest.mark.slow
def test_evaluate_run_in_a_bucket_matches_local(tmp_path, tiny_llama_dir):
    """scripts/evaluate.py over a run folder in the bucket (its steps fetched one at a time, the
    outputs uploaded): the same results as over the same folder on the local disk."""
    import shutil

    bench = tmp_path / "bench"
    bench.mkdir()
    rows = [{"id": str(i), "problem": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(2)]
    (bench / "tiny.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    local_run, gcs = tmp_path / "run", tmp_path / "gcs"
    for step in (1, 2):
        shutil.copytree(tiny_llama_dir, local_run / f"step_{step}")
        shutil.copytree(tiny_llama_dir, gcs / "bucket" / "run" / f"step_{step}")
    args = [
        f"--config={REPO / 'configs' / 'eval.py'}", "--config.benchmarks=('tiny',)",
        f"--config.data_dir={bench}", "--config.n=2", "--config.ks=(1,2)",
        "--config.max_new_tokens=8", "--config.grader_workers=0",
    ]  # fmt: skip
    env = dict(os.environ, JAX_PLATFORMS="cpu", MMR_JAX_STAGING_DIR=str(tmp_path / "staging"))
    script = str(REPO / "scripts" / "evaluate.py")
    res = subprocess.run(
        [sys.executable, script, *args, f"--config.run_dir={local_run}"],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    res = _in_bucket(gcs, [script, *args, "--config.run_dir=gs://bucket/run"], env)
    assert res.returncode == 0, res.stderr[-3000:]
    out = gcs / "bucket" / "run" / "eval"
    names = {"step_1.json", "step_2.json", "eval_summary.json", "pass1_vs_step.png", "evaluate.log"}
    assert names <= {p.name for p in out.iterdir()}
    for name in ("step_1.json", "step_2.json"):
        a = json.loads((local_run / "eval" / name).read_text())
        b = json.loads((out / name).read_text())
        assert a["per_benchmark"] == b["per_benchmark"] and a["records"] == b["records"]
    summary = json.loads((out / "eval_summary.json").read_text())
    assert (
        summary["peak_step"]
        == json.loads((local_run / "eval" / "eval_summary.json").read_text())["peak_step"]
    )
    assert not list(tmp_path.glob("**/gs:")) and not (REPO / "gs:").exists()
