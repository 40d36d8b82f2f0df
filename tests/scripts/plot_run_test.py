"""scripts/plot_run.py on synthetic runs."""

import json
import pathlib
import subprocess
import sys

import pytest

from support import testing

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "plot_run.py"


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

    def test_step_ticks_are_whole_numbers(self, tmp_path, monkeypatch):
        import matplotlib.pyplot as plt

        figures = []
        monkeypatch.setattr(plt, "close", figures.append)  # keep the figure to read its axes
        _module().plot([_run(tmp_path / "r", steps=4)], tmp_path / "x.png")
        ticks = [t for ax in figures[0].axes if ax.lines for t in ax.get_xticks()]
        assert ticks and all(float(t).is_integer() for t in ticks), ticks  # was 1.0, 1.5, ...

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

    def test_mean_band_by_hand(self):
        mod = _module()
        runs = [
            [{"step": 0, "m": 0.1}, {"step": 5, "m": 0.5}, {"step": 10, "m": 0.6}],
            [{"step": 0, "m": 0.3}, {"step": 5, "m": 0.2}],  # stopped early: step 10 left out
            [{"step": 0, "m": 0.2}, {"step": 5, "m": 0.8}, {"step": 10, "m": "nan"}],
        ]
        steps, mean, lo, hi = mod.mean_band(runs, "m")
        assert steps == [0, 5]
        assert mean == pytest.approx([0.2, 0.5]) and lo == [0.1, 0.2] and hi == [0.3, 0.8]

    def test_bands_cli(self, tmp_path):
        runs = [_run(tmp_path / f"r{i}", offset=0.1 * i) for i in range(4)]
        out = tmp_path / "bands.png"
        res = subprocess.run(
            [sys.executable, str(SCRIPT), *map(str, runs), f"--out={out}", "--bands",
             "--labels=A,A,B,B", "--metrics=reward/mean,kl"],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        assert res.returncode == 0, res.stderr
        assert out.stat().st_size > 1000 and "reward/mean, kl" in res.stdout
