"""`benchmarks/rl_step.py`: the trainer's command and the per-step figures it reports."""

import pytest

from mmr_jax.config import command_line
from mmr_jax.infra import bench_harness

rl_step = bench_harness.load("rl_step")


def test_command_is_train_py_on_random_weights_with_overrides_last():
    argv = rl_step.command("configs/grpo.py:1.5b", 2, "/tmp/w", ["batch.max_completion_len=1024"])
    assert argv[1].endswith("scripts/train.py") and argv[2] == "--config=configs/grpo.py:1.5b"
    assert "--config.model.init=random" in argv and "--config.total_steps=2" in argv
    assert argv[-1] == "--config.batch.max_completion_len=1024"
    command_line.check_override_keys(argv[1:])  # every key is one train.py accepts
    with pytest.raises(ValueError, match="key=value"):
        rl_step.command("c.py", 1, "/tmp/w", ["no_equals"])


def test_per_step_keeps_phases_in_step_order_and_summary_skips_the_compile_step():
    rows = [
        {"step": 2, "time/step": 3.0, "time/rollout": 2.0, "reward/mean": 0.5},
        {"step": 1, "time/step": 30.0, "time/rollout": 20.0, "throughput/tokens": 100},
        {"step": 3, "time/step": 5.0, "time/rollout": 4.0, "throughput/tokens": 100},
    ]
    steps = rl_step.per_step(rows)
    assert [s["step"] for s in steps] == [1, 2, 3]
    assert "reward/mean" not in steps[1]
    s = rl_step.summarize(steps)
    assert s["time/step"] == 4.0 and s["time/rollout"] == 3.0 and s["throughput/tokens"] == 100
    assert rl_step.summarize(steps[:1])["time/step"] == 30.0  # one step: that one
    assert rl_step.summarize([]) == {}


def test_read_rows_keeps_whole_lines_and_leaves_a_half_written_one(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "time/step": 2.0}\n{"step": 2, "ti')
    assert rl_step.read_rows(tmp_path) == [{"step": 1, "time/step": 2.0}]
    assert rl_step.read_rows(tmp_path / "absent") == []


def test_rl_step_saves_no_checkpoint():
    argv = rl_step.command("configs/grpo.py:1.5b", 2, "/tmp/w", [])
    assert "--config.checkpoint.every=0" in argv and "--config.checkpoint.at_end=False" in argv
    command_line.check_override_keys(argv[1:])
