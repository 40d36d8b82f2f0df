"""The training loop (docs/design.md, "One step").

    prompts -> rollout -> rewards -> embeddings (with DAPO's dynamic sampling) -> reweighting
    (none | mmr | dra) and advantages -> layout -> reference / old log-probs -> jitted update ->
    weight sync -> metrics -> checkpoint -> periodic evaluation

The host side of a step up to the update is `step.pipeline`, read top to bottom; which rollout
feeds a step (now, or prefetched while the previous one trained) is `rollout_schedule`'s. Side
effects (engines, files, clocks, logging) live here; the math lives in `algorithms` and
`step.train_step`. How a run ends (its named errors, its close) is `shutdown`'s; its HF exports
are `hf_export`'s. Entry points: `train(cfg, workdir)`, `compiled_dry_run.dry_run(cfg)`.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from typing import Any

import jax
from absl import logging

from mmr_jax import distributed
from mmr_jax.config import checks, schema
from mmr_jax.infra import compile_stats, console, faults, metrics, run_paths
from mmr_jax.problems import data
from mmr_jax.rollout import prefetch
from mmr_jax.step import pipeline, shape_reuse, train_step
from mmr_jax.training import (
    build,
    checkpoint,
    hf_export,
    problem_sets,
    rollout_schedule,
    shutdown,
    workdir_guard,
)


class NonFiniteLossError(FloatingPointError):
    """The loss became NaN or inf; the run stops, its last good checkpoint untouched."""


@dataclasses.dataclass(frozen=True)
class Run:
    """Everything a running training job holds (its state, the one part that changes, is kept by
    the loop and `save`)."""

    cfg: schema.TrainConfig
    workdir: str
    tokenizer: Any
    prompts: data.PromptIterator  # yields (prompt ids, answer) pairs
    policy: build.Policy
    ref_params: Any  # full fine-tune with beta > 0: the initial weights; else None
    engine: Any
    rollouts: rollout_schedule.OnPolicyRollouts | rollout_schedule.OffPolicyRollouts
    step_fn: Any  # the jitted update (`train_step.jit_train_step`)
    checkpointer: checkpoint.Checkpointer
    writer: metrics.MetricWriter
    lengths: shape_reuse.LengthChooser | None  # packed steps, batch.reuse_compiled_lengths
    mesh: Any  # the global mesh: the step's batch is split over its (data, fsdp) axes


def setup(
    cfg: schema.TrainConfig, workdir, *, overwrite: bool = False
) -> tuple[Run, train_step.TrainState]:
    """Builds the run and its state, resuming from the latest checkpoint in `workdir`."""
    from mmr_jax.step import embeddings

    run_paths.check(workdir)  # on every process, before any collective
    distributed.check_same_config(cfg.to_dict())  # before anything is built or written
    distributed.check_batch_split(cfg.batch.prompts)
    checks.check_processes(cfg, jax.process_count())
    prepare = lambda: workdir_guard.prepare_workdir(workdir, cfg.to_dict(), overwrite=overwrite)
    workdir = os.fspath(distributed.primary_first(prepare, "to prepare the workdir") or workdir)
    tokenizer = build.load_tokenizer(cfg)  # model.init=random: built in memory, no download
    prompt_ids, answers, prompts_dropped = problem_sets.load_prompts(cfg, tokenizer)
    prompts = data.PromptIterator(
        list(zip(prompt_ids, answers, strict=True)), cfg.batch.prompts, cfg.seed
    )
    mesh = build.make_mesh(cfg)
    policy = build.load_policy(cfg, mesh)
    optimizer, schedule = build.make_optimizer(cfg)
    state = build.init_state(cfg, policy.params, optimizer, mesh)
    ref_params = None
    if cfg.loss.beta > 0 and not policy.lora:
        ref_params = jax.tree.map(lambda x: x.copy(), policy.params)  # the donated state moves on
    ckpt = checkpoint.Checkpointer(
        os.path.join(workdir, checkpoint.CKPT_DIR),
        keep=cfg.checkpoint.keep,
        keep_period=cfg.checkpoint.keep_period,
    )
    state, resume_step, lengths_state = _restore(ckpt, state, prompts)
    _header(cfg, workdir, resume_step, policy.attention)
    if resume_step is not None and cfg.checkpoint.export_hf:
        hf_export.export_if_missing(cfg, policy, state, workdir, resume_step)
    # A vLLM server's sync folder and log stay local: a bucket workdir's staging folder.
    engine = build.make_engine(cfg, policy, tokenizer, run_paths.open_run(workdir).local, mesh)
    engine.sync_weights(policy.model(state.params), version=int(state.step))
    encoder = None
    if cfg.reweight.method != "none":
        encoder = embeddings.make_encoder(
            cfg.reweight.embedding_model,
            max_length=cfg.reweight.embedding_max_length,
            batch_size=cfg.reweight.embedding_batch_size,
        )
    rollouts = rollout_schedule.make(
        cfg,
        prompts=prompts,
        engine=engine,
        tokenizer=tokenizer,
        encoder=encoder,
        prompts_dropped=prompts_dropped,
        params=state.params,
        model=policy.model,
        version=int(state.step),
    )
    step_fn = train_step.jit_train_step(
        graphdef=build.train_graphdef(cfg, policy),
        optimizer=optimizer,
        schedule=schedule,
        cfg=build.step_config(cfg),
    )
    writer = (
        metrics.MetricWriter(
            workdir, tensorboard=cfg.logging.tensorboard, resume_step=resume_step or 0
        )
        if distributed.is_primary()
        else metrics.NullWriter()
    )
    lengths = None
    if pipeline.layout(cfg) == "packed" and cfg.batch.compile_price_steps > 0:
        lengths = shape_reuse.LengthChooser.from_state(lengths_state, cfg.batch.compile_price_steps)
    if jax.process_index() == 0:  # started: the workdir is this run's (a failed start claims none)
        workdir_guard.claim(workdir, cfg.to_dict(), attention_impl=policy.attention)
    run = Run(
        cfg=cfg,
        workdir=workdir,
        tokenizer=tokenizer,
        prompts=prompts,
        policy=policy,
        ref_params=ref_params,
        engine=engine,
        rollouts=rollouts,
        step_fn=step_fn,
        checkpointer=ckpt,
        writer=writer,
        lengths=lengths,
        mesh=mesh,
    )
    return run, state


def _restore(ckpt: checkpoint.Checkpointer, state: train_step.TrainState, prompts):
    """(state, resumed step or None, the packed lengths' state) from the latest checkpoint."""
    restored = ckpt.restore(checkpoint.state_tree(state))
    if restored is None:
        return state, None, None
    tree, meta = restored
    prompts.restore(meta["data"])
    # "packed_lengths" is absent in checkpoints written before shape_reuse.
    return train_step.TrainState(**tree), int(meta["step"]), meta.get("packed_lengths")


def _header(cfg: schema.TrainConfig, workdir: str, resume_step, attention) -> None:
    from mmr_jax.training import method_line

    devices = jax.devices()
    console.info(
        "%s | %s | attention %s | %d process(es), %d %s device(s) | workdir %s | %s",
        cfg.name,
        build.weights_note(cfg),
        attention.implementation if attention is not None else cfg.model.attention_impl,
        jax.process_count(),
        len(devices),
        devices[0].platform,
        workdir,
        f"resuming from step {resume_step}" if resume_step is not None else "new run",
    )
    console.info("method: %s", method_line.method_line(cfg))
    if distributed.is_primary():
        for line in checks.advisories(cfg):
            logging.warning("config: %s", line)


def fetch_finite(step: int, device_metrics: dict, workdir: str, last_saved) -> dict:
    """A step's metrics on the host; `NonFiniteLossError` when its loss or gradient is inf/NaN."""
    host = {k: float(v) for k, v in jax.device_get(device_metrics).items()}
    if not math.isfinite(host.get("loss", 0.0)) or not math.isfinite(host.get("grad_norm", 0.0)):
        raise NonFiniteLossError(
            f"step {step}: non-finite loss {host.get('loss')} (grad norm {host.get('grad_norm')}); "
            f"stopping. The last good checkpoint (step {last_saved}) in {workdir} is intact; lower "
            f"optim.lr or check the rewards and data, then resume from it."
        )
    return host


def write_metrics(run: Run, step: int, values: dict, progress: metrics.Progress) -> None:
    """Writes a step's metrics (every `logging.every` steps) and prints its progress line."""
    if metrics.Periodic(run.cfg.logging.every, last=run.cfg.total_steps)(step):
        values = distributed.reduce_metrics(values)  # on every process: a collective
        run.writer.write(step, values)
        console.info("%s", progress.line(step, values))


def save(run: Run, state: train_step.TrainState, step: int) -> None:
    """Checkpoints `state` after `step` with the data position a resume continues from."""
    meta = {"step": step, "data": run.rollouts.data_state}  # off-policy: before the prefetched
    if run.lengths is not None:  # a resume makes the same length choices (shape_reuse)
        meta["packed_lengths"] = run.lengths.state()
    run_paths.mirror(run.workdir)  # a bucket's metrics reach this step before its checkpoint
    run.checkpointer.save(step, checkpoint.state_tree(state), meta)
    faults.point("checkpoint", step)
    console.info("checkpoint step %d -> %s", step, run.checkpointer.directory / str(step))
    if run.cfg.checkpoint.export_hf:
        run.checkpointer.wait()
        out = os.path.join(run.workdir, f"step_{step}")
        hf_export.export(run.cfg, run.policy.model(state.params), out, step)
        console.info("exported step %d -> %s", step, out)


def evaluate(run: Run, step: int) -> dict[str, float]:
    """The `eval` block's benchmarks sampled by the run's engine (its weights after `step`)."""
    from mmr_jax.problems import evaluation

    e = run.cfg.eval
    t0 = time.perf_counter()
    problems = problem_sets.eval_problems(run.cfg)
    result = evaluation.evaluate(
        run.engine,
        run.tokenizer,
        problems,
        n=e.n,
        temperature=e.temperature,
        top_p=e.top_p,
        max_new_tokens=e.max_new_tokens,
        system_prompt=e.system_prompt,
        seed=run.cfg.seed + step,
        number_only=e.number_only,
    )
    out = {f"eval/{b}/{k}": v for b, m in result.per_benchmark.items() for k, v in m.items()}
    out.update({f"eval/average/{k}": v for k, v in result.average.items()})
    out["time/eval"] = time.perf_counter() - t0  # part of time/step; a study subtracts it
    scores = " ".join(f"{k[len('eval/') :]}={v:.3f}" for k, v in out.items() if k != "time/eval")
    console.info("eval step %d: %s", step, scores)
    return out


def sync_engine(run: Run, state: train_step.TrainState, step: int, timings: dict) -> None:
    """Hands the engine the weights after `step` (off-policy: once its rollout in flight ends,
    a copy of its own, which outlives the next update's donation)."""
    t0, params = time.perf_counter(), state.params
    if run.rollouts.lag:
        run.rollouts.wait(timings)
        t0, params = time.perf_counter(), prefetch.own(run.engine, params)
    run.engine.sync_weights(run.policy.model(params), version=step)
    timings["sync"] = time.perf_counter() - t0


def step_timings(info: dict, timings: dict, t_step: float) -> None:
    """Adds the step's clocks to its metrics: the phases, compilation, the whole step."""
    info.update({f"time/{k}": v for k, v in timings.items()})
    info["time/compile"] = compile_stats.CLOCK.lap()["total"]  # part of time/step
    info["time/step"] = time.perf_counter() - t_step
    info["throughput/tokens_per_s"] = info["throughput/tokens"] / info["time/step"]


def train(cfg: schema.TrainConfig, workdir, *, overwrite: bool = False) -> dict[str, float]:
    """Trains to `cfg.total_steps`, resuming from `workdir`; returns the last step's metrics.

    A step's metrics are fetched while the next step's update runs (the device is not stalled);
    a step that checkpoints or evaluates fetches its own first, so that only a finite state is
    saved, and writes them before its checkpoint (a resume truncates metrics.jsonl to it).
    """
    run, state = setup(cfg, workdir, overwrite=overwrite)
    start = int(state.step)
    save_now = metrics.Periodic(
        cfg.checkpoint.every, last=cfg.total_steps, at_last=cfg.checkpoint.at_end
    )
    eval_now = metrics.Periodic(cfg.eval.every, last=cfg.total_steps, at_last=cfg.eval.every > 0)
    progress = metrics.Progress(cfg.total_steps, start)
    pending, last_saved, host = None, start or None, {}
    try:
        if start == 0 and cfg.eval.at_start and cfg.eval.every > 0:  # the base model's accuracy
            run.writer.write(0, evaluate(run, 0))
            progress = metrics.Progress(cfg.total_steps, start)  # the ETA counts steps only
        compile_stats.CLOCK.start().lap()  # from here, each step's compilation
        for step in range(start + 1, cfg.total_steps + 1):
            t_step, timings = time.perf_counter(), {}
            # step's groups (off-policy: sampled while step - 1 trained; step + 1's rollout starts)
            groups, info = run.rollouts.groups(step, step - 1, timings)
            batch, batch_info = pipeline.make_batch(
                cfg,
                groups,
                policy=run.policy,
                params=state.params,
                ref_params=run.ref_params,
                pad_id=getattr(run.engine, "pad_id", 0),
                timings=timings,
                packed_length=None if run.lengths is None else run.lengths.choose,
                mesh=run.mesh,
            )
            info.update(batch_info)
            t0 = time.perf_counter()
            state, device_metrics = run.step_fn(state, batch, run.policy.frozen, run.policy.rest)
            faults.point("train", step)
            if pending is not None:  # the previous step's metrics, fetched while this one runs
                host = fetch_finite(pending[0], pending[1], run.workdir, last_saved)
                write_metrics(run, pending[0], {**pending[2], **host}, progress)
                pending = None
            jax.block_until_ready(state.step)  # so that time/train is the update's own time
            timings["train"] = time.perf_counter() - t0
            sync_engine(run, state, step, timings)
            if jax.process_count() > 1:  # rollout gathers and weight copies of this step
                timings["collectives"] = distributed.collective_seconds()
            for text in groups.texts[0][: cfg.logging.samples]:
                logging.info("step %d sample: %r", step, text[:300])
            pending = (step, device_metrics, info)
            if save_now(step) or eval_now(step):  # a checkpoint only of a finite state
                host = fetch_finite(step, device_metrics, run.workdir, last_saved)
            if eval_now(step):
                info.update(evaluate(run, step))
            step_timings(info, timings, t_step)
            if save_now(step):
                host = {**info, **host}
                write_metrics(run, step, host, progress)
                pending = None
                save(run, state, step)
                last_saved = step
        if pending is not None:
            host = fetch_finite(pending[0], pending[1], run.workdir, last_saved)
            write_metrics(run, pending[0], {**pending[2], **host}, progress)
            host = {**pending[2], **host}
    except Exception as e:  # a full disk, a dead peer process: a named error (shutdown)
        named = shutdown.named_error(e, run.workdir, last_saved)
        if named is None:
            raise
        raise named from e
    finally:
        shutdown.close(run)
    return host
