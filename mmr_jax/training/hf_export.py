"""HF exports of a training run: folders that transformers and vLLM load (PEFT too under LoRA).

    <workdir>/step_<N>/            each checkpointed step's weights (config checkpoint.export_hf)
    <workdir>/step_<N>.partial/    an export in progress; renamed to step_<N> when complete

`export` writes a model (with several processes: gathered, process 0 writing), `export_if_missing`
redoes the one a run killed after its checkpoint never finished, and `export_hf` writes a
checkpoint of a workdir after the run (scripts/train.py --export_hf). `export_model` is the
folder's writing itself: local or a bucket, never leaving a half-written `step_N`.
`run_config` lets scripts/evaluate.py export a run's Orbax checkpoints (`checkpoint.saved_steps`)
itself (with the config the run was trained with, from its run.json).
"""

from __future__ import annotations

import os
import pathlib
import tempfile

import jax
from absl import logging
from etils import epath

from mmr_jax import distributed
from mmr_jax.config import checks, command_line, schema
from mmr_jax.infra import console, faults, run_paths, user_errors
from mmr_jax.models import sharding
from mmr_jax.step import train_step
from mmr_jax.training import build, checkpoint, workdir_guard


def export(cfg: schema.TrainConfig, model, out_dir, step: int | None = None) -> None:
    """Writes `model` (the policy's, `policy.model(params)`) to `out_dir` in `cfg.model.dtype`."""
    if jax.process_count() > 1:  # whole weights gathered on every process; process 0 writes
        model = distributed.local_model(model)
        if not distributed.is_primary():
            return
    dtype = build.DTYPES[cfg.model.dtype]
    export_model(
        model, out_dir, base_path=cfg.model.path, dtype=dtype, lora=cfg.lora.enabled, step=step
    )


def export_if_missing(cfg: schema.TrainConfig, policy, state, workdir: str, step: int) -> None:
    """Exports checkpoint `step`'s weights (`state`) unless `<workdir>/step_<step>` is complete."""
    # A run killed between its last checkpoint and that step's export resumes after the step.
    out = os.path.join(workdir, f"step_{step}")
    # In a bucket a folder's rename copies, then deletes: a `.partial` left means it did not end.
    done = run_paths.as_path(out)
    missing = not done.exists() or done.with_name(done.name + ".partial").exists()
    if distributed.primary_value(missing):  # every process joins the export
        console.info("exporting step %d, not finished before the restart", step)
        export(cfg, policy.model(state.params), out, step)


def export_hf(cfg: schema.TrainConfig, workdir, out_dir, *, step: int | None = None) -> str:
    """Writes checkpoint `step` (default: latest) of `workdir` as a HF folder (PEFT under LoRA).

    With several processes every process restores its shards of the global arrays onto the
    run's mesh and joins the gather; process 0 writes."""
    run_paths.check(workdir)
    run_paths.check(out_dir, "--export_hf")
    mesh = (
        sharding.make_mesh(*cfg.mesh.shape, over_hosts=cfg.mesh.over_hosts)
        if jax.process_count() > 1
        else None
    )
    policy = build.load_policy(cfg, mesh)
    optimizer, _ = train_step.make_optimizer(cfg.optim, total_updates=cfg.total_updates)
    state = train_step.init_state(policy.params, optimizer, seed=cfg.seed, loss=cfg.loss, mesh=mesh)
    ckpt = checkpoint.Checkpointer(os.path.join(os.fspath(workdir), checkpoint.CKPT_DIR), keep=None)
    restored = ckpt.restore(checkpoint.state_tree(state), step=step)
    ckpt.close()
    if restored is None:
        raise FileNotFoundError(f"no checkpoint in {workdir}")
    export(cfg, policy.model(restored[0]["params"]), out_dir)
    return os.fspath(out_dir)


class NotARunError(user_errors.UserError, FileNotFoundError):
    """A folder given as a run's workdir holds no run.json."""


def run_config(workdir) -> schema.TrainConfig:
    """The config `workdir`'s run was trained with (its run.json): what restores its checkpoints."""
    if not (run_paths.as_path(workdir) / workdir_guard.RUN_FILE).exists():
        raise NotARunError(
            f"{workdir} is not a training run (no {workdir_guard.RUN_FILE}); "
            "pass the workdir of scripts/train.py"
        )
    stored = workdir_guard.read_run_config(workdir)
    return checks.from_config_dict(command_line.stored_config(stored))


def export_model(
    model, out_dir, *, base_path: str, dtype, lora: bool, step: int | None = None
) -> epath.Path:
    """Writes `model` as a HF folder (LoRA merged) that transformers and vLLM load.

    Under LoRA the adapters alone are also written as a PEFT folder, `<out_dir>/adapter`.
    `base_path` is the HF folder the run started from (tokenizer files, PEFT base name).
    The folder is written as `<out_dir>.partial` and renamed when complete, so a killed export
    never leaves a `step_N` folder that evaluate.py would take for a finished one. For a bucket
    `out_dir`, the folder is written locally first and uploaded to `<out_dir>.partial`.
    """
    from mmr_jax.models import export as model_export
    from mmr_jax.models import hub

    out_dir = run_paths.as_path(out_dir)
    partial = out_dir.with_name(out_dir.name + ".partial")
    try:
        if partial.exists():  # left by a killed export
            partial.rmtree()
        with tempfile.TemporaryDirectory(prefix="mmr_jax_export_") as tmp:
            local = pathlib.Path(tmp) if run_paths.is_remote(out_dir) else pathlib.Path(partial)
            tokenizer_dir = hub.resolve_checkpoint(base_path)
            model_export.save_hf(model, local, tokenizer_dir=tokenizer_dir, dtype=dtype)
            if lora:
                model_export.save_peft_adapter(
                    model, local / "adapter", base_model_name_or_path=base_path
                )
            if run_paths.is_remote(out_dir):
                run_paths.upload_tree(local, partial)
        faults.point("export", step)
        if out_dir.exists():
            out_dir.rmtree()
        partial.rename(out_dir)
    except OSError as e:
        if e.errno not in checkpoint.WRITE_ERRNOS:
            raise
        raise checkpoint.write_error(e, partial, "the HF export") from e
    logging.info("exported %s", out_dir)
    return out_dir
