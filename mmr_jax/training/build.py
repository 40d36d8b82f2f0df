"""Builds a run whole from its `TrainConfig`, top to bottom: the workdir, the mesh, the policy,
the tokenizer, the prompts, the optimiser and state (resumed from the latest checkpoint), the
rollout engine and encoder, the jitted update (`compiled_dry_run.dry_run`: the same, abstractly).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import jax.numpy as jnp
from absl import logging
from flax import nnx

from mmr_jax import distributed
from mmr_jax.config import checks, schema
from mmr_jax.infra import metrics, run_paths
from mmr_jax.models import attention_probe, hub, loading, random_init, sharding
from mmr_jax.models import config as model_config
from mmr_jax.models import lora as lora_lib
from mmr_jax.problems import data
from mmr_jax.step import embeddings, shape_reuse, train_step
from mmr_jax.training import checkpoint, engines, problem_sets, rollout_schedule, workdir_guard

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@dataclasses.dataclass(frozen=True)
class Run:
    """Everything a running training job holds (its state, the one part that changes, is kept by
    the loop and `trainer.save`)."""

    cfg: schema.TrainConfig
    workdir: str
    resume_step: int | None  # the checkpoint the run resumed from; None: a new run
    tokenizer: Any
    prompts: data.PromptIterator  # yields (prompt ids, answer) pairs
    eval_problems: dict[str, list[data.Problem]]  # benchmark name -> problems (`cfg.eval`)
    policy: lora_lib.Policy
    ref_params: Any  # full fine-tune with beta > 0: the initial weights; else None
    engine: Any
    rollouts: rollout_schedule.OnPolicyRollouts | rollout_schedule.OffPolicyRollouts
    step_fn: Any  # the jitted update (`train_step.jit_train_step`)
    checkpointer: checkpoint.Checkpointer
    writer: metrics.MetricWriter
    lengths: shape_reuse.LengthChooser | None  # packed steps, batch.reuse_compiled_lengths
    mesh: Any  # the global mesh: the step's batch is split over its (data, fsdp) axes


def run(
    cfg: schema.TrainConfig, workdir, *, overwrite: bool = False
) -> tuple[Run, train_step.TrainState]:
    """The run of `cfg` in `workdir` and its state, resumed from the latest checkpoint there."""
    run_paths.check(workdir)  # on every process, before any collective
    distributed.check_same_config(cfg.to_dict())  # before anything is built or written
    distributed.check_batch_split(cfg.batch.prompts)
    checks.check_processes(cfg, jax.process_count())
    prepare = lambda: workdir_guard.prepare_workdir(workdir, cfg.to_dict(), overwrite=overwrite)
    workdir = os.fspath(distributed.primary_first(prepare, "to prepare the workdir") or workdir)
    if cfg.model.init == "random":  # no checkpoint: a tokenizer built in memory, no download
        model_dir, tokenizer = None, random_init.byte_tokenizer_of(cfg.model.path)
    else:  # a hub id is fetched once, here; the config keeps the id, as vLLM serves it so
        model_dir = hub.resolve_checkpoint(cfg.model.path, "model.path")
        tokenizer = hub.load_tokenizer(model_dir, "model.path")
    mesh = sharding.make_mesh(*cfg.mesh.shape, over_hosts=cfg.mesh.over_hosts)
    logging.info(
        "mesh %s (over hosts %s, %d process(es))",
        dict(mesh.shape),
        cfg.mesh.over_hosts,
        jax.process_count(),
    )
    policy = load_policy(cfg, mesh)
    train, heldout = problem_sets.load(cfg, tokenizer)
    prompts = data.PromptIterator(
        list(zip(train.ids, train.answers, strict=True)), cfg.batch.prompts, cfg.seed
    )
    optimizer, schedule = train_step.make_optimizer(cfg.optim, total_updates=cfg.total_updates)
    state = train_step.init_state(policy.params, optimizer, seed=cfg.seed, loss=cfg.loss, mesh=mesh)
    ref_params = None
    if cfg.loss.beta > 0 and not policy.lora:
        ref_params = jax.tree.map(lambda x: x.copy(), policy.params)  # the donated state moves on
    ckpt = checkpoint.Checkpointer(
        os.path.join(workdir, checkpoint.CKPT_DIR),
        keep=cfg.checkpoint.keep,
        keep_period=cfg.checkpoint.keep_period,
    )
    resume_step = lengths_state = None
    restored = ckpt.restore(checkpoint.state_tree(state))
    if restored is not None:  # the data position, and the packed lengths' (absent before them)
        tree, meta = restored
        state, resume_step = train_step.TrainState(**tree), int(meta["step"])
        prompts.restore(meta["data"])
        lengths_state = meta.get("packed_lengths")
    # A vLLM server's sync folder and log stay local: a bucket workdir's staging folder.
    rollout_engine = engines.make_engine(
        cfg, policy, tokenizer, model_dir, run_paths.open_run(workdir).local, mesh
    )
    rollout_engine.sync_weights(policy.model(state.params), version=int(state.step))
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
        engine=rollout_engine,
        tokenizer=tokenizer,
        encoder=encoder,
        prompts_dropped=train.dropped,
        params=state.params,
        model=policy.model,
        version=int(state.step),
    )
    step_fn = train_step.jit_train_step(
        graphdef=train_step.step_graphdef(policy, cfg.loss, cfg.lora.dropout),
        optimizer=optimizer,
        schedule=schedule,
        cfg=train_step.StepConfig.from_config(cfg),
        mesh=mesh,
    )
    writer = metrics.NullWriter()
    if distributed.is_primary():
        writer = metrics.MetricWriter(
            workdir, tensorboard=cfg.logging.tensorboard, resume_step=resume_step or 0
        )
    lengths = None
    if cfg.batch.layout == "packed" and cfg.batch.compile_price_steps > 0:
        lengths = shape_reuse.LengthChooser.from_state(lengths_state, cfg.batch.compile_price_steps)
    if jax.process_index() == 0:  # started: the workdir is this run's (a failed start claims none)
        workdir_guard.claim(workdir, cfg.to_dict(), attention_impl=policy.attention)
    parts = dict(tokenizer=tokenizer, prompts=prompts, eval_problems=heldout, policy=policy)
    parts.update(ref_params=ref_params, engine=rollout_engine, rollouts=rollouts, step_fn=step_fn)
    parts.update(checkpointer=ckpt, writer=writer, lengths=lengths, mesh=mesh)
    return Run(cfg=cfg, workdir=workdir, resume_step=resume_step, **parts), state


def lora_config(cfg: schema.TrainConfig) -> lora_lib.LoraConfig | None:
    """The adapters `cfg.lora` asks for, or None (a full fine-tune)."""
    if not cfg.lora.enabled:
        return None
    return lora_lib.LoraConfig(
        rank=cfg.lora.rank,
        alpha=cfg.lora.alpha,
        dropout=cfg.lora.dropout,
        target_modules=tuple(cfg.lora.targets),
        seed=cfg.seed,
    )


def load_policy(cfg: schema.TrainConfig, mesh=None) -> lora_lib.Policy:
    """Loads `cfg.model.path` (with adapters when LoRA is on); with `model.init='random'`,
    random weights of its architecture (`random_init.random_model`). The model's attention
    backend is resolved here, 'auto' included, before any trace (`attention_probe.choose_once`)."""
    lora = lora_config(cfg)
    dtype = DTYPES[cfg.model.dtype]
    dtypes = dict(dtype=dtype, param_dtype=DTYPES[cfg.model.param_dtype])
    dtypes["frozen_dtype"] = DTYPES.get(cfg.model.frozen_dtype)  # '' -> None: param_dtype
    packed = cfg.batch.layout == "packed"  # the attention masks carry segments
    if cfg.model.init == "random":
        mcfg = model_config.ModelConfig.from_hf(
            model_config.config_file(cfg.model.path),
            remat=cfg.model.remat,
            attention_impl=cfg.model.attention_impl,
        )
        model = random_init.random_model(mcfg, mesh=mesh, lora=lora, seed=cfg.seed, **dtypes)
    else:
        model = loading.from_pretrained(
            cfg.model.path,
            mesh=mesh,
            lora=lora,
            rngs=nnx.Rngs(cfg.seed),
            remat=cfg.model.remat,
            attention_impl=cfg.model.attention_impl,
            **dtypes,
        )
    c = model.config
    choice = attention_probe.choose_once(
        c.attention_impl, dtype, c.num_heads, c.num_kv_heads, c.head_dim, packed=packed
    )
    model.config = dataclasses.replace(c, attention_impl=choice.implementation)
    return lora_lib.split_policy(model, attention=choice)


def weights_note(cfg: schema.TrainConfig) -> str:
    """What the run's weights are, for its console header: random ones said plainly."""
    if cfg.model.init == "random":
        return (
            f"RANDOM WEIGHTS (model.init=random) of {cfg.model.path}'s architecture and a "
            "byte-level tokenizer: for timing and memory, not learning"
        )
    return f"model {cfg.model.path}"
