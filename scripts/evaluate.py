"""pass@k evaluation of one checkpoint, or of every saved checkpoint of a run.

    python scripts/evaluate.py --config=configs/eval.py --config.checkpoint=runs/x/step_150
    python scripts/evaluate.py --config=configs/eval.py --config.run_dir=runs/x

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

import json
import os
import pathlib
import shutil
import sys

import jax
from absl import app, flags, logging
from ml_collections import config_flags

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from mmr_jax import distributed
from mmr_jax.config import config_overrides
from mmr_jax.infra import compile_cache, console, run_paths, user_errors
from mmr_jax.models import hub, sharding
from mmr_jax.problems import data, evaluation
from mmr_jax.rewards import grading

_CONFIG = config_flags.DEFINE_config_file("config", None, "Evaluation config.", lock_config=True)
_PROCESSES = distributed.define_flags()


def make_engine(config, checkpoint: str):
    """The rollout engine that samples from `checkpoint`.

    'embedded': the JAX sampler on the checkpoint (EOS ids from its generation config),
    data-parallel over the default devices when there are several (CPU: `config.cpu_devices`).
    'vllm': a server at `config.url` that already serves `checkpoint` under that name (one server
    per checkpoint, so a run sweep with vLLM needs the server restarted between steps); with
    several processes, `config.url` may list one server per process (`distributed.rollout_url`).
    With several processes each samples its share of every prompt batch (`ShareEngine`).
    """
    if config.engine == "embedded":
        from mmr_jax.rollout import embedded

        mesh = sharding.data_parallel_mesh(jax.local_devices())  # this process's devices
        engine = embedded.EmbeddedEngine.from_pretrained(
            checkpoint, seed=config.seed, mesh=mesh if mesh.size > 1 else None
        )
    elif config.engine == "vllm":
        from mmr_jax.rollout import vllm_engine

        url = distributed.rollout_url(config.url, jax.process_count(), jax.process_index())
        engine = vllm_engine.VllmEngine(url, model=checkpoint)
    else:
        raise ValueError(f"unknown engine {config.engine!r}; expected 'embedded' or 'vllm'")
    return distributed.ShareEngine(engine) if jax.process_count() > 1 else engine


def evaluate_checkpoint(config, checkpoint: str, problems, grader) -> evaluation.EvalResult:
    tokenizer = hub.load_tokenizer(checkpoint, "--config.checkpoint")
    return evaluation.evaluate(
        make_engine(config, checkpoint),
        tokenizer,
        problems,
        n=config.n,
        temperature=config.temperature,
        top_p=config.top_p,
        max_new_tokens=config.max_new_tokens,
        ks=tuple(config.ks),
        system_prompt=config.system_prompt or None,
        seed=config.seed,
        prompt_batch_size=config.prompt_batch_size,
        grader=grader,
        keep_completions=config.keep_completions,
    )


def _check_inputs(config) -> None:
    if config.checkpoint and not run_paths.is_remote(config.checkpoint):
        hub.resolve_checkpoint(config.checkpoint, "--config.checkpoint")  # a hub id: fetched
    if config.run_dir and not run_paths.is_remote(config.run_dir):
        if not os.path.isdir(config.run_dir):
            raise user_errors.UserError(
                f"--config.run_dir={config.run_dir!r} is not a folder; give a run's folder"
            )


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
    _check_inputs(config)  # before anything is written: a wrong path creates no folder
    written = run_paths.open_run(out_dir).local  # out_dir itself, or a bucket's staging folder
    log_name = "evaluate.log" if primary else f"evaluate.process{jax.process_index()}.log"
    log_file = console.setup(os.path.join(out_dir, log_name), stdout=primary)
    logging.info("XLA compilation cache: %s", compile_cache.enable())
    console.info(
        "evaluate %s | %s | n=%d | engine %s | log %s",
        config.checkpoint or config.run_dir,
        ",".join(config.benchmarks),
        config.n,
        config.engine,
        log_file,
    )
    try:
        problems = evaluation.load_benchmarks(
            config.data_dir, tuple(config.benchmarks), max_problems=config.max_problems
        )
    except data.DataNotFoundError as e:  # one line saying what is missing and how to get it
        sys.exit(f"evaluate: {e}")
    grader = grading.Grader(workers=config.grader_workers, timeout_s=config.grader_timeout_s)
    meta = dict(config=config.to_dict())
    try:
        if config.checkpoint:
            local = run_paths.fetched(config.checkpoint)  # a bucket's: downloaded
            result = evaluate_checkpoint(config, local, problems, grader)
            if not primary:  # every process holds the whole result; process 0 writes it
                return
            print(evaluation.format_table(result))
            evaluation.write_json(result, os.path.join(written, "eval.json"), **meta)
            console.info("wrote %s", os.path.join(out_dir, "eval.json"))
            return

        def one(path):
            result = evaluate_checkpoint(
                config, run_paths.fill_step(path, config.run_dir), problems, grader
            )
            if run_paths.is_remote(config.run_dir):  # one step's weights on the disk at a time
                shutil.rmtree(path)
            if not primary:
                return result
            name = os.path.basename(path)
            print(f"== {name}\n{evaluation.format_table(result)}", flush=True)
            evaluation.write_json(result, os.path.join(written, f"{name}.json"), **meta)
            return result

        run_dir = run_paths.shadow_steps(config.run_dir)  # a bucket's: fetched step by step
        results, peak = evaluation.evaluate_run(run_dir, one)
        if not primary:
            return
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
    user_errors.run(main, argv_checks=(config_overrides.check_argv,))
