"""The training loop (DESIGN.md, "One training step, as data").

    prompts -> rollout -> decode -> rewards -> embeddings -> reweighting (mmr | dra | none) and
    advantages -> DAPO dynamic sampling -> ref / old log-probs -> jitted update -> weight sync ->
    metrics -> checkpoint -> periodic evaluation

Side effects (engines, files, clocks, logging) live here; the math lives in `mmr`, `advantages`,
`losses` and `train_step`. How a run ends (its named errors, its close) is `run_end`'s; its HF
exports are `run_export`'s. Entry points: `train(cfg, workdir)`,
`compiled_dry_run.dry_run(cfg)`, `export_hf`
(`run_export.export_hf`, kept here as the trainer's API).
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
from mmr_jax.config import config_checks, config_types
from mmr_jax.infra import compile_stats, console, faults, metrics, run_paths
from mmr_jax.models import sharding
from mmr_jax.problems import data
from mmr_jax.rollout import prefetch as rollout_prefetch
from mmr_jax.step import experience, shape_reuse, step_batch, step_loss, train_step
from mmr_jax.training import build, checkpoint, run_data, run_end, run_export, run_guard


class NonFiniteLossError(FloatingPointError):
    """The loss became NaN or inf; the run stops, its last good checkpoint untouched."""


export_hf = run_export.export_hf  # the trainer's API (scripts/train.py --export_hf)


@dataclasses.dataclass
class Run:
    """Everything a running training job holds."""

    cfg: config_types.TrainConfig
    workdir: str
    tokenizer: Any
    prompts: data.PromptIterator  # yields (prompt ids, answer) pairs
    policy: build.Policy
    state: train_step.TrainState
    ref_params: Any  # full fine-tune with beta > 0: the initial weights; else None
    engine: Any
    encoder: Any
    step_fn: Any
    logp_fn: Any
    checkpointer: checkpoint.Checkpointer
    writer: metrics.MetricWriter
    prompts_dropped: int = 0  # training problems over batch.max_prompt_len (run_data.load_prompts)
    lengths: shape_reuse.LengthChooser | None = None  # packed steps, batch.reuse_compiled_lengths
    mesh: Any = None  # the global mesh: the step's batch is split over its (data, fsdp) axes
    prefetch: rollout_prefetch.OffPolicyRollouts | None = None  # rollout.off_policy_lag=1


def setup(cfg: config_types.TrainConfig, workdir, *, overwrite: bool = False) -> Run:
    """Builds the run, resuming from the latest checkpoint in `workdir` when there is one."""
    from mmr_jax.step import embeddings

    run_paths.check(workdir)  # on every process, before any collective
    distributed.check_same_config(cfg.to_dict())  # before anything is built or written
    distributed.check_batch_split(cfg.batch.prompts)
    prepare = lambda: run_guard.prepare_workdir(workdir, cfg.to_dict(), overwrite=overwrite)
    workdir = os.fspath(distributed.primary_first(prepare, "to prepare the workdir") or workdir)
    tokenizer = build.load_tokenizer(cfg)  # model.init=random: built in memory, no download
    prompt_ids, answers, prompts_dropped = run_data.load_prompts(cfg, tokenizer)
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
    restored = ckpt.restore(checkpoint.state_tree(state))
    resume_step, lengths_state = None, None
    if restored is not None:
        tree, meta = restored
        state = train_step.TrainState(**tree)
        prompts.restore(meta["data"])
        resume_step = int(meta["step"])
        lengths_state = meta.get("packed_lengths")  # absent in checkpoints before shape_reuse
    _header(cfg, workdir, resume_step, policy.attention)
    if resume_step is not None and cfg.checkpoint.export_hf:
        run_export.export_if_missing(cfg, policy, state, workdir, resume_step)
    # A vLLM server's sync folder and log stay local: a bucket workdir's staging folder.
    engine = _make_engine(cfg, policy, tokenizer, run_paths.open_run(workdir).local, mesh)
    engine.sync_weights(policy.model(state.params), version=int(state.step))
    encoder = None
    if cfg.reweighting != "none":
        encoder = embeddings.make_encoder(
            cfg.mmr.embedding_model,
            max_length=cfg.mmr.embedding_max_length,
            batch_size=cfg.mmr.embedding_batch_size,
        )
    step_fn = train_step.jit_train_step(
        graphdef=build.train_graphdef(cfg, policy),
        optimizer=optimizer,
        schedule=schedule,
        cfg=build.step_config(cfg),
    )
    logp_fn = jax.jit(
        step_loss.logprobs_fn,
        static_argnames=(
            "graphdef",
            "num_completion",
            "temperature",
            "chunk",
            "disable_lora",
            "minibatches",
        ),
    )  # prompt_tokens / prompt_mask / packed (shared-prompt layouts): traced keyword arguments
    writer = (
        metrics.MetricWriter(
            workdir, tensorboard=cfg.logging.tensorboard, resume_step=resume_step or 0
        )
        if distributed.is_primary()
        else metrics.NullWriter()
    )
    if jax.process_index() == 0:  # started: the workdir is this run's (a failed start claims none)
        run_guard.claim(workdir, cfg.to_dict(), attention_impl=policy.attention)
    return Run(
        cfg,
        workdir,
        tokenizer,
        prompts,
        policy,
        state,
        ref_params,
        engine,
        encoder,
        step_fn,
        logp_fn,
        ckpt,
        writer,
        prompts_dropped=prompts_dropped,
        lengths=(
            shape_reuse.LengthChooser.from_state(lengths_state, cfg.batch.compile_price_steps)
            if step_batch.layout(cfg) == "packed" and cfg.batch.compile_price_steps > 0
            else None
        ),
        mesh=mesh,
    )


def _make_engine(cfg: config_types.TrainConfig, policy, tokenizer, workdir, mesh):
    """The rollout engine; with several processes, one per process over its share of the prompts
    (`distributed.ShareEngine`), holding whole weights of its own."""
    if jax.process_count() == 1:
        return build.make_engine(cfg, policy, tokenizer, workdir, mesh)
    share = cfg.batch.prompts // jax.process_count()
    local_cfg = dataclasses.replace(cfg, batch=dataclasses.replace(cfg.batch, prompts=share))
    local = dataclasses.replace(
        policy,
        params=distributed.local_copy(policy.params),
        frozen=distributed.local_copy(policy.frozen),
        rest=distributed.local_copy(policy.rest),
    )
    devices = jax.local_devices()
    local_mesh = sharding.data_parallel_mesh(devices) if len(devices) > 1 else None
    engine = build.make_engine(local_cfg, local, tokenizer, workdir, local_mesh)
    return distributed.ShareEngine(engine)


def _header(cfg: config_types.TrainConfig, workdir: str, resume_step, attention) -> None:
    from mmr_jax.training import run_header

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
    console.info("method: %s", run_header.method_line(cfg))
    if distributed.is_primary():
        for line in config_checks.advisories(cfg):
            logging.warning("config: %s", line)


def collect(run: Run, step: int, timings: dict) -> tuple[experience.Groups, dict]:
    """B groups for `step` (`step_batch.collect`) and their metrics."""
    groups, info = step_batch.collect(
        run.cfg, run.prompts, run.engine, run.tokenizer, run.encoder, step, timings
    )
    info["data/prompts_dropped"] = float(run.prompts_dropped)
    return groups, info


def make_batch(run: Run, groups: experience.Groups, timings: dict) -> tuple[train_step.Batch, dict]:
    """The step's device batch and its metrics (`step_batch.make_batch`)."""
    return step_batch.make_batch(
        run.cfg,
        groups,
        policy=run.policy,
        params=run.state.params,
        ref_params=run.ref_params,
        logp_fn=run.logp_fn,
        pad_id=getattr(run.engine, "pad_id", 0),
        timings=timings,
        packed_length=None if run.lengths is None else run.lengths.choose,
        mesh=run.mesh,
    )


