"""Study v2 configs: five arms x seeds 1-6, the warm-up, the plan's keys reaching the report."""

import os
import sys

from mmr_jax.config import checks
from mmr_jax.problems import tasks
from mmr_jax.studies import reporting, study

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "configs"))
import study_v2
import study_v2_warmup


def test_grid_is_five_arms_by_six_seeds_seed_major():
    specs = study.plan(study_v2.get_config())
    assert len(specs) == 30
    assert [s.name for s in specs[:5]] == [
        "grpo_s1", "dra_grpo_s1", "mmr_grpo_s1", "mmr_grpo_batch_s1", "mmr_grpo_guard_s1",
    ]  # fmt: skip
    assert sorted({s.seed for s in specs}) == [1, 2, 3, 4, 5, 6]
    arms = {s.variant: s.cfg for s in specs if s.seed == 1}
    assert (arms["grpo"].reweight.method, arms["dra_grpo"].reweight.method) == ("none", "dra")
    for name in ("mmr_grpo", "mmr_grpo_batch", "mmr_grpo_guard"):
        assert arms[name].reweight.method == "mmr"
    assert [arms[n].reweight.scope for n in ("mmr_grpo", "mmr_grpo_batch", "mmr_grpo_guard")] == [
        "group", "batch", "group",
    ]  # fmt: skip
    assert [n for n, c in arms.items() if c.reweight.uniform_group_guard] == ["mmr_grpo_guard"]
    # Every arm: the same start, task, budget and evaluation.
    keys = {(c.model.path, c.data.source, c.eval.source, c.total_steps, c.eval.every, c.eval.n)
            for c in arms.values()}  # fmt: skip
    assert keys == {(study_v2.WARM_CHECKPOINT, f"task:{study_v2.TASK}", "task", 40, 4, 2)}
    assert study_v2.TASK in tasks.TASKS


def test_fixed_thresholds_reach_the_report():
    c = study_v2.get_config()
    meta = study.resolved(c, study.plan(c))["study"]
    assert meta["fixed_thresholds"] == [0.35, 0.45]
    run = {"name": "grpo_s1", "variant": "grpo", "seed": 1, "status": "finished",
           "curve": {"steps": [0, 4, 8], "values": [0.3, 0.4, 0.5], "train_s": [0, 1, 2],
                     "last_step": 8}}  # fmt: skip
    s = reporting.summarise([run], {**meta, "run": ["grpo"], "compare": []})
    assert s["per_run"]["grpo_s1"]["step_to_35"] == 4
    assert s["per_run"]["grpo_s1"]["step_to_45"] == 8


def test_pilot_and_warmup():
    pilot = study.plan(study_v2.get_config("pilot"))
    assert len(pilot) == 5 and pilot[0].cfg.total_steps == 2
    w = checks.from_config_dict(study_v2_warmup.get_config())
    assert w.reweight.method == "none" and w.total_steps == 12 and w.seed not in range(1, 7)
    # The export the arms start from is written at the last step.
    assert w.checkpoint.export_hf and w.total_steps % w.checkpoint.every == 0
    assert (w.data.source, w.data.arithmetic_max_operand, w.data.arithmetic_ops) == (
        "arithmetic", 9, ("+",),
    )  # fmt: skip
