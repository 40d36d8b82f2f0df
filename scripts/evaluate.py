"""pass@k evaluation of one checkpoint, or of every saved checkpoint of a run.

    python scripts/evaluate.py --config=configs/eval.py --config.checkpoint=runs/x/step_150
    python scripts/evaluate.py --config=configs/eval.py --config.run_dir=runs/x
    python scripts/evaluate.py --config=configs/eval.py --config.run_dir=runs/x --config.step=30
    python scripts/evaluate.py --config=configs/eval.py:run --config.run_dir=runs/cpu_smollm2

A run's checkpoints are its `step_N` Hugging Face exports when it wrote them
(`checkpoint.export_hf`), else its own Orbax checkpoints (`<run>/checkpoints/N`): each is
restored with the config the run was trained with (its run.json), LoRA merged, and exported to
a temporary folder for the evaluation (`training.hf_export`). `:run` evaluates on the run's own
evaluation problems and settings (its config's `eval` block: for the CPU default, held-out
arithmetic) and adds the initial weights as step 0, so the table shows before and after.

Prints a table (per benchmark and average); writes `eval.json` with per-problem records. With
`run_dir`: one JSON per step, `eval_summary.json` with the peak step, and `pass1_vs_step.png`.
Library logs go to `<output dir>/evaluate.log` (`--verbosity=0` shows them on the console too).
The checkpoint, run folder and output folder may be in a bucket (gs://, `infra.run_paths`): a
checkpoint is downloaded, a run's steps one at a time, and the outputs are written locally and
uploaded at the end.
The benchmarks are `<config.data_dir>/<name>.jsonl`; when they are missing it exits with one line
saying how to get them (`scripts/prepare_data.py` or the offline folder, docs/data.md).
With several processes (`--coordinator_address/--num_processes/--process_id` or
`--distributed=auto`, docs/multihost.md) each samples and grades its share of every prompt batch
with its own copy of the checkpoint (or its own vLLM server: `--config.url` may list one per
process); process 0 alone prints and writes.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import shutil
import sys
import tempfile

import jax
from absl import app, flags, logging
from ml_collections import config_flags

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from mmr_jax import distributed
from mmr_jax.config import command_line
from mmr_jax.infra import compile_cache, console, run_paths, user_errors
from mmr_jax.models import hub, sharding
from mmr_jax.problems import evaluation
from mmr_jax.rewards import grading
from mmr_jax.training import checkpoint, engines, hf_export, problem_sets

_CONFIG = config_flags.DEFINE_config_file("config", None, "Evaluation config.", lock_config=True)
_PROCESSES = distributed.define_flags()


def eval_settings(config, train_cfg) -> tuple[dict, dict]:
    """(problems by benchmark, `evaluation.evaluate` keyword arguments): the eval config's
    benchmarks and sampling, or with `source='run'` the run's own (`train_cfg.eval`)."""
    if config.source == "run":
        e = train_cfg.eval
        ks = tuple(k for k in (1, 2, 4, 8, 16, 32, 64) if k <= e.n)
        kwargs = dict(
            n=e.n, temperature=e.temperature, top_p=e.top_p, max_new_tokens=e.max_new_tokens,
            ks=ks, system_prompt=e.system_prompt or None, number_only=e.number_only,
        )  # fmt: skip
        return problem_sets.eval_problems(train_cfg), kwargs
    if config.source != "benchmarks":
        raise app.UsageError(f"--config.source={config.source!r}: expected 'benchmarks' or 'run'")
    problems = evaluation.load_benchmarks(
        config.data_dir, tuple(config.benchmarks), max_problems=config.max_problems
    )
    kwargs = dict(
        n=config.n, temperature=config.temperature, top_p=config.top_p,
        max_new_tokens=config.max_new_tokens, ks=tuple(config.ks),
        system_prompt=config.system_prompt or None,
    )  # fmt: skip
    return problems, kwargs


def evaluate_checkpoint(config, folder: str, problems, grader, settings) -> evaluation.EvalResult:
    tokenizer = hub.load_tokenizer(folder, "--config.checkpoint")
    return evaluation.evaluate(
        engines.checkpoint_engine(config.engine, folder, url=config.url, seed=config.seed),
        tokenizer,
        problems,
        seed=config.seed,
        prompt_batch_size=config.prompt_batch_size,
        grader=grader,
        keep_completions=config.keep_completions,
        **settings,
    )


def _check_inputs(config) -> None:
    if config.checkpoint and not run_paths.is_remote(config.checkpoint):
        hub.resolve_checkpoint(config.checkpoint, "--config.checkpoint")  # a hub id: fetched
    if config.run_dir and not run_paths.is_remote(config.run_dir):
        if not os.path.isdir(config.run_dir):
            raise user_errors.UserError(
                f"--config.run_dir={config.run_dir!r} is not a folder; give a run's folder"
            )


def run_checkpoints(config, local_run: str) -> list[tuple[int, object]]:
    """(step, HF folder path or Orbax step) of each checkpoint of `config.run_dir` to evaluate:
    its `step_N` exports when it has them (`local_run`: the run folder, or a bucket's stand-in,
    `run_paths.shadow_steps`), else its Orbax checkpoints; only `config.step` when set; with
    `config.with_base`, the initial weights as step 0."""
    exports = evaluation.find_checkpoints(local_run)
    found = exports or [(s, s) for s in checkpoint.saved_steps(config.run_dir)]
    if config.step:
        found = [(s, c) for s, c in found if s == config.step]
        if not found:
            steps = [s for s, _ in exports] + checkpoint.saved_steps(config.run_dir)
            raise app.UsageError(
                f"--config.step={config.step}: {config.run_dir} has no checkpoint of that step "
                f"(its steps: {sorted(set(steps)) or 'none'})"
            )
    if not found:
        raise user_errors.UserError(
            f"no checkpoint in {config.run_dir}: neither step_N exports nor Orbax checkpoints "
            f"under {os.path.join(config.run_dir, 'checkpoints')}/"
        )
    if config.with_base:
        found = [(0, None)] + found
    return found


