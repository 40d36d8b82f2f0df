"""Builds what a run needs from a `TrainConfig`: model (split for the functional step), optimiser,
train state, rollout engine, encoder (`compiled_dry_run.dry_run`: the same, abstractly; the
prompts are `problem_sets`'s).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import pathlib
from typing import Any

import jax
import jax.numpy as jnp
from absl import logging
from flax import nnx

from mmr_jax import distributed, rollout
from mmr_jax.algorithms import entropy_control as entropy_control_lib
from mmr_jax.config import schema
from mmr_jax.models import attention_probe, hub, loading, random_init, sharding
from mmr_jax.models import config as model_config
from mmr_jax.models import lora as lora_lib
from mmr_jax.step import train_step

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@dataclasses.dataclass
class Policy:
    """The model split for the functional train step (trainable params live in `TrainState`)."""

    graphdef: Any  # train mode (LoRA dropout on)
    eval_graphdef: Any  # eval mode, for sampling
    params: nnx.State  # trainable: nnx.LoRAParam with LoRA, else nnx.Param
    frozen: nnx.State  # the other parameters (the base under LoRA; empty otherwise)
    rest: nnx.State  # RNG streams
    lora: bool
    attention: attention_probe.Choice | None = None  # the training forwards' attention backend

    def model(self, params=None, *, train=False) -> nnx.Module:
        """A Decoder viewing `params` (default: the initial ones); no copy."""
        gd = self.graphdef if train else self.eval_graphdef
        return nnx.merge(gd, self.params if params is None else params, self.frozen, self.rest)


def lora_config(cfg: schema.TrainConfig) -> lora_lib.LoraConfig | None:
    if not cfg.lora.enabled:
        return None
    return lora_lib.LoraConfig(
        rank=cfg.lora.rank,
        alpha=cfg.lora.alpha,
        dropout=cfg.lora.dropout,
        target_modules=tuple(cfg.lora.targets),
        seed=cfg.seed,
    )


def make_mesh(cfg: schema.TrainConfig):
    """The config's mesh over every process's devices (hybrid on several hosts by default)."""
    mesh = sharding.make_mesh(*cfg.mesh.shape, layout=cfg.mesh.layout)
    logging.info(
        "mesh %s (layout %s, %d process(es))",
        dict(mesh.shape),
        cfg.mesh.layout,
        jax.process_count(),
    )
    return mesh


def split_model(model: nnx.Module) -> Policy:
    """Splits a loaded Decoder into graphdefs and states."""
    trainable = lora_lib.trainable_filter(model)
    model.eval()
    eval_graphdef = nnx.split(model, trainable, nnx.Param, ...)[0]
    model.train()
    graphdef, params, frozen, rest = nnx.split(model, trainable, nnx.Param, ...)
    return Policy(graphdef, eval_graphdef, params, frozen, rest, lora=trainable is nnx.LoRAParam)


def load_policy(cfg: schema.TrainConfig, mesh=None) -> Policy:
    """Loads `cfg.model.path` (with adapters when LoRA is on); with `model.init='random'`,
    random weights of its architecture (`random_init.random_model`). The model's attention
    backend is `attention_choice(cfg, ...)`: 'auto' resolved here, before any trace."""
    dtypes = dict(dtype=DTYPES[cfg.model.dtype], param_dtype=DTYPES[cfg.model.param_dtype])
    dtypes["frozen_dtype"] = DTYPES.get(cfg.model.frozen_dtype)  # '' -> None: param_dtype
    if cfg.model.init == "random":
        mcfg = model_config.ModelConfig.from_hf(
            _hf_config(cfg.model.path),
            remat=cfg.model.remat,
            attention_impl=cfg.model.attention_impl,
        )
        model = random_init.random_model(
            mcfg, mesh=mesh, lora=lora_config(cfg), seed=cfg.seed, **dtypes
        )
    else:
        model = loading.from_pretrained(
            cfg.model.path,
            mesh=mesh,
            lora=lora_config(cfg),
            rngs=nnx.Rngs(cfg.seed),
            remat=cfg.model.remat,
            attention_impl=cfg.model.attention_impl,
            **dtypes,
        )
    choice = attention_choice(cfg, model.config)
    model.config = dataclasses.replace(model.config, attention_impl=choice.implementation)
    return dataclasses.replace(split_model(model), attention=choice)


def attention_choice(
    cfg: schema.TrainConfig, mcfg: model_config.ModelConfig
) -> attention_probe.Choice:
    """The attention backend of the run's training forwards (`attention_probe.choose`, run once
    per process and shape: the trainer's header and run.json read the same answer)."""
    return _attention_choice(
        mcfg.attention_impl,
        DTYPES[cfg.model.dtype],
        mcfg.num_heads,
        mcfg.num_kv_heads,
        mcfg.head_dim,
        packed=bool(cfg.batch.shared_prompt and cfg.batch.pack_max_len),  # pipeline.layout
    )