def _check_finite(step: int, device_metrics: dict, workdir: str, last_saved) -> dict:
    host = {k: float(v) for k, v in jax.device_get(device_metrics).items()}
    if not math.isfinite(host.get("loss", 0.0)) or not math.isfinite(host.get("grad_norm", 0.0)):
        raise NonFiniteLossError(
            f"step {step}: non-finite loss {host.get('loss')} (grad norm {host.get('grad_norm')}); "
            f"stopping. The last good checkpoint (step {last_saved}) in {workdir} is intact; lower "
            f"optim.lr or check the rewards and data, then resume from it."
        )
    return host


def _log(run: Run, step: int, host: dict, progress: metrics.Progress) -> None:
    if metrics.Periodic(run.cfg.logging.every, last=run.cfg.total_steps)(step):
        host = distributed.reduce_metrics(host)  # on every process: a collective
        run.writer.write(step, host)
        console.info("%s", progress.line(step, host))


def save(run: Run, step: int) -> None:
    # Off-policy: the position before the prefetched step's prompts (a resume samples it again).
    data_state = run.prompts.state() if run.prefetch is None else run.prefetch.data_state
    meta = {"step": step, "data": data_state}
    if run.lengths is not None:  # a resume makes the same length choices (shape_reuse)
        meta["packed_lengths"] = run.lengths.state()
    run_paths.mirror(run.workdir)  # a bucket's metrics reach this step before its checkpoint
    run.checkpointer.save(step, checkpoint.state_tree(run.state), meta)
    faults.point("checkpoint", step)
    console.info("checkpoint step %d -> %s", step, run.checkpointer.directory / str(step))
    if run.cfg.checkpoint.export_hf:
        run.checkpointer.wait()
        out = os.path.join(run.workdir, f"step_{step}")
        run_export.export(run.cfg, run.policy.model(run.state.params), out, step)
        console.info("exported step %d -> %s", step, out)


