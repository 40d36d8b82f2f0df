"""scripts/plot_run.py on synthetic runs."""

import json
import pathlib
import subprocess
import sys

import pytest

from mmr_jax import testing

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "scripts" / "plot_run.py"


def _module():
    return testing.load_script("plot_run")


def _run(path, offset=0.0, steps=8):
    path.mkdir(parents=True)
    with open(path / "metrics.jsonl", "w") as f:
        for s in range(1, steps + 1):
            row = {
                "step": s,
                "reward/mean": offset + 0.1 * s,
                "reward/accuracy/mean": 0.05 * s,
                "reward/format/mean": 0.5,
                "mmr/lambda_mean": 0.6,
                "kl": 0.01 * s,
                "other": 1,
            }
            f.write(json.dumps(row) + "\n")
    return path


class TestPlotRun:
    def test_select_metrics(self):
        mod = _module()
        rows = [[{"step": 1, "reward/mean": 1, "reward/accuracy/mean": 1, "reward/a/b/mean": 1}]]
        assert mod.select_metrics(rows) == ["reward/mean", "reward/accuracy/mean"]

    def test_two_runs(self, tmp_path):
        mod = _module()
        a, b = _run(tmp_path / "grpo"), _run(tmp_path / "mmr_grpo", offset=0.2)
        out = tmp_path / "cmp.png"
        names = mod.plot([a, b], out, labels=["GRPO", "MMR-GRPO"], smooth=0.5)
        assert out.stat().st_size > 1000
        assert names[:2] == ["reward/mean", "reward/accuracy/mean"] and "kl" in names

    def test_missing_metric(self, tmp_path):
        with pytest.raises(ValueError, match="none of the metrics"):
            _module().plot([_run(tmp_path / "r")], tmp_path / "x.png", metrics=["nope"])

    def test_cli(self, tmp_path):
        run = _run(tmp_path / "r")
        out = tmp_path / "c.png"
        res = subprocess.run(
            [sys.executable, str(SCRIPT), str(run), f"--out={out}"],
            capture_output=True,
            text=True,
            check=False,
        )
        assert res.returncode == 0, res.stderr
        assert out.exists() and "reward/mean" in res.stdout
