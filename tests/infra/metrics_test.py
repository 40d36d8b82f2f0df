"""Metric writers, progress line, periodic actions."""

import json

import numpy as np
import pytest

from mmr_jax.infra import metrics


class TestMetricWriter:
    def test_jsonl_and_tensorboard(self, tmp_path):
        w = metrics.MetricWriter(tmp_path, tensorboard=True)
        w.write(1, {"loss": np.float32(0.5), "kl": 0.1, "hist": np.ones(3), "name": "x"})
        w.write(2, {"loss": float("nan")})
        w.close()
        rows = metrics.read_jsonl(tmp_path / "metrics.jsonl")
        assert rows[0] == {"step": 1, "loss": 0.5, "kl": pytest.approx(0.1)}
        assert rows[1] == {"step": 2, "loss": "nan"}
        assert any((tmp_path / "tb").iterdir())

    def test_resume_drops_later_steps(self, tmp_path):
        w = metrics.MetricWriter(tmp_path, tensorboard=False)
        for s in range(1, 6):
            w.write(s, {"x": s})
        w.close()
        with open(tmp_path / "metrics.jsonl", "a") as f:
            f.write('{"step": 6, "x"')  # torn line of a killed writer
        w = metrics.MetricWriter(tmp_path, tensorboard=False, resume_step=3)
        w.write(4, {"x": 40})
        w.close()
        rows = metrics.read_jsonl(tmp_path / "metrics.jsonl")
        assert [(r["step"], r["x"]) for r in rows] == [(1, 1), (2, 2), (3, 3), (4, 40)]
        assert json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])["x"] == 40


class TestPeriodic:
    @pytest.mark.parametrize(
        "every,last,expected",
        [(2, 7, [2, 4, 6, 7]), (0, 7, [7]), (3, None, [3, 6]), (1, 3, [1, 2, 3, 4, 5, 6, 7])],
    )
    def test_fires(self, every, last, expected):
        p = metrics.Periodic(every, last=last)
        assert [s for s in range(1, 8) if p(s)] == expected

    def test_no_last(self):
        p = metrics.Periodic(0, last=7, at_last=False)
        assert not any(p(s) for s in range(1, 8))


class TestProgress:
    def test_line(self):
        p = metrics.Progress(total=10, start_step=2)
        assert "ETA ?" in p.line(2, {})
        p._t0 -= 20.0  # 20 s for 2 steps -> 10 s/step, 6 steps left
        line = p.line(4, {"reward/mean": 0.25, "loss": -0.1, "time/step": 4.25})
        assert "step 4/10" in line and "reward 0.25" in line and "ETA 1m00s" in line
        # the step's own time and the wall time per step since the start, each named
        assert "took 4.2s" in line and "10.0s/step avg" in line

    @pytest.mark.parametrize("s,text", [(5, "5s"), (65, "1m05s"), (3725, "1h02m05s")])
    def test_format_duration(self, s, text):
        assert metrics.format_duration(s) == text