def evaluate(run: Run, step: int) -> dict[str, float]:
    from mmr_jax.problems import evaluation

    e = run.cfg.eval
    t0 = time.perf_counter()
    problems = run_data.eval_problems(run.cfg)
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
    return out


def train(cfg: config_types.TrainConfig, workdir, *, overwrite: bool = False) -> dict[str, float]:
    """Trains to `cfg.total_steps`, resuming from `workdir`; returns the last step's metrics."""
    run = setup(cfg, workdir, overwrite=overwrite)
    start = int(run.state.step)
    run.prefetch = rollout_prefetch.for_run(run, collect)  # rollout.off_policy_lag=1
    save_now = metrics.Periodic(
        cfg.checkpoint.every, last=cfg.total_steps, at_last=cfg.checkpoint.at_end
    )
    eval_now = metrics.Periodic(cfg.eval.every, last=cfg.total_steps, at_last=cfg.eval.every > 0)
    progress = metrics.Progress(cfg.total_steps, start)
    pending, last_saved, host = None, start or None, {}
    try:
        if start == 0 and cfg.eval.at_start and cfg.eval.every > 0:  # the base model's accuracy
            run.writer.write(0, scores := evaluate(run, 0))
            _log_eval(0, scores)
            progress = metrics.Progress(cfg.total_steps, start)  # the ETA counts steps only
        compile_stats.CLOCK.start().lap()  # from here, each step's compilation
        for step in range(start + 1, cfg.total_steps + 1):
            t_step, timings = time.perf_counter(), {}
            if run.prefetch is None:
                groups, info = collect(run, step, timings)
            else:  # step's groups (sampled while step - 1 trained); step + 1's rollout starts
                groups, info = run.prefetch.groups(step, step - 1, timings)
            batch, batch_info = make_batch(run, groups, timings)
            info.update(batch_info)
            t0 = time.perf_counter()
            run.state, device_metrics = run.step_fn(
                run.state, batch, run.policy.frozen, run.policy.rest
            )
            faults.point("train", step)
            if pending is not None:  # the previous step's metrics, fetched while this one runs
                host = _check_finite(pending[0], pending[1], run.workdir, last_saved)
                _log(run, pending[0], {**pending[2], **host}, progress)
                pending = None
            jax.block_until_ready(run.state.step)  # so that time/train is the update's own time
            t1 = time.perf_counter()
            params, t_sync = run.state.params, t1
            if run.prefetch is not None:  # the engine is free; its weights outlive a donation
                run.prefetch.wait(timings)
                t_sync, params = time.perf_counter(), rollout_prefetch.own(run.engine, params)
            run.engine.sync_weights(run.policy.model(params), version=step)
            timings["sync"] = time.perf_counter() - t_sync
            if jax.process_count() > 1:  # rollout gathers and weight copies of this step
                timings["collectives"] = distributed.collective_seconds()
            timings["train"] = t1 - t0
            if cfg.logging.samples:
                for text in groups.texts[0][: cfg.logging.samples]:
                    logging.info("step %d sample: %r", step, text[:300])
            pending = (step, device_metrics, info)
            if save_now(step) or eval_now(step):  # a checkpoint only of a finite state
                host = _check_finite(step, device_metrics, run.workdir, last_saved)
            if eval_now(step):
                info.update(evaluate(run, step))
                _log_eval(step, info)
            info.update({f"time/{k}": v for k, v in timings.items()})
            info["time/compile"] = compile_stats.CLOCK.lap()["total"]  # part of time/step
            info["time/step"] = time.perf_counter() - t_step
            info["throughput/tokens_per_s"] = info["throughput/tokens"] / info["time/step"]
            if save_now(step):
                # This step's metrics go out before its checkpoint: a resume from this checkpoint
                # truncates metrics.jsonl to it, so a line still pending here would be lost.
                host = {**info, **host}
                _log(run, step, host, progress)
                pending = None
                save(run, step)
                last_saved = step
        if pending is not None:
            host = _check_finite(pending[0], pending[1], run.workdir, last_saved)
            _log(run, pending[0], {**pending[2], **host}, progress)
            host = {**pending[2], **host}
    except Exception as e:  # a full disk, a dead peer process: a named error (run_end)
        named = run_end.named_error(e, run.workdir, last_saved)
        if named is None:
            raise
        raise named from e
    finally:
        run_end.close(run)
    return host


def _log_eval(step: int, info: dict) -> None:
    scores = " ".join(
        f"{k[len('eval/') :]}={v:.3f}" for k, v in info.items() if k.startswith("eval/")
    )
    console.info("eval step %d: %s", step, scores)
