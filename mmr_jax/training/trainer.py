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

import math
import os
import time

import jax
from absl import logging

from mmr_jax import distributed
from mmr_jax.config import checks, schema
from mmr_jax.infra import compile_stats, console, faults, metrics, run_paths
from mmr_jax.step import pipeline, train_step
from mmr_jax.training import build, checkpoint, hf_export, shutdown


class NonFiniteLossError(FloatingPointError):
    """The loss became NaN or inf; the run stops, its last good checkpoint untouched."""


def print_header(run: build.Run) -> None:
    """The run's console header: what it trains, where, on what; its method; config advisories."""
    from mmr_jax.training import method_line

    cfg, devices, attention = run.cfg, jax.devices(), run.policy.attention
    console.info(
        "%s | %s | attention %s | %d process(es), %d %s device(s), mesh %s | workdir %s | %s",
        cfg.name,
        build.weights_note(cfg),
        attention.implementation if attention is not None else cfg.model.attention_impl,
        jax.process_count(),
        len(devices),
        devices[0].platform,
        dict(run.mesh.shape),
        run.workdir,
        f"resuming from step {run.resume_step}" if run.resume_step is not None else "new run",
    )
    console.info("method: %s", method_line.method_line(cfg))
    if distributed.is_primary():
        for line in checks.advisories(cfg):
            logging.warning("config: %s", line)


def fetch_finite(step: int, device_metrics: dict, workdir: str, last_saved) -> dict:
    """A step's metrics on the host; `NonFiniteLossError` when its loss or gradient is inf/NaN."""
    values = {k: float(v) for k, v in jax.device_get(device_metrics).items()}
    loss, grad_norm = values.get("loss", 0.0), values.get("grad_norm", 0.0)
    if not math.isfinite(loss) or not math.isfinite(grad_norm):
        raise NonFiniteLossError(
            f"step {step}: non-finite loss {loss} (grad norm {grad_norm}); "
            f"stopping. The last good checkpoint (step {last_saved}) in {workdir} is intact; lower "
            f"optim.lr or check the rewards and data, then resume from it."
        )
    return values


def write_metrics(run: build.Run, step: int, values: dict, progress: metrics.Progress) -> None:
    """Writes a step's metrics (every `logging.every` steps) and prints its progress line."""
    if metrics.Periodic(run.cfg.logging.every, last=run.cfg.total_steps)(step):
        values = distributed.reduce_metrics(values)  # on every process: a collective
        run.writer.write(step, values)
        console.info("%s", progress.line(step, values))


def save(run: build.Run, state: train_step.TrainState, step: int) -> None:
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


def evaluate(run: build.Run, step: int) -> dict[str, float]:
    """The `eval` block's benchmarks sampled by the run's engine (its weights after `step`)."""
    from mmr_jax.problems import evaluation

    e = run.cfg.eval
    t0 = time.perf_counter()
    result = evaluation.evaluate(
        run.engine,
        run.tokenizer,
        run.eval_problems,
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


def sync_engine(run: build.Run, state: train_step.TrainState, step: int, timings: dict) -> None:
    """Hands the engine the weights after `step` (off-policy: once its rollout in flight ends,
    a copy of its own, which outlives the next update's donation)."""
    run.rollouts.wait(timings)  # on-policy: nothing in flight
    t0 = time.perf_counter()
    params = run.rollouts.engine_params(run.engine, state.params)
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
    a step that checkpoints or evaluates, and the last, fetches its own first, so that only a
    finite state is saved, and writes them before its checkpoint (a resume truncates
    metrics.jsonl to it).
    """
    run, state = build.run(cfg, workdir, overwrite=overwrite)
    print_header(run)
    start = int(state.step)
    save_now = metrics.Periodic(
        cfg.checkpoint.every, last=cfg.total_steps, at_last=cfg.checkpoint.at_end
    )
    eval_now = metrics.Periodic(cfg.eval.every, last=cfg.total_steps, at_last=cfg.eval.every > 0)
    progress = metrics.Progress(cfg.total_steps, start)
    pending, last_saved, fetched = None, start or None, {}
    try:
        if start == 0 and cfg.eval.at_start and cfg.eval.every > 0:  # the base model's accuracy
            run.writer.write(0, evaluate(run, 0))
            progress = metrics.Progress(cfg.total_steps, start)  # the ETA counts steps only
        if run.resume_step is not None and cfg.checkpoint.export_hf:  # killed before its export
            hf_export.export_if_missing(cfg, run.policy, state, run.workdir, run.resume_step)
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
                choose_packed_length=None if run.lengths is None else run.lengths.choose,
                mesh=run.mesh,
            )
            info.update(batch_info)
            t0 = time.perf_counter()
            state, device_metrics = run.step_fn(state, batch, run.policy.frozen, run.policy.rest)
            faults.point("train", step)
            if pending is not None:  # the previous step's metrics, fetched while this one runs
                fetched = fetch_finite(pending[0], pending[1], run.workdir, last_saved)
                write_metrics(run, pending[0], {**pending[2], **fetched}, progress)
                pending = None
            jax.block_until_ready(state.step)  # so that time/train is the update's own time
            timings["train"] = time.perf_counter() - t0
            sync_engine(run, state, step, timings)
            if jax.process_count() > 1:  # rollout gathers and weight copies of this step
                timings["collectives"] = distributed.collective_seconds()
            for text in groups.texts[0][: cfg.logging.samples]:
                logging.info("step %d sample: %r", step, text[:300])
            pending, final = (step, device_metrics, info), step == cfg.total_steps
            if save_now(step) or eval_now(step) or final:  # a checkpoint only of a finite state
                fetched = fetch_finite(step, device_metrics, run.workdir, last_saved)
            if eval_now(step):
                info.update(evaluate(run, step))
            step_timings(info, timings, t_step)
            if save_now(step) or final:  # its own metrics, written before its checkpoint
                fetched = {**info, **fetched}
                write_metrics(run, step, fetched, progress)
                pending = None
            if save_now(step):
                save(run, state, step)
                last_saved = step
    except Exception as e:  # a full disk, a dead peer process: a named error (shutdown)
        named = shutdown.named_error(e, run.workdir, last_saved)
        if named is None:
            raise
        raise named from e
    finally:
        shutdown.close(run)
    return fetched
