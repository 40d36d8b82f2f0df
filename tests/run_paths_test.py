"""Run paths that are URLs (gs://, s3://) are refused with a named error before anything is built
or written (issue 36, item 6: `pathlib` made `--workdir=gs://b/x` a local folder 'gs:/b/x')."""

import subprocess
import sys

import pytest

from mmr_jax import checkpoint

from support import multihost


@pytest.mark.parametrize("url", ["gs://bucket/runs/x", "s3://b/x", "file:///tmp/x"])
def test_url_workdir_refused_and_nothing_written(tmp_path, monkeypatch, url):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(checkpoint.WorkdirSchemeError, match="not supported"):
        checkpoint.prepare_workdir(url, {"a": 1})
    assert list(tmp_path.iterdir()) == []


def test_local_paths_pass(tmp_path):
    checkpoint.check_local_path(tmp_path / "run")
    checkpoint.check_local_path("runs/x")
    assert checkpoint.prepare_workdir(tmp_path / "run", {"a": 1}).is_dir()


def test_train_script_names_the_error(tmp_path):
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
        env={**__import__("os").environ, "JAX_PLATFORMS": "cpu"},
    )
    assert out.returncode == 1
    assert "ERROR: WorkdirSchemeError: --workdir='gs://bucket/runs/x'" in out.stderr, out.stderr
    assert not (multihost.REPO / "gs:").exists()