@contextlib.contextmanager
def checkpoint_folder(config, train_cfg, step: int, source):
    """A HF folder of one checkpoint: an export's path as it is (a bucket's: fetched), the run's
    initial weights (`source` None), or an Orbax step exported to a temporary folder."""
    if source is None:
        yield hub.resolve_checkpoint(train_cfg.model.path)
    elif isinstance(source, str):
        yield run_paths.fill_step(source, config.run_dir)
        if run_paths.is_remote(config.run_dir):  # one step's weights on the disk at a time
            shutil.rmtree(source)
    else:
        if jax.process_count() > 1:
            raise app.UsageError(
                "a run's Orbax checkpoints are evaluated by one process; export them first "
                "(scripts/train.py --export_hf) or set checkpoint.export_hf in the run"
            )
        with tempfile.TemporaryDirectory(prefix="mmr_jax_eval_") as tmp:
            out = os.path.join(tmp, f"step_{step}")
            logging.info("exporting step %d of %s to %s", step, config.run_dir, out)
            yield hf_export.export_hf(train_cfg, config.run_dir, out, step=step)


def main(argv):
    del argv
    config = _CONFIG.value
    if config.engine == "embedded":  # Before any JAX operation.
        sharding.use_cpu_cores_as_devices(config.cpu_devices or None)
    distributed.start(_PROCESSES)
    primary = distributed.is_primary()
    if bool(config.checkpoint) == bool(config.run_dir):
        raise app.UsageError("set exactly one of --config.checkpoint and --config.run_dir")
    out_dir = config.output_dir or os.path.join(config.checkpoint or config.run_dir, "eval")
    for what, path in (("checkpoint", config.checkpoint), ("run_dir", config.run_dir)):
        run_paths.check(path or ".", f"--config.{what}")
    run_paths.check(out_dir, "--config.output_dir")
    _check_inputs(config)  # before anything is written: a wrong path creates no folder,
    # nor does a folder without run.json or missing benchmarks (one FATAL line each)
    train_cfg, local_run = None, None
    if config.run_dir:
        local_run = run_paths.shadow_steps(config.run_dir)  # a bucket's exports: step by step
        if config.source == "run" or config.with_base or not evaluation.find_checkpoints(local_run):
            train_cfg = hf_export.run_config(config.run_dir)
    elif config.source == "run":
        raise app.UsageError("--config.source=run needs --config.run_dir (the run's config)")
    problems, settings = eval_settings(config, train_cfg)  # a missing file: one FATAL line
    written = run_paths.open_run(out_dir).local  # out_dir itself, or a bucket's staging folder
    log_name = "evaluate.log" if primary else f"evaluate.process{jax.process_index()}.log"
    log_file = console.setup(os.path.join(out_dir, log_name), stdout=primary)
    logging.info("XLA compilation cache: %s", compile_cache.enable())
    console.info(
        "evaluate %s | %s | n=%d | engine %s | log %s",
        config.checkpoint or config.run_dir,
        ",".join(f"{name} ({len(p)})" for name, p in problems.items()),
        settings["n"],
        config.engine,
        log_file,
    )
    grader = grading.Grader(workers=config.grader_workers, timeout_s=config.grader_timeout_s)
    meta = dict(config=config.to_dict())
    try:
        if config.checkpoint:
            local = run_paths.fetched(config.checkpoint)  # a bucket's: downloaded
            result = evaluate_checkpoint(config, local, problems, grader, settings)
            if not primary:  # every process holds the whole result; process 0 writes it
                return
            print(evaluation.format_table(result))
            evaluation.write_json(result, os.path.join(written, "eval.json"), **meta)
            console.info("wrote %s", os.path.join(out_dir, "eval.json"))
            return

        def one(step, source):
            with checkpoint_folder(config, train_cfg, step, source) as folder:
                result = evaluate_checkpoint(config, folder, problems, grader, settings)
            if not primary:
                return result
            name = f"step_{step}"
            label = " (initial weights)" if source is None else ""
            print(f"== {name}{label}\n{evaluation.format_table(result)}", flush=True)
            evaluation.write_json(result, os.path.join(written, f"{name}.json"), **meta)
            return result

        checkpoints = run_checkpoints(config, local_run)
        results, peak = evaluation.evaluate_run(checkpoints, one)
        if not primary:
            return
        if len(results) > 1:
            evaluation.plot_curve(results, os.path.join(written, "pass1_vs_step.png"))
        summary = {str(s): {"average": r.average, **r.per_benchmark} for s, r in results}
        with open(os.path.join(written, "eval_summary.json"), "w") as f:
            json.dump(dict(peak_step=peak, steps=summary, **meta), f, indent=1)
        print(f"peak step {peak}: average pass@1 {100 * dict(results)[peak].average['pass@1']:.2f}")
    finally:
        grader.close()
        run_paths.open_run(out_dir).publish()  # a bucket gets the outputs and the log


if __name__ == "__main__":
    flags.mark_flag_as_required("config")
    user_errors.run(main, argv_checks=(command_line.check_argv,))