@functools.cache
def _attention_choice(impl, dtype, heads, kv_heads, head_dim, *, packed):
    choice = attention_probe.choose(impl, dtype, heads, kv_heads, head_dim, packed=packed)
    logging.info("attention: %s (%s)", choice.implementation, choice.reason)
    return choice


def load_tokenizer(cfg: schema.TrainConfig):
    """The checkpoint's tokenizer; with `model.init='random'`, a byte-level one of the
    architecture's vocabulary size built in memory (`random_init.byte_tokenizer`)."""
    if cfg.model.init == "random":
        vocab = model_config.ModelConfig.from_hf(_hf_config(cfg.model.path)).vocab_size
        return random_init.byte_tokenizer(vocab)
    # A hub id is fetched once (here); the config keeps the id, as vLLM serves it under that name.
    return hub.load_tokenizer(cfg.model.path, "model.path")


def weights_note(cfg: schema.TrainConfig) -> str:
    """What the run's weights are, for its console header: random ones said plainly."""
    if cfg.model.init == "random":
        return (
            f"RANDOM WEIGHTS (model.init=random) of {cfg.model.path}'s architecture and a "
            "byte-level tokenizer: for timing and memory, not learning"
        )
    return f"model {cfg.model.path}"


def make_optimizer(cfg: schema.TrainConfig):
    o = cfg.optim
    return train_step.make_optimizer(
        lr=o.lr,
        total_updates=cfg.total_steps * cfg.loss.iterations * cfg.loss.updates_per_batch,
        warmup_ratio=o.warmup_ratio,
        min_lr_ratio=o.min_lr_ratio,
        grad_clip=o.grad_clip,
        b1=o.b1,
        b2=o.b2,
        eps=o.eps,
        weight_decay=o.weight_decay,
    )


def init_state(cfg: schema.TrainConfig, params, optimizer, mesh=None) -> train_step.TrainState:
    """The step-0 state. With a mesh, leaves without a sharding (step, counts, RNG) are replicated
    on it, as the train step's outputs will be, so that the step compiles only once."""
    state = _init_state(cfg, params, optimizer)
    if mesh is None:
        return state
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

    def place(x):
        return (
            x
            if isinstance(x.sharding, jax.sharding.NamedSharding)
            else jax.device_put(x, replicated)
        )

    return jax.tree.map(place, state)


def _init_state(cfg: schema.TrainConfig, params, optimizer) -> train_step.TrainState:
    return train_step.TrainState(
        step=jnp.zeros([], jnp.int32),
        params=params,
        opt_state=optimizer.init(params),
        rng=jax.random.key_data(jax.random.key(cfg.seed)),
        entropy_coef=jnp.float32(cfg.loss.entropy_coef) if cfg.loss.entropy_target > 0 else None,
    )


def step_config(cfg: schema.TrainConfig) -> train_step.StepConfig:
    """The train step's static settings: the loss section, and what the step reads of the rest."""
    return train_step.StepConfig(
        loss=cfg.loss,
        temperature=cfg.rollout.temperature,
        max_completion_len=cfg.batch.max_completion_len,
        logprob_chunk=cfg.model.logprob_chunk,
        entropy_control=entropy_control(cfg),
    )


def train_graphdef(cfg: schema.TrainConfig, policy: Policy):
    """The train step's graphdef: LoRA dropout on, except when the step takes more than one
    optimiser update. From the second update on the ratio divides the training forward by the
    dropout-free old log-probs, and dropout's noise alone then moves GSPO's sequence ratio past
    its 3e-4 band (docs/algorithms.md, benchmarks/lora_dropout_ratio.py); with one update the
    ratio is taken against the same forward and dropout cannot enter it."""
    several = cfg.loss.iterations * cfg.loss.updates_per_batch > 1
    if policy.lora and cfg.lora.dropout > 0 and several:
        return policy.eval_graphdef
    return policy.graphdef


def entropy_control(cfg: schema.TrainConfig):
    """The adaptive entropy coefficient's constants, or None (a fixed `loss.entropy_coef`)."""
    loss = cfg.loss
    if loss.entropy_target <= 0:
        return None
    return entropy_control_lib.Control(
        target=loss.entropy_target,
        step=loss.entropy_coef_step,
        low=loss.entropy_coef_min,
        high=loss.entropy_coef_max,
    )


