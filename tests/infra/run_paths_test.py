"""Run paths through etils.epath (issue 36, item 6): a local workdir is used in place; a gs://
workdir is a bucket (a fake one here, tests/support/fake_bucket.py), its appended files staged
locally and mirrored; schemes the run cannot write are refused with a named error, before
anything is written (`pathlib` once made `--workdir=gs://b/x` a local folder 'gs:/b/x')."""

import importlib.util
import json
import os
import pathlib
import subprocess
import sys
import time

import pytest

from mmr_jax.infra import metrics, run_paths
from mmr_jax.training import checkpoint, workdir_guard

from support import fake_bucket, multihost

HAS_GCSFS = importlib.util.find_spec("gcsfs") is not None


@pytest.fixture
def bucket(tmp_path, monkeypatch):
    """A fake gs://bucket under tmp_path/gcs, the cwd an empty folder (to see stray 'gs:' dirs)."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    monkeypatch.setenv(run_paths.STAGING_ENV, str(tmp_path / "staging"))
    with fake_bucket.installed(tmp_path / "gcs") as root:
        yield root / "bucket"
    assert list(cwd.iterdir()) == [], "a local folder was made for a bucket path"


class TestSchemes:
    @pytest.mark.parametrize("url", ["s3://b/x", "file:///tmp/x", "az://c/x", "hf://org/x"])
    def test_unsupported_scheme_refused_and_nothing_written(self, tmp_path, monkeypatch, url):
        monkeypatch.chdir(tmp_path)
        with pytest.raises(run_paths.WorkdirSchemeError, match="is not supported"):
            workdir_guard.prepare_workdir(url, {"a": 1})
        assert list(tmp_path.iterdir()) == []

    @pytest.mark.skipif(HAS_GCSFS, reason="gcsfs installed: gs:// is readable")
    def test_gs_without_gcsfs_names_the_package(self, tmp_path, monkeypatch):
        monkeypatch.chdir(tmp_path)
        with pytest.raises(run_paths.WorkdirSchemeError, match=r"gcsfs.*mmr_jax\[gcs\]"):
            workdir_guard.prepare_workdir("gs://bucket/runs/x", {"a": 1})
        assert list(tmp_path.iterdir()) == []

    def test_local_paths_pass(self, tmp_path):
        run_paths.check(tmp_path / "run")
        run_paths.check("runs/x")
        assert run_paths.scheme("gs://b/x") == "gs" and run_paths.scheme("/a/gs:/b") is None
        assert workdir_guard.prepare_workdir(tmp_path / "run", {"a": 1}).is_dir()

    @pytest.mark.skipif(HAS_GCSFS, reason="gcsfs installed: gs:// is readable")
    def test_train_script_names_the_error(self, tmp_path):
        out = subprocess.run(
            [
                sys.executable,
                str(multihost.REPO / "scripts" / "train.py"),
                "--config=configs/cpu_smollm2.py",
                "--workdir=gs://bucket/runs/x",
            ],
            cwd=multihost.REPO,
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, "JAX_PLATFORMS": "cpu"},
        )
        assert out.returncode == 1
        want = "FATAL: --workdir='gs://bucket/runs/x': reading gs:// needs"
        assert want in out.stderr, out.stderr
        assert "gcsfs" in out.stderr
        assert not (multihost.REPO / "gs:").exists()


class TestRunDir:
    def test_local_workdir_in_place(self, tmp_path):
        run = run_paths.RunDir(tmp_path / "run")
        assert not run.remote and run.local == tmp_path / "run"
        assert run.appended("metrics.jsonl") == tmp_path / "run" / "metrics.jsonl"
        assert run.appended_dir("tb") == tmp_path / "run" / "tb"
        run.close()  # nothing to copy: no staging folder was made
        assert not (tmp_path / "run").exists()

    def test_bucket_file_fetched_appended_and_mirrored(self, bucket, tmp_path):
        (bucket / "run").mkdir(parents=True)
        (bucket / "run" / "train.log").write_text("old line\n")
        run = run_paths.RunDir("gs://bucket/run", every_s=0)
        local = run.appended("train.log")
        assert run.remote and local.is_relative_to(tmp_path / "staging")
        assert local.read_text() == "old line\n"  # fetched: a resumed run appends to it
        with open(local, "a") as f:
            f.write("new line\n")
        assert (bucket / "run" / "train.log").read_text() == "old line\n"  # until mirrored
        tb = run.appended_dir("tb")
        (tb / "events.1").write_bytes(b"\x00\x01")
        run.mirror()
        assert (bucket / "run" / "train.log").read_text() == "old line\nnew line\n"
        assert (bucket / "run" / "tb" / "events.1").read_bytes() == b"\x00\x01"
        (bucket / "run" / "train.log").write_text("changed remotely\n")
        run.mirror()  # unchanged locally: not copied again
        assert (bucket / "run" / "train.log").read_text() == "changed remotely\n"
        run.close()

    def test_periodic_mirror(self, bucket):
        run = run_paths.RunDir("gs://bucket/run", every_s=0.05)
        local = run.appended("train.log")
        local.write_text("line\n")
        deadline = time.monotonic() + 10
        while not (bucket / "run" / "train.log").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (bucket / "run" / "train.log").read_text() == "line\n"
        run.close()
        assert not run._thread.is_alive()

    def test_open_run_shared_and_closed(self, bucket):
        a = run_paths.open_run("gs://bucket/run/")
        assert run_paths.open_run("gs://bucket/run") is a
        a.appended("x.log").write_text("1\n")
        run_paths.close("gs://bucket/run")
        assert (bucket / "run" / "x.log").read_text() == "1\n"
        assert run_paths.open_run("gs://bucket/run") is not a
        run_paths.close("gs://bucket/run")

    def test_upload_tree(self, bucket, tmp_path):
        src = tmp_path / "src"
        (src / "adapter").mkdir(parents=True)
        (src / "config.json").write_text("{}")
        (src / "adapter" / "a.bin").write_bytes(b"ab")
        run_paths.upload_tree(src, "gs://bucket/out")
        assert (bucket / "out" / "config.json").read_text() == "{}"
        assert (bucket / "out" / "adapter" / "a.bin").read_bytes() == b"ab"

    def test_fetched_shadow_steps_and_tree_size(self, bucket, tmp_path):
        run = bucket / "run"
        for step in (1, 2):
            (run / f"step_{step}" / "adapter").mkdir(parents=True)
            (run / f"step_{step}" / "config.json").write_text(f'{{"step": {step}}}')
            (run / f"step_{step}" / "adapter" / "w.bin").write_bytes(b"w" * 10 * step)
        (run / "step_3.partial").mkdir()  # no config.json: not a step
        (run / "step_4").mkdir()
        assert run_paths.tree_size("gs://bucket/run/step_2") == len('{"step": 2}') + 20
        local = run_paths.fetched("gs://bucket/run/step_1")
        assert pathlib.Path(local).is_relative_to(tmp_path / "staging")
        assert (pathlib.Path(local) / "adapter" / "w.bin").read_bytes() == b"w" * 10
        assert pathlib.Path(run_paths.fetched("gs://bucket/run/step_2/config.json")).read_text()
        assert run_paths.fetched(tmp_path) == str(tmp_path)  # local: itself
        shadow = pathlib.Path(run_paths.shadow_steps("gs://bucket/run"))
        assert sorted(p.name for p in shadow.iterdir()) == ["step_1", "step_2"]
        assert [p.name for p in (shadow / "step_2").iterdir()] == ["config.json"]
        run_paths.fill_step(shadow / "step_2", "gs://bucket/run")
        assert (shadow / "step_2" / "adapter" / "w.bin").read_bytes() == b"w" * 20


class TestBucketWorkdir:
    def test_prepare_refuses_other_config_and_overwrites(self, bucket):
        out = workdir_guard.prepare_workdir("gs://bucket/run", {"a": 1, "b": {"c": 2}})
        assert str(out) == "gs://bucket/run"
        workdir_guard.claim("gs://bucket/run", {"a": 1, "b": {"c": 2}})  # the run started
        assert json.loads((bucket / "run" / workdir_guard.RUN_FILE).read_text())["config"]["a"] == 1
        assert workdir_guard.read_run_config("gs://bucket/run") == {"a": 1, "b": {"c": 2}}
        (bucket / "run" / checkpoint.CKPT_DIR / "1").mkdir(parents=True)  # and checkpointed
        workdir_guard.prepare_workdir("gs://bucket/run", {"a": 1, "b": {"c": 2}})  # same: resumes
        with pytest.raises(workdir_guard.RunMismatchError, match=r"b.c: 2 -> 3"):
            workdir_guard.prepare_workdir("gs://bucket/run", {"a": 1, "b": {"c": 3}})
        (bucket / "run" / metrics.METRICS_FILE).write_text("{}\n")
        workdir_guard.prepare_workdir("gs://bucket/run", {"a": 2}, overwrite=True)
        assert list((bucket / "run").iterdir()) == []

    def test_metrics_staged_mirrored_and_truncated_on_resume(self, bucket):
        w = metrics.MetricWriter("gs://bucket/run", tensorboard=True)
        for step in (1, 2, 3):
            w.write(step, {"loss": float(step)})
        w.close()
        assert not (bucket / "run" / metrics.METRICS_FILE).exists()  # staged until mirrored
        run_paths.close("gs://bucket/run")
        rows = metrics.read_jsonl("gs://bucket/run/" + metrics.METRICS_FILE)
        assert [r["loss"] for r in rows] == [1.0, 2.0, 3.0]
        assert any((bucket / "run" / "tb").iterdir())  # TensorBoard's events, mirrored
        # A resume from checkpoint 2 (in a fresh staging folder): the remote file is the truth.
        w = metrics.MetricWriter("gs://bucket/run", tensorboard=False, resume_step=2)
        w.write(3, {"loss": 30.0})
        w.close()
        run_paths.close("gs://bucket/run")
        rows = metrics.read_jsonl(bucket / "run" / metrics.METRICS_FILE)
        assert [(r["step"], r["loss"]) for r in rows] == [(1, 1.0), (2, 2.0), (3, 30.0)]
