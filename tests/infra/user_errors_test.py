"""One line for each mistake (issue 55): the scripts fed bad input end with exactly one stderr line,
`FATAL: <what is wrong>; <what to type next>`, exit code 1, and create, lose or claim nothing;
the traceback goes to the run's log file. A start that fails claims nothing; a run that saved a
checkpoint still refuses another config; a truncated checkpoint is one warning line."""

import json
import logging
import os
import pathlib
import subprocess
import sys

import pytest

from mmr_jax.infra import user_errors
from mmr_jax.training import checkpoint, workdir_guard

from support import checkpoint_trees, train_script

REPO = pathlib.Path(__file__).resolve().parents[2]


def _script(name, *args, cwd=REPO, env=None, timeout=600):
    """(exit code, stdout, stderr lines) of scripts/<name> run with `args`."""
    full_env = {**os.environ, "JAX_PLATFORMS": "cpu", "HF_HUB_OFFLINE": "1", **(env or {})}
    out = subprocess.run(
        [sys.executable, str(REPO / "scripts" / name), *map(str, args)],
        cwd=cwd,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return out.returncode, out.stdout, out.stderr.splitlines()


def _fatal(rc, stderr) -> str:
    """The one FATAL line, asserted to be all of stderr."""
    assert rc == 1 and len(stderr) == 1, (rc, stderr[-40:])
    assert stderr[0].startswith("FATAL: "), stderr
    return stderr[0]


def _tree(folder: pathlib.Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


class TestFatalLine:
    def test_message_on_one_line(self):
        err = user_errors.UserError("first\n  second\tthird")
        assert user_errors.fatal_line(err) == "FATAL: first second third"
        assert user_errors.fatal_line(err, "then x") == "FATAL: first second third. then x"

    def test_report_puts_the_traceback_in_the_log_file_only(self, tmp_path):
        handler = logging.FileHandler(tmp_path / "run.log")
        logging.getLogger().addHandler(handler)
        try:
            try:
                raise user_errors.UserError("bad path")
            except user_errors.UserError as e:
                line = user_errors.report(e)
        finally:
            logging.getLogger().removeHandler(handler)
            handler.close()
        assert line == "FATAL: bad path"
        text = (tmp_path / "run.log").read_text()
        assert "Traceback" in text and "test_report_puts_the_traceback" in text


CONFIG = "--config=configs/cpu_smollm2.py"


class TestConfigMistakes:
    @pytest.mark.parametrize(
        "override,want",
        [
            ("total_steps=abc", "total_steps takes an int (configs/cpu_smollm2.py sets 30)"),
            ("batch.prompts=2.5", "batch.prompts takes an int (configs/cpu_smollm2.py sets 4)"),
            (
                "reweight.uniform_group_guard=yes_please",
                "reweight.uniform_group_guard takes True or False",
            ),
        ],
    )
    def test_a_value_of_the_wrong_type(self, tmp_path, override, want):
        line = _fatal(
            *_script("train.py", CONFIG, f"--workdir={tmp_path}/run", f"--config.{override}")[::2]
        )
        assert want in line and f"e.g. --config.{override.split('=')[0]}=" in line, line
        assert list(tmp_path.iterdir()) == []

    def test_a_value_out_of_its_choices(self, tmp_path):
        args = (CONFIG, f"--workdir={tmp_path}/run", "--config.advantage.estimator=rlooo")
        line = _fatal(*_script("train.py", *args)[::2])
        assert "advantage.estimator='rlooo'; expected one of" in line and "'rloo'" in line
        assert list(tmp_path.iterdir()) == []

    def test_a_config_file_that_is_not_there(self, tmp_path):
        line = _fatal(
            *_script("train.py", "--config=configs/nope.py", f"--workdir={tmp_path}/r")[::2]
        )
        assert "config file 'configs/nope.py' not found" in line and "'grpo.py'" in line
        assert list(tmp_path.iterdir()) == []

    def test_a_flag_absl_does_not_know(self, tmp_path):
        line = _fatal(*_script("train.py", CONFIG, f"--worksdir={tmp_path}/r")[::2])
        assert "Unknown command line flag 'worksdir'" in line and "--helpshort" in line


class TestPathMistakes:
    def test_workdir_under_a_file(self, tmp_path):
        (tmp_path / "f").write_text("x")
        line = _fatal(*_script("train.py", CONFIG, f"--workdir={tmp_path}/f/run")[::2])
        assert f"--workdir='{tmp_path}/f/run' lies under {tmp_path}/f, a file" in line
        assert [p.name for p in tmp_path.iterdir()] == ["f"]

    def test_export_of_a_workdir_without_checkpoint_creates_nothing(self, tmp_path):
        (tmp_path / "run").mkdir()
        args = (CONFIG, f"--workdir={tmp_path}/run", f"--export_hf={tmp_path}/hf")
        line = _fatal(*_script("train.py", *args)[::2])
        assert f"no checkpoint in {tmp_path}/run" in line
        assert [p.name for p in tmp_path.iterdir()] == ["run"]
        assert list((tmp_path / "run").iterdir()) == []  # no checkpoints/, no export.log

    def test_export_path_under_a_file(self, tmp_path):
        (tmp_path / "f").write_text("x")
        (tmp_path / "run" / checkpoint.CKPT_DIR / "1").mkdir(parents=True)
        args = (CONFIG, f"--workdir={tmp_path}/run", f"--export_hf={tmp_path}/f/hf")
        line = _fatal(*_script("train.py", *args)[::2])
        assert f"--export_hf='{tmp_path}/f/hf' lies under {tmp_path}/f, a file" in line
        assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [checkpoint.CKPT_DIR]

    def test_missing_7b_weights_name_the_ways_forward(self, tmp_path):
        args = ("--config=configs/grpo_7b.py", f"--workdir={tmp_path}/run")
        rc, _, err = _script("train.py", *args, env={"HF_HOME": str(tmp_path / "hf")})
        line = _fatal(rc, err)
        assert "model.path 'deepseek-ai/DeepSeek-R1-Distill-Qwen-7B' is neither" in line
        for way in (
            "--config.model.path=",
            "--config=configs/grpo_7b.py:smoke",
            "--dry_run",
            "--config.model.init=random",
        ):
            assert way in line, (way, line)
        assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["train.log"]  # no claim
        assert "Traceback" in (tmp_path / "run" / "train.log").read_text()

    def test_evaluate_a_checkpoint_that_is_not_there_creates_nothing(self, tmp_path):
        args = (f"--config={REPO}/configs/eval.py:smoke", "--config.checkpoint=runs/nope/step_150")
        line = _fatal(*_script("evaluate.py", *args, cwd=tmp_path)[::2])
        assert "--config.checkpoint 'runs/nope/step_150' does not exist" in line
        assert "Hugging Face checkpoint folder" in line
        assert list(tmp_path.iterdir()) == []  # no runs/nope/step_150/eval/evaluate.log

    def test_serve_a_model_that_is_not_there(self, tmp_path):
        args = (f"--model={tmp_path}/nope", f"--log_file={tmp_path}/serve.log")
        line = _fatal(*_script("serve.py", *args)[::2])
        assert f"--model '{tmp_path}/nope' does not exist" in line


def _train_args(workdir, tiny, *extra):
    """scripts/train.py's arguments for 2 steps on the tiny checkpoint (train_script.train_cmd)."""
    return [*train_script.train_cmd(workdir, tiny, 2)[2:], *extra]


class TestFailedStart:
    def test_an_empty_data_file_claims_nothing(self, tmp_path, tiny_llama_dir):
        (tmp_path / "empty.jsonl").write_text("")
        args = _train_args(
            tmp_path / "run", tiny_llama_dir, f"--config.data.source={tmp_path}/empty.jsonl"
        )
        line = _fatal(*_script("train.py", *args)[::2])
        assert f"problem file {tmp_path}/empty.jsonl is empty" in line
        assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["train.log"]
        assert "DataFileError" in (tmp_path / "run" / "train.log").read_text()

    @pytest.mark.slow
    def test_corrected_start_then_bound_then_truncated_checkpoints(self, tmp_path, tiny_llama_dir):
        run = tmp_path / "run"
        (tmp_path / "empty.jsonl").write_text("")
        failed = _train_args(run, tiny_llama_dir, f"--config.data.source={tmp_path}/empty.jsonl")
        _fatal(*_script("train.py", *failed, "--config.optim.lr=0.002")[::2])
        # The corrected command (another config: data, lr) starts without --overwrite.
        rc, out, err = _script("train.py", *_train_args(run, tiny_llama_dir))
        assert rc == 0 and err == [], err[-20:]
        assert checkpoint.saved_steps(run) == [1, 2]
        # Having saved a step, the run refuses another config, and nothing changes.
        before = _tree(run)
        line = _fatal(
            *_script("train.py", *_train_args(run, tiny_llama_dir, "--config.optim.lr=0.002"))[::2]
        )
        assert "holds a run of another config, checkpointed at steps [1, 2]" in line
        assert "optim.lr: 0.001 -> 0.002" in line and "--overwrite" in line
        assert {k: v for k, v in _tree(run).items() if k != "train.log"} == {
            k: v for k, v in before.items() if k != "train.log"
        }
        # A truncated latest checkpoint: one warning line naming the step and the file.
        checkpoint_trees.CORRUPTIONS["data_truncated"](run / checkpoint.CKPT_DIR / "2")
        rc, out, err = _script("train.py", *_train_args(run, tiny_llama_dir))
        assert rc == 0 and len(err) == 1, err[-20:]
        assert "checkpoint step 2 is unreadable" in err[0] and "2/state/d/" in err[0], err
        assert "moved to" in err[0] and "resuming from step 1" in out
        # Every checkpoint unreadable: one FATAL line with advice; run.json left as it was.
        for step in checkpoint.saved_steps(run):
            checkpoint_trees.CORRUPTIONS["data_truncated"](run / checkpoint.CKPT_DIR / str(step))
        claimed = (run / workdir_guard.RUN_FILE).read_bytes()
        assert "resolved" in json.loads(claimed)
        line = _fatal(
            *_script("train.py", *_train_args(run, tiny_llama_dir, "--config.total_steps=3"))[::2]
        )
        assert f"no checkpoint in {run}/checkpoints could be restored (tried steps [2, 1]" in line
        assert "another --workdir" in line
        assert (run / workdir_guard.RUN_FILE).read_bytes() == claimed


class TestCheckpointReadNoise:
    def test_a_truncated_step_of_many_arrays_is_one_line(self, tmp_path):
        # 50 arrays: a failed read leaves dozens of TensorStore reads in flight, each reporting
        # 'RuntimeError: Event loop is closed' on stderr when it finishes (~100 lines unquieted).
        script = f"""
import pathlib
import sys
sys.path.insert(0, {str(REPO / "tests")!r})
import jax
from support import checkpoint_trees
from mmr_jax.training import checkpoint
tree = {{f"w{{i}}": jax.random.normal(jax.random.key(i), (256, 256)) for i in range(50)}}
ck = checkpoint.Checkpointer({str(tmp_path / "ck")!r}, keep=None, async_save=False)
ck.save(1, tree, {{"step": 1}})
ck.save(2, tree, {{"step": 2}})
ck.close()
checkpoint_trees.CORRUPTIONS["data_truncated"](pathlib.Path(str(ck.directory)) / "2")
ck = checkpoint.Checkpointer(ck.directory, keep=None, read_retry_s=())
_, meta = ck.restore(jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree))
ck.close()
print("restored", meta["step"])
"""
        out = subprocess.run(
            [sys.executable, "-c", script],
            cwd=REPO,
            env={**os.environ, "JAX_PLATFORMS": "cpu"},
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert out.returncode == 0 and out.stdout.strip() == "restored 1", out.stderr[-3000:]
        lines = out.stderr.splitlines()
        assert len(lines) == 1, lines[:20]
        assert "checkpoint step 2 is unreadable" in lines[0] and "2/state/d/" in lines[0]
        assert "Event loop" not in out.stderr and "tensorstore_spec" not in out.stderr


class TestEveryEntryPoint:
    """The other scripts answer a mistake the way train.py does: one FATAL line, nothing made."""

    def test_arithmetic_operators_outside_the_generator(self, tmp_path):
        args = (CONFIG, f"--workdir={tmp_path}/run", "--config.data.arithmetic_ops=x")
        line = _fatal(*_script("train.py", *args)[::2])
        assert "data.arithmetic_ops=('x',); expected operators among ('+', '-', '*')" in line
        assert """e.g. --config.data.arithmetic_ops="('+', '-')\"""" in line
        assert list(tmp_path.iterdir()) == []

    def test_a_tuple_typed_without_quotes(self, tmp_path):
        args = (CONFIG, f"--workdir={tmp_path}/run", "--config.data.arithmetic_ops=+,-")
        line = _fatal(*_script("train.py", *args)[::2])
        assert "data.arithmetic_ops takes a tuple" in line and "e.g. --config.data" in line
        assert list(tmp_path.iterdir()) == []

    def test_the_cpu_default_without_its_checkpoint_names_the_command_that_builds_it(
        self, tmp_path
    ):
        # Run from a folder without checkpoints/: the CPU default's model.path is relative.
        args = (f"--config={REPO}/configs/cpu_smollm2.py", f"--workdir={tmp_path}/run")
        line = _fatal(*_script("train.py", *args, cwd=tmp_path)[::2])
        assert "model.path 'checkpoints/smollm2-135m-instruct' does not exist" in line
        assert "build it with `python scripts/prepare_smollm2.py`" in line
        assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["train.log"]  # no claim

    def test_evaluate_a_folder_that_is_not_a_run(self, tmp_path):
        (tmp_path / "notarun").mkdir()
        args = (f"--config={REPO}/configs/eval.py:run", "--config.run_dir=notarun")
        line = _fatal(*_script("evaluate.py", *args, cwd=tmp_path)[::2])
        assert "notarun is not a training run (no run.json)" in line
        assert list((tmp_path / "notarun").iterdir()) == []  # no eval/evaluate.log

    def test_evaluate_without_the_benchmarks_creates_nothing(self, tmp_path):
        (tmp_path / "ckpt").mkdir()  # a folder: the data is checked before the model loads
        args = (
            f"--config={REPO}/configs/eval.py",
            "--config.checkpoint=ckpt",
            "--config.data_dir=nodata",
            "--config.output_dir=out",
        )
        line = _fatal(*_script("evaluate.py", *args, cwd=tmp_path)[::2])
        assert f"benchmark folder: {tmp_path}/nodata does not exist" in line
        assert "scripts/prepare_data.py" in line
        assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]  # no out/evaluate.log

    def test_plot_a_run_that_is_not_there(self, tmp_path):
        line = _fatal(*_script("plot_run.py", "runs/nope", f"--out={tmp_path}/x.png")[::2])
        assert "no metrics file at runs/nope; give a run folder" in line
        assert list(tmp_path.iterdir()) == []

    def test_plot_a_metric_the_run_did_not_log_names_those_it_did(self, tmp_path):
        (tmp_path / "metrics.jsonl").write_text('{"step": 1, "reward/mean": 0.5}\n')
        args = (tmp_path, "--metrics=rewrd/mean", f"--out={tmp_path}/x.png")
        line = _fatal(*_script("plot_run.py", *args)[::2])
        assert (
            "none of the metrics ['rewrd/mean'] is in the runs; they log: ['reward/mean']" in line
        )
        assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]

    @pytest.mark.parametrize(
        "args,want",
        [
            (("--config=configs/nope.py",), "config file 'configs/nope.py' not found"),
            (
                ("--config=configs/study.py", "--config.foldr=x"),
                "unknown config key 'foldr'",
            ),
            (
                ("--config=configs/study.py", "--config.folder={tmp}/f/study", "--report_only"),
                "--config.folder='{tmp}/f/study' lies under {tmp}/f, a file",
            ),
        ],
    )
    def test_study_mistakes(self, tmp_path, args, want):
        (tmp_path / "f").write_text("x")
        args = [a.format(tmp=tmp_path) for a in args]
        line = _fatal(*_script("study.py", *args)[::2])
        assert want.format(tmp=tmp_path) in line, line
        assert [p.name for p in tmp_path.iterdir()] == ["f"]

    def test_filter_prompts_checks_its_inputs_before_writing(self, tmp_path):
        args = (
            f"--checkpoint={tmp_path}/nope",
            f"--source={tmp_path}/nope.jsonl",
            f"--out={tmp_path}/out/kept.jsonl",
        )
        line = _fatal(*_script("filter_prompts.py", *args)[::2])
        assert f"problem file: {tmp_path}/nope.jsonl does not exist" in line
        assert list(tmp_path.iterdir()) == []  # no out/, no filter_prompts.log

    def test_filter_prompts_without_its_flags(self):
        line = _fatal(*_script("filter_prompts.py")[::2])
        assert "--checkpoint must have a value" in line and "--helpshort" in line

    def test_prepare_data_of_a_file_it_does_not_know(self, tmp_path):
        args = ("--files=eval/nope.jsonl", f"--out={tmp_path}/data")
        line = _fatal(*_script("prepare_data.py", *args)[::2])
        assert "unknown files ['eval/nope.jsonl']; known: ['eval/math500.jsonl'" in line
        assert list(tmp_path.iterdir()) == []

    def test_launch_vllm_without_a_config(self):
        line = _fatal(*_script("launch_vllm.py", "--dry_run")[::2])
        assert line == "FATAL: --config is required (--helpshort lists the flags)"
