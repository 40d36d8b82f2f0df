"""The rollout engines of a run and of an evaluation: the one place engines are built.

`make_engine`: a run's, the embedded JAX sampler over the policy's own weights or a client of a
vLLM server (launched here, or at `rollout.url`) that the run syncs its weights to.
`checkpoint_engine`: an evaluation's, sampling from a fixed checkpoint. With several processes,
one engine per process over its share of the prompts (`distributed.ShareEngine`). Every engine
stops on the checkpoint's token ids (`stops`).
"""

from __future__ import annotations

import dataclasses
import os

import jax

from mmr_jax import distributed
from mmr_jax.config import schema
from mmr_jax.models import lora as lora_lib
from mmr_jax.models import sharding
from mmr_jax.rollout import embedded, padding, stops, vllm_engine, vllm_launch


def make_engine(
    cfg: schema.TrainConfig, policy: lora_lib.Policy, tokenizer, model_dir, workdir, mesh=None
):
    """The run's rollout engine (`cfg.rollout.engine`), already holding the policy's weights.

    With several processes, one engine per process over its share of the prompts
    (`distributed.ShareEngine`), holding whole weights of its own. On a pure data-parallel
    `mesh` (fsdp and tensor of size 1: the weights are replicated already) the embedded engine
    samples data-parallel over it; otherwise on the weights' devices. `model_dir` is the
    checkpoint's folder (`hub.resolve_checkpoint` of `model.path`; None under `model.init=random`):
    both engines stop on its ids, and a vLLM server launched here serves its files. The server's
    sync folder and log are under `workdir` (a local folder).
    """
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    if model_dir is None:  # random weights, no checkpoint folder: the built tokenizer's EOS
        stop_ids = (int(tokenizer.eos_token_id),)
    else:
        stop_ids = stops.checkpoint_stop_ids(model_dir, tokenizer)
    if jax.process_count() > 1:  # this process's share, on weights of its own
        share = cfg.batch.prompts // jax.process_count()
        cfg = dataclasses.replace(cfg, batch=dataclasses.replace(cfg.batch, prompts=share))
        policy = dataclasses.replace(
            policy,
            params=distributed.local_copy(policy.params),
            frozen=distributed.local_copy(policy.frozen),
            rest=distributed.local_copy(policy.rest),
        )
        devices = jax.local_devices()
        mesh = sharding.data_parallel_mesh(devices) if len(devices) > 1 else None
    if cfg.rollout.engine == "embedded":
        # Training prompts padded to one shape: the sampler compiles once, not per prompt length.
        buckets = padding.MinSizes(
            min_prompts=cfg.batch.prompts,
            min_prompt_len=cfg.batch.max_prompt_len,
            min_new_tokens=cfg.batch.max_completion_len,
        )
        data_parallel = mesh is not None and mesh.shape["fsdp"] * mesh.shape["tensor"] == 1
        engine = embedded.EmbeddedEngine(
            policy.model(),
            stop_token_ids=stop_ids,
            pad_id=pad,
            seed=cfg.seed,
            buckets=buckets,
            mesh=mesh if data_parallel and mesh.size > 1 else None,
        )
    else:  # one server per process (`rollout_url` refuses one shared by weight-syncing ones)
        url = distributed.rollout_url(
            cfg.rollout.url, jax.process_count(), jax.process_index(), syncs_weights=True
        )
        process = f"process{jax.process_index()}" if jax.process_count() > 1 else ""
        sync_dir = cfg.rollout.sync_dir or os.path.join(os.fspath(workdir), "sync")
        log_name = f"vllm_server.{process}.log" if process else "vllm_server.log"
        engine = vllm_launch.run_engine(
            cfg,
            url=url,
            model_dir=model_dir,
            log_path=os.path.join(os.fspath(workdir), log_name),
            sync_dir=os.path.join(sync_dir, process) if process else sync_dir,
            lora=policy.lora,
            pad_id=pad,
            stop_ids=stop_ids,
        )
    return distributed.ShareEngine(engine) if jax.process_count() > 1 else engine


def checkpoint_engine(kind: str, checkpoint: str, *, url: str = "", seed: int = 0):
    """The engine that samples from `checkpoint` (a folder or hub id) for an evaluation.

    'embedded': the JAX sampler on the checkpoint, data-parallel over this process's devices when
    there are several. 'vllm': a server at `url` that already serves `checkpoint` under that name;
    with several processes `url` may list one server per process (`distributed.rollout_url`).
    """
    if kind == "embedded":
        mesh = sharding.data_parallel_mesh(jax.local_devices())
        engine = embedded.EmbeddedEngine.from_pretrained(
            checkpoint, seed=seed, mesh=mesh if mesh.size > 1 else None
        )
    elif kind == "vllm":
        url = distributed.rollout_url(url, jax.process_count(), jax.process_index())
        engine = vllm_engine.VllmEngine(url, model=checkpoint)
    else:
        raise ValueError(f"unknown engine {kind!r}; expected 'embedded' or 'vllm'")
    return distributed.ShareEngine(engine) if jax.process_count() > 1 else engine
