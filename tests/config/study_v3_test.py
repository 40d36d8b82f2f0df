"""configs/study_v3.py holds what docs/study_v3/plan.md requires of the setup."""

import dataclasses
import importlib.util
import pathlib

import pytest

from mmr_jax.studies import study

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _load(arg=None):
    spec = importlib.util.spec_from_file_location("study_v3", ROOT / "configs" / "study_v3.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(arg)


def test_setup_meets_the_plan():
    specs = study.plan(_load())
    assert {s.variant for s in specs} == {"grpo", "mmr_grpo", "mmr_grpo_guard"}
    for s in specs:
        cfg = s.cfg
        assert cfg.batch.prompts >= 32 and cfg.batch.generations >= 8
        assert cfg.batch.max_completion_len >= 256
        assert cfg.eval.n >= 4 and tuple(cfg.eval.benchmarks) == ("math500",)
        assert cfg.eval.max_problems == 0  # all 500
    by_variant = {s.variant: s.cfg for s in specs if s.seed == 1}
    assert by_variant["mmr_grpo"].reweight.method == "mmr"
    assert by_variant["grpo"].reweight.method == "none"
    assert by_variant["mmr_grpo_guard"].reweight.uniform_group_guard


def test_pilot_is_three_grpo_seeds():
    specs = study.plan(_load("pilot"))
    assert [(s.variant, s.seed) for s in specs] == [("grpo", 1), ("grpo", 2), ("grpo", 3)]
    # The pilot trains exactly what the arms' GRPO runs train (only the run's name differs).
    pilot, arm = specs[0].cfg, study.plan(_load())[0].cfg
    assert dataclasses.replace(pilot, name=arm.name) == arm


def test_unknown_argument_is_refused():
    with pytest.raises(ValueError, match="unknown config argument"):
        _load("pilots")