def make_engine(cfg: schema.TrainConfig, policy: Policy, tokenizer, workdir, mesh=None):
    """The run's rollout engine (`cfg.rollout.engine`), already holding the policy's weights.

    With several processes, one engine per process over its share of the prompts
    (`distributed.ShareEngine`), holding whole weights of its own. On a pure data-parallel
    `mesh` (fsdp and tensor of size 1: the weights are replicated already) the embedded engine
    samples data-parallel over it; otherwise on the weights' devices.
    """
    if jax.process_count() == 1:
        return _engine(cfg, policy, tokenizer, workdir, mesh)
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
    return distributed.ShareEngine(_engine(local_cfg, local, tokenizer, workdir, local_mesh))


def _engine(cfg: schema.TrainConfig, policy: Policy, tokenizer, workdir, mesh):
    from mmr_jax.rollout import embedded, padding, stops

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    if cfg.model.init == "random":  # no checkpoint folder: the built tokenizer's EOS
        local, stop_ids = None, (int(tokenizer.eos_token_id),)
    else:
        # Resolved once (a hub id too): both engines stop on the same ids; vLLM serves its files.
        local = hub.resolve_checkpoint(cfg.model.path)
        stop_ids = stops.stop_token_ids(local, tokenizer)
    if cfg.rollout.engine == "embedded":
        # Training prompts padded to one shape: the sampler compiles once, not per prompt length.
        buckets = padding.Buckets(
            min_prompts=cfg.batch.prompts,
            min_prompt_len=cfg.batch.max_prompt_len,
            min_new_tokens=cfg.batch.max_completion_len,
        )
        data_parallel = mesh is not None and mesh.shape["fsdp"] * mesh.shape["tensor"] == 1
        return embedded.EmbeddedEngine(
            policy.model(),
            stop_token_ids=stop_ids,
            pad_id=pad,
            seed=cfg.seed,
            buckets=buckets,
            mesh=mesh if data_parallel and mesh.size > 1 else None,
        )
    # One server per process (`rollout_url`: a server shared by processes that each reload their
    # weights there is refused); each writes its weight versions to a folder its server reads.
    url = distributed.rollout_url(
        cfg.rollout.url, jax.process_count(), jax.process_index(), syncs_weights=True
    )
    server = None
    sync_dir = cfg.rollout.sync_dir or os.path.join(os.fspath(workdir), "sync")
    process = f"process{jax.process_index()}" if jax.process_count() > 1 else ""
    sync_dir = os.path.join(sync_dir, process) if process else sync_dir
    log_name = f"vllm_server.{process}.log" if process else "vllm_server.log"
    if not url:  # launch our own server, stopped by engine.close() (or at exit)
        from mmr_jax.rollout import vllm_launch

        opts = vllm_launch.options_from_config(cfg, port=vllm_launch.free_port(), model=str(local))
        server = vllm_launch.ServerProcess(opts, os.path.join(os.fspath(workdir), log_name))
        logging.info("starting a vLLM server (%s) for %s", opts.backend, opts.model)
        server.start()
        try:
            waited = server.wait_ready(cfg.rollout.ready_timeout_s)
        except BaseException:
            server.stop()
            raise
        logging.info("vLLM server ready at %s after %.0fs", server.url, waited)
        url = server.url
    try:
        engine = rollout.make_engine(
            "vllm",
            model_path=cfg.model.path,
            url=url,
            served_model_name=cfg.rollout.model_name or None,
            sync_dir=sync_dir,
            lora=policy.lora,
            timeout_s=cfg.rollout.timeout_s,
            max_retries=cfg.rollout.max_retries,
            wait_ready_s=cfg.rollout.ready_timeout_s,
            pad_id=pad,
            seed=cfg.seed,
            stop_token_ids=stop_ids,
        )
    except BaseException:
        if server is not None:
            server.stop()
        raise
    engine.server = server
    return engine


# ----- dry run ------------------------------------------------------------------------------------


def _hf_config(path: str) -> pathlib.Path:
    """config.json of a checkpoint folder, else third_party/hf_configs/<name>.json (upstream's)."""
    p = pathlib.Path(path)
    stem = p.name.lower().replace("-", "_").replace(".", "_")
    models_dir = pathlib.Path(__file__).resolve().parents[2] / "third_party" / "hf_configs"
    for cand in (p / "config.json", p, models_dir / f"{stem}.json"):
        if cand.is_file():
            return cand
    raise FileNotFoundError(f"no config.json in {path} (nor third_party/hf_configs/{stem}.json)")
