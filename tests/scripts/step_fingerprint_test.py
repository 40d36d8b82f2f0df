"""scripts/step_fingerprint.py: what it compares and what it runs in today's tree."""

import ast
import importlib.util
import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def fingerprint():
    spec = importlib.util.spec_from_file_location(
        "step_fingerprint", REPO / "scripts" / "step_fingerprint.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ROW = {"step": 1, "loss": 0.5, "grad_norm": 2.0, "reward/mean": 0.25, "groups/x": 1.0}


def test_identical_figures_compare_clean(fingerprint):
    assert fingerprint.compare({"a": [ROW]}, {"a": [dict(ROW)], "b": [ROW]}) == ([], [])


def test_every_differing_figure_is_named_with_both_values(fingerprint):
    after = {**ROW, "loss": 0.75, "new/key": 1.0}
    del after["groups/x"]
    unexplained, intended = fingerprint.compare({"a": [ROW, ROW]}, {"a": [after]})
    assert intended == []
    assert unexplained == [
        "a: 2 steps before, 1 after",
        "a step 1 groups/x: 1.0 -> 'absent'",
        "a step 1 loss: 0.5 -> 0.75",
        "a step 1 new/key: 'absent' -> 1.0",
    ]


def test_intended_changes_only_for_reported_figures(fingerprint, monkeypatch):
    monkeypatch.setattr(
        fingerprint,
        "INTENDED",
        {("a", "reward/mean"): "why", ("*", "groups/x"): "everywhere", ("a", "loss"): "never"},
    )
    after = {**ROW, "reward/mean": 0.5, "groups/x": 0.0, "loss": 0.0}
    unexplained, intended = fingerprint.compare(
        {"a": [ROW], "b": [ROW]}, {"a": [after], "b": [after]}
    )
    # A step figure (loss) is never excused; a reported one only for the case it is listed for.
    assert unexplained == [
        "a step 1 loss: 0.5 -> 0.0",
        "b step 1 loss: 0.5 -> 0.0",
        "b step 1 reward/mean: 0.25 -> 0.5",
    ]
    assert intended == [
        "a step 1 groups/x: 1.0 -> 0.0  [intended: everywhere]",
        "a step 1 reward/mean: 0.25 -> 0.5  [intended: why]",
        "b step 1 groups/x: 1.0 -> 0.0  [intended: everywhere]",
    ]


def test_the_written_intended_changes_name_no_step_figure(fingerprint):
    assert not {key for _, key in fingerprint.INTENDED} & fingerprint.INVARIANT
    for case, _ in fingerprint.INTENDED:
        assert case == "*" or case in fingerprint.cases()


@pytest.mark.parametrize("variant", ["grpo", "dapo", "dr_grpo", "gspo", "cispo"])
def test_smoke_task_is_todays_smoke(fingerprint, variant):
    """In this tree the overrides that give an older tree today's `:smoke` change nothing."""
    from mmr_jax.config import command_line

    config = command_line.load_config_file(f"{REPO}/configs/{variant}.py:smoke")
    for arg in fingerprint._smoke_task():
        key, value = arg.removeprefix("--config.").split("=", 1)
        node = config
        for part in key.split("."):
            node = node[part]
        if isinstance(node, bool):
            want = value == "True"
        elif isinstance(node, tuple):
            want = ast.literal_eval(value)
        else:
            want = type(node)(value)
        assert node == want, (key, node, value)
