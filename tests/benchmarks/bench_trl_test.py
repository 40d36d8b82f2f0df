"""The TRL anchor benchmark: both sides get the same prompts, rewards and batch; its sums."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from mmr_jax.config import command_line
from mmr_jax.infra import bench_harness
from mmr_jax.problems import data
from mmr_jax.training import problem_sets

from support import testing

bench = bench_harness.load("bench_trl")
job = bench_harness.load("trl_job")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    import transformers

    path = tmp_path_factory.mktemp("tok")
    testing.make_tiny_tokenizer(path)
    return transformers.AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def cfg():
    over = {**job.overrides(5, mmr=False), "batch.max_prompt_len": 512}
    return command_line.load_config("configs/cpu_smollm2.py", over)


def test_overrides_are_config_keys_train_py_accepts():
    argv = ["train.py", "--config=configs/cpu_smollm2.py"]
    argv += [f"--config.{k}={v}" for k, v in job.overrides(3, mmr=False).items()]
    command_line.check_override_keys(argv)  # raises on a key the config does not have
    c = command_line.load_config("configs/cpu_smollm2.py", job.overrides(3, mmr=False))
    assert (c.total_steps, c.checkpoint.every, c.reweight.method) == (3, 0, "none")
    assert command_line.load_config(
        "configs/cpu_smollm2.py", job.overrides(3, mmr=True)
    ).reweight.method == ("mmr")


def test_step_batches_are_the_trainers_prompts_in_its_order(cfg, tokenizer):
    steps = 5
    batches = job.step_batches(cfg, tokenizer, steps)
    # The trainer's draw (trainer.setup): load_prompts, then a PromptIterator on (ids, answer).
    ids, answers, _ = problem_sets.load_prompts(cfg, tokenizer, problem_sets.eval_problems(cfg))
    it = data.PromptIterator(list(zip(ids, answers, strict=True)), cfg.batch.prompts, cfg.seed)
    for batch in batches:
        want = next(it)
        assert [(list(p), a) for p, a, _ in batch] == [(list(p), a) for p, a in want]
        for _, answer, chat in batch:
            assert chat[0] == {"role": "system", "content": cfg.data.system_prompt}
            question = chat[1]["content"]  # "What is a + b?"
            a, b = question.removeprefix("What is ").removesuffix("?").split(" + ")
            assert int(a) + int(b) == int(answer)
    assert sum(len(b) for b in batches) == steps * cfg.batch.prompts


def test_step_batches_refuses_prompts_trl_would_tokenise_otherwise(cfg, tokenizer, monkeypatch):
    monkeypatch.setattr(job, "trl_prompt_ids", lambda tok, chat: [0])
    with pytest.raises(ValueError, match="differently"):
        job.step_batches(cfg, tokenizer, 1)


def test_reward_fn_scores_as_the_trainer_with_number_only(cfg):
    calls = []
    fn = job.make_reward_fn(cfg, calls)
    completions = [
        [{"role": "assistant", "content": "The answer is 7."}],
        [{"role": "assistant", "content": "The answer is 3 + 4."}],  # restates: not a number
        [{"role": "assistant", "content": "The answer is 8."}],
        "So \\boxed{7}",  # TRL passes plain strings for plain-text prompts
    ]
    got = fn(completions, ["7"] * 4, completion_ids=[[1, 2, 3]] * 4, trainer_state=None)
    assert got == [1.0, 0.0, 0.0, 1.0]
    assert calls == [4]


def test_summary_table_medians_and_ratio():
    results = {
        "trl": {
            "step_s": [9.0, 4.0, 6.0, 5.0],
            "phases": [{"g": 1.0}] * 4,
            "completion_len": [8] * 4,
        },
        "ours": {"step_s": [99.0, 2.0, 3.0, 1.0], "phases": [{}] * 4, "completion_len": [10] * 4},
    }
    text, s = bench.table(results, warmup=1)
    assert (s["trl"]["median_s"], s["trl"]["min_s"], s["trl"]["max_s"]) == (5.0, 4.0, 6.0)
    assert s["ours"]["median_s"] == 2.0 and s["ours"]["steps_timed"] == 3
    assert s["ours"]["trl_over_side"] == 2.5 and s["trl"]["trl_over_side"] == 1.0
    assert s["trl"]["phases"] == {"g": 1.0}
    assert "2.50" in text
    with pytest.raises(ValueError, match="nothing timed"):
        bench_harness.step_summary([1.0, 2.0], warmup=2)


def test_whole_run_counts_every_step_of_every_round():
    # Two rounds each: TRL's steps average 10 and 6 (mean 8); ours 30 (a compile) then 2s.
    results = {
        "trl": {"rounds": [{"step_s": [12.0, 8.0]}, {"step_s": [6.0, 6.0]}]},
        "ours": {"rounds": [{"step_s": [30.0, 2.0]}, {"step_s": [2.0, 2.0]}]},
    }
    whole = bench.whole_run(results)
    assert whole["trl"]["whole_run_mean_s"] == 8.0 and whole["ours"]["whole_run_mean_s"] == 9.0
    assert whole["ours"]["trl_over_side_whole_run"] == pytest.approx(8.0 / 9.0)
    assert "0.89x" in bench.format_whole_run(whole)


def test_read_our_metrics_orders_steps_and_rejects_gaps(tmp_path):
    rows = [
        {
            "step": 2,
            "time/step": 3.0,
            "time/train": 2.0,
            "completion/length_mean": 9,
            "reward/mean": 0.5,
        },
        {
            "step": 1,
            "time/step": 7.0,
            "time/train": 6.0,
            "completion/length_mean": 8,
            "reward/mean": 0.1,
        },
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = bench.read_our_metrics(str(tmp_path))
    assert got["step_s"] == [7.0, 3.0] and got["phases"] == [{"train": 6.0}, {"train": 2.0}]
    (tmp_path / "metrics.jsonl").write_text(json.dumps(rows[0]) + "\n")
    with pytest.raises(ValueError, match="expected 1, 2"):
        bench.read_our_metrics(str(tmp_path))


@pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="trl not installed (.[bench])")
def test_trl_config_generates_once_per_update_of_b_times_g(cfg, tmp_path):
    c = job.trl_config(cfg, 3, str(tmp_path))
    b, g, mb = cfg.batch.prompts, cfg.batch.generations, cfg.loss.minibatches
    # One optimiser update = gradient_accumulation_steps micro-batches = one generation batch.
    assert c.generation_batch_size == b * g
    assert c.steps_per_generation == c.gradient_accumulation_steps == mb
    assert c.per_device_train_batch_size * mb == b * g
    assert (c.num_generations, c.max_completion_length, c.temperature) == (g, 32, 0.7)
    assert (c.beta, c.learning_rate, c.loss_type, c.bf16) == (0.0, 2e-5, "grpo", False)
    assert not c.activation_checkpointing and not c.gradient_checkpointing


def worker_env() -> dict:
    """The TRL worker's environment, built rather than inherited: nothing that this pytest process
    carries (JAX / XLA options, a compilation-cache folder, PYTHONPATH, thread counts another test
    set) reaches the worker, so it runs the same whatever ran before it on this pytest worker."""
    env = {k: os.environ[k] for k in ("PATH", "HOME", "TMPDIR", "LANG", "USER") if k in os.environ}
    return env | {
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": "1",
        "JAX_PLATFORMS": "cpu",
        "MMR_JAX_COMPILE_CACHE": "off",
    }


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="trl not installed (.[bench])")
def test_trl_worker_runs_the_job_and_reports_its_phases(tmp_path):
    # The whole TRL side on a tiny random checkpoint: the worker itself raises unless every step
    # made exactly one reward call of B x G completions. One torch thread: under `-n 2` the other
    # pytest worker holds the second core. TRL's output_dir (the JSON's folder) is a folder of
    # its own, not the checkpoint's. A failure shows the worker's exit status and output.
    model = testing.make_tiny_checkpoint(tmp_path / "tiny")
    out = tmp_path / "run" / "trl.json"
    out.parent.mkdir()
    argv = [sys.executable, bench.__file__, "--worker=trl", f"--worker_out={out}"]
    argv += [f"--model_path={model}", "--steps=2", "--threads=1"]
    proc = subprocess.run(
        argv, cwd=bench.ROOT, env=worker_env(), capture_output=True, text=True, timeout=1200
    )
    if proc.returncode != 0:
        pytest.fail(
            f"TRL worker exit {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-6000:]}"
        )
    r = json.loads(out.read_text())
    assert len(r["step_s"]) == len(r["phases"]) == len(r["completion_len"]) == 2
    for step_s, phases, trl_s in zip(r["step_s"], r["phases"], r["trl_step_time"], strict=True):
        # TRL's generation is timed inside its input preparation, which is inside the step.
        assert 0 < phases["transformers.generate"] < phases["_prepare_inputs"] < step_s
        assert 0 < phases["compute_loss"] < step_s
        assert trl_s <= step_s
    assert all(1 <= n <= 32 for n in r["completion_len"])
    assert r["generation_kwargs"]["cache_implementation"] == "None"
