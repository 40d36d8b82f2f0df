"""`:smoke` of every variant: the CPU default's model, task, reward and encoder, and only the sizes
and schedule it names (configs/base.py `shrink_for_cpu`); the variant's algorithm unchanged."""

import pathlib

import pytest

from mmr_jax.config import checks, command_line

CONFIGS = pathlib.Path(__file__).resolve().parents[2] / "configs"
VARIANTS = ("grpo", "dr_grpo", "dapo", "dapo_nods", "gspo", "cispo", "grpo_7b")


def _cfg(spec):
    return checks.from_config_dict(command_line.load_config_file(str(CONFIGS / spec)))


@pytest.mark.parametrize("name", VARIANTS)
def test_smoke_keeps_the_cpu_defaults_task_and_encoder(name):
    smoke, cpu = _cfg(f"{name}.py:smoke"), _cfg("cpu_smollm2.py")
    assert smoke.model.path == cpu.model.path and smoke.model.dtype == cpu.model.dtype
    assert smoke.data == cpu.data  # sums of 1-10, the one-sentence prompt
    assert smoke.reweight.embedding_model == cpu.reweight.embedding_model == "minilm"
    assert smoke.rewards.weights["accuracy"] == 1.0 and smoke.rewards.accuracy_number_only


@pytest.mark.parametrize("name", VARIANTS)
def test_smoke_leaves_the_algorithm_as_the_variant_has_it(name):
    smoke, full = _cfg(f"{name}.py:smoke"), _cfg(f"{name}.py")
    assert smoke.advantage == full.advantage and smoke.reweight.method == full.reweight.method
    assert smoke.dynamic_sampling.enabled == full.dynamic_sampling.enabled
    for key in ("objective", "importance_sampling_level", "aggregation", "eps_low", "eps_high",
                "beta", "iterations"):  # fmt: skip
        assert getattr(smoke.loss, key) == getattr(full.loss, key), key


def test_dapo_full_keeps_its_overlong_reward_under_smoke():
    assert _cfg("dapo.py:smoke,full").rewards.weights["overlong"] == 1.0
