"""scripts/evaluate.py on a training run's own Orbax checkpoints (no step_N exports): the same
records as on the run's HF export of that step, and the initial weights as step 0."""

import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from mmr_jax import rewards
from mmr_jax.config import checks
from mmr_jax.training import checkpoint, hf_export, trainer

from support import testing

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "configs"))
import grpo  # noqa: E402


@rewards.register("eval_run_digits") if "eval_run_digits" not in rewards.REGISTRY else (lambda f: f)
def _digits(completions, answers, *, lengths=None):
    """Pays for the share of digits: rewards that vary within a group, so the weights move."""
    del answers, lengths
    return np.array([sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions], "f4")


def _evaluate(run, out, *extra):
    cmd = [
        sys.executable, str(REPO / "scripts" / "evaluate.py"),
        f"--config={REPO / 'configs' / 'eval.py'}:run", f"--config.run_dir={run}",
        f"--config.output_dir={out}", "--config.grader_workers=0",
        "--config.keep_completions=True", *extra,
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def _records(path):
    return [
        (r["id"], r["correct"], r["completions"]) for r in json.loads(path.read_text())["records"]
    ]


@pytest.mark.slow
def test_orbax_checkpoints_evaluate_as_their_export(tmp_path, tiny_llama_dir):
    run = tmp_path / "run"
    c = testing.smoke_config(grpo, tiny_llama_dir, steps=2, lora=True)
    c.optim.lr = 0.05  # two steps that visibly move the tiny model's samples
    c.rewards.weights = {"eval_run_digits": 1.0, "format": 0.0}
    c.dynamic_sampling.filter_reward = "eval_run_digits"
    c.eval.every, c.eval.source, c.eval.arithmetic_problems = 0, "arithmetic", 4
    c.eval.n, c.eval.max_new_tokens, c.eval.system_prompt = 2, 8, ""
    cfg = checks.from_config_dict(c)
    trainer.train(cfg, run)
    assert checkpoint.saved_steps(run) == [1, 2] and not list(run.glob("step_*"))

    stdout = _evaluate(run, tmp_path / "orbax")
    assert "== step_0 (initial weights)" in stdout and "== step_2" in stdout, stdout
    orbax = _records(tmp_path / "orbax" / "step_2.json")
    assert len(orbax) == 4 and all(len(r[2]) == 2 for r in orbax)  # 4 held-out sums, n = 2
    assert orbax != _records(tmp_path / "orbax" / "step_0.json")  # trained weights, not the base

    hf_export.export_hf(cfg, run, run / "step_2", step=2)  # the HF export of the same step (merged)
    _evaluate(run, tmp_path / "export", "--config.step=2", "--config.with_base=False")
    assert _records(tmp_path / "export" / "step_2.json") == orbax


def test_a_folder_without_a_run_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="is not a training run"):
        hf_export.run_config(tmp_path)
    assert checkpoint.saved_steps(tmp_path) == []
