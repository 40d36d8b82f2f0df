"""The programs a run compiles, as (jitted function, abstract arguments) on a mesh: no weights.

Used by training/compiled_dry_run.py (virtual CPU devices) and training/aot_dry_run.py (the
compile-only devices of a TPU or GPU). Each is the run's own jitted function, fed
`ShapeDtypeStruct`s with the shardings a run gives its arrays, at the config's largest shapes:
- `train_step_program`: `train_step.jit_train_step` on the step's largest batch in the configured
  layout (full rows, shared prompt, or packed: every completion at max_completion_len, so the
  packed rows are the longest and fewest completions a row that such a batch gets);
- `logprob_program`: the trainer's jitted `minibatch.logprobs_fn` on that batch (the reference or
  old log-probs), when the config computes them;
- `prefill_program`, `decode_loop_program`: the embedded sampler's packed prefill
  (`rollout.prefill.prefill`) and its decode loop (`sampler.decode_program`, the first call: the
  compacted calls after it run on fewer rows), for B prompts x G rows, the weights in the compute
  dtype (`sampler_weights.sampling_weights`), replicated over a data-parallel mesh as the engine
  puts them (`engines.make_engine`), else as the trainer shards them;
- `decode_step_program`: one decode step of the sampler's model (the HLO tests read it).

The abstract model is built as `build.load_policy` builds the real one: dtype, param_dtype,
frozen_dtype, LoRA, remat policy; the attention backend is the caller's (`attention`), else the
one a run here would use.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from mmr_jax.config import schema
from mmr_jax.models import attention_probe, kv_cache, loading, sharding
from mmr_jax.models import config as model_config
from mmr_jax.models import lora as lora_lib
from mmr_jax.rollout import padding, prefill, sampler
from mmr_jax.step import batch_layout, minibatch, pipeline, train_step
from mmr_jax.training import build


def _with_shardings(state, mesh):
    """Abstract parameters -> ShapeDtypeStructs carrying their partition rule's sharding."""

    def place(path, var):
        value = var.get_value()
        spec = sharding.named_sharding(path, tuple(value.shape), mesh)
        return var.replace(jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=spec))

    flat = [(p, place(p, v)) for p, v in nnx.to_flat_state(state)]
    return nnx.from_flat_state(flat)


def abstract_policy(
    cfg: schema.TrainConfig,
    mesh,
    *,
    remat: str | None = None,
    unrolled: bool = False,
    attention: str | None = None,
):
    """(policy, model config, (params, frozen, rest)) of the config's model, abstract, sharded on
    `mesh`. `unrolled`: the layers' scan fully unrolled (benchmarks/bench_compile.py).
    `attention`: the training forwards' backend (default: the one a run on this host uses)."""
    mcfg = model_config.ModelConfig.from_hf(
        model_config.config_file(cfg.model.path), remat=remat or cfg.model.remat
    )
    if unrolled:
        mcfg = dataclasses.replace(mcfg, scan_unroll=mcfg.num_layers)
    if attention is not None:
        mcfg = dataclasses.replace(mcfg, attention_impl=attention)
    elif jax.default_backend() == "gpu":  # the backend a run would use (probed); else 'auto'
        mcfg = dataclasses.replace(mcfg, attention_impl=cfg.model.attention_impl)
        choice = attention_probe.choose_once(
            cfg.model.attention_impl,
            build.DTYPES[cfg.model.dtype],
            mcfg.num_heads,
            mcfg.num_kv_heads,
            mcfg.head_dim,
            packed=cfg.batch.layout == "packed",
        )
        mcfg = dataclasses.replace(mcfg, attention_impl=choice.implementation)
    abstract = loading.abstract_model(
        mcfg,
        dtype=build.DTYPES[cfg.model.dtype],
        param_dtype=build.DTYPES[cfg.model.param_dtype],
        lora=build.lora_config(cfg),
        frozen_dtype=build.DTYPES.get(cfg.model.frozen_dtype),  # '' -> param_dtype, as a run
    )
    policy = lora_lib.split_policy(abstract)
    parts = (policy.params, policy.frozen, policy.rest)
    return policy, mcfg, tuple(_with_shardings(s, mesh) for s in parts)


def _in_dtype(tree, dtype):
    """Abstract `tree` with its floating-point leaves in `dtype` (same shapes and shardings)."""

    def cast(x):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            return x
        return jax.ShapeDtypeStruct(x.shape, dtype, sharding=x.sharding)

    return jax.tree.map(cast, tree)


def _opt_state_shardings(opt_state, params, replicated):
    """Each optimiser-state leaf sharded as the parameter it mirrors (Adam's mu and nu hold a
    copy of the parameter tree: the leaf whose key path ends with a parameter's path, with its
    shape), the rest (counts) replicated, as the trainer's eager `optimizer.init` places them."""
    by_path = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        by_path[tuple(map(str, path))] = leaf

    def sharding_of(path, leaf):
        keys = tuple(map(str, path))
        for start in range(len(keys)):
            param = by_path.get(keys[start:])
            if param is not None and param.shape == leaf.shape:
                return param.sharding
        return replicated

    return jax.tree_util.tree_map_with_path(
        lambda path, x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding_of(path, x)),
        opt_state,
    )


def abstract_state(cfg, params, mesh) -> train_step.TrainState:
    optimizer, _ = train_step.make_optimizer(cfg.optim, total_updates=cfg.total_updates)
    replicated = NamedSharding(mesh, P())
    opt_state = jax.eval_shape(optimizer.init, params)
    return train_step.TrainState(
        step=jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated),
        params=params,
        opt_state=_opt_state_shardings(opt_state, params, replicated),
        rng=jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=replicated),
        entropy_coef=(
            jax.ShapeDtypeStruct((), jnp.float32, sharding=replicated)
            if cfg.loss.entropy_target > 0
            else None
        ),
    )


def packed_shape(cfg: schema.TrainConfig) -> tuple[int, int]:
    """(k, L) of the packed layout's largest step: every completion max_completion_len long, k
    the completions a row (`batch_layout.packed_group`), L its packed bucket."""
    b = cfg.batch
    g = batch_layout.group_size(b.generations, cfg.rows_per_step, cfg.loss.minibatches)
    inputs = np.full(cfg.rows_per_step, b.max_completion_len - 1)
    k = batch_layout.packed_group(inputs, g, b.pack_max_len)
    sizes = batch_layout.bucket_sizes(b.min_bucket_len, b.pack_max_len)
    return k, batch_layout.bucket_for(k * (b.max_completion_len - 1), sizes, "packed row")


def abstract_batch(cfg: schema.TrainConfig, mesh) -> train_step.Batch:
    """The step's largest batch in the configured layout (`BatchConfig.layout`), split over the
    mesh's (data, fsdp) axes; an array whose rows do not divide is replicated, as the trainer
    places it (`distributed.row_sharding`; e.g. 8 prompts on 16 devices)."""
    from mmr_jax import distributed

    b = cfg.batch
    n, p, t = cfg.rows_per_step, b.max_prompt_len, b.max_completion_len

    def arr(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=distributed.row_sharding(shape, mesh))

    kind = cfg.batch.layout
    width = p + t if kind == "full" else t
    prompts = n // batch_layout.group_size(b.generations, n, cfg.loss.minibatches)
    packed = None
    if kind == "packed":
        k, length = packed_shape(cfg)
        rows = lambda: arr((n // k, length), jnp.int32)
        packed = batch_layout.PackedCompletions(
            rows(), rows(), rows(), rows(), arr((n, t), jnp.int32)
        )
    return train_step.Batch(
        tokens=arr((n, width), jnp.int32),
        attention_mask=arr((n, width), jnp.bool_),
        completion_mask=arr((n, t), jnp.bool_),
        advantages=arr((n,), jnp.float32),
        old_logps=arr((n, t), jnp.float32) if pipeline.needs_old_logps(cfg) else None,
        ref_logps=arr((n, t), jnp.float32) if cfg.loss.beta > 0 else None,
        sampler_logps=arr((n, t), jnp.float32) if cfg.loss.tis_cap > 0 else None,
        prompt_tokens=None if kind == "full" else arr((prompts, p), jnp.int32),
        prompt_mask=None if kind == "full" else arr((prompts, p), jnp.bool_),
        packed=packed,
    )


def train_step_program(
    cfg, mesh, *, remat: str | None = None, unrolled: bool = False, attention: str | None = None
):
    """(the trainer's jitted train step, its abstract arguments) for the largest batch."""
    policy, _, (params, frozen, rest) = abstract_policy(
        cfg, mesh, remat=remat, unrolled=unrolled, attention=attention
    )
    optimizer, schedule = train_step.make_optimizer(cfg.optim, total_updates=cfg.total_updates)
    step = train_step.jit_train_step(
        graphdef=train_step.step_graphdef(policy, cfg.loss, cfg.lora.dropout),
        optimizer=optimizer,
        schedule=schedule,
        cfg=train_step.StepConfig.from_config(cfg),
        mesh=mesh,
    )
    state = abstract_state(cfg, params, mesh)
    return step, (state, abstract_batch(cfg, mesh), frozen, rest)


def logprob_program(cfg, mesh, *, attention: str | None = None):
    """(the trainer's jitted log-prob pass, its abstract arguments), or None when the config
    computes no reference or old log-probs (`pipeline.make_batch`)."""
    policy, _, (params, frozen, rest) = abstract_policy(cfg, mesh, attention=attention)
    dropout = policy.lora and cfg.lora.dropout > 0
    ref = cfg.loss.beta > 0
    if not (ref or pipeline.needs_old_logps(cfg) or (dropout and cfg.loss.tis_cap > 0)):
        return None
    batch = abstract_batch(cfg, mesh)
    static = dict(
        graphdef=policy.eval_graphdef,
        num_completion=cfg.batch.max_completion_len,
        temperature=cfg.rollout.temperature,
        chunk=cfg.model.logprob_chunk,
        minibatches=cfg.loss.minibatches,
        disable_lora=policy.lora and ref,
        mesh=mesh,
    )

    def logps(params, frozen, rest, tokens, mask, prompt_tokens, prompt_mask, packed):
        return minibatch.logprobs_fn(
            params, frozen, rest, tokens, mask,
            prompt_tokens=prompt_tokens, prompt_mask=prompt_mask, packed=packed, **static,
        )  # fmt: skip

    args = (params, frozen, rest, batch.tokens, batch.attention_mask)
    return jax.jit(logps), args + (batch.prompt_tokens, batch.prompt_mask, batch.packed)


def sampler_weights(cfg, mesh, policy, master):
    """(graphdef, the sampler's abstract weights, data-parallel?) as the embedded engine holds
    them: compute dtype; replicated on a data-parallel mesh (fsdp = tensor = 1), else sharded as
    the trainer's."""
    model = nnx.merge(policy.eval_graphdef, *master)
    graphdef, state = nnx.split(model)
    state = _in_dtype(state, build.DTYPES[cfg.model.dtype])
    data_parallel = mesh.shape["fsdp"] * mesh.shape["tensor"] == 1 and mesh.size > 1
    if data_parallel:
        state = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding.replicated(mesh)),
            state,
        )
    return graphdef, state, data_parallel


def _sampler_shapes(cfg, mesh, data_parallel):
    """(bp prompts, P slots, num_new slots) of the run's sampler calls (`sampler.start`)."""
    b = cfg.batch
    ways = sharding.batch_size(mesh) if data_parallel else 1
    bp = -(-padding.bucket(b.prompts, b.prompts) // ways) * ways
    return (
        bp,
        padding.length_bucket(b.max_prompt_len, max(b.max_prompt_len, 2)),
        padding.length_bucket(b.max_completion_len, b.max_completion_len),
    )


def prefill_program(cfg, mesh, graphdef, state, data_parallel):
    """(the sampler's jitted packed prefill, its abstract arguments): every prompt full length,
    so one packed row a prompt."""
    bp, p, _ = _sampler_shapes(cfg, mesh, data_parallel)
    rows_sharding = sharding.batch_sharding(mesh) if data_parallel else sharding.replicated(mesh)
    row = lambda shape: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=rows_sharding)
    cache = prefill.cache_sharding(mesh) if data_parallel else None
    fn = lambda state, *a: prefill.prefill(graphdef, state, *a, cache_sharding=cache)
    return jax.jit(fn), (state, row((bp, p - 1)), row((bp, p - 1)), row((bp, p - 1)), row((bp, p)))


def decode_loop_program(cfg, mesh, graphdef, state, data_parallel, prompt_cache):
    """(the sampler's jitted decode loop, its abstract arguments) for B prompts x G rows;
    `prompt_cache`: the prefill's output, abstract (its compiled output shardings)."""
    bp, p, num_new = _sampler_shapes(cfg, mesh, data_parallel)
    g = cfg.batch.generations
    rows_sharding = sharding.batch_sharding(mesh) if data_parallel else sharding.replicated(mesh)
    whole = sharding.replicated(mesh)
    arr = lambda shape, dtype, s=rows_sharding: jax.ShapeDtypeStruct(shape, dtype, sharding=s)
    r = cfg.rollout
    static = dict(
        n=g,
        num_new=num_new,
        greedy=r.temperature == 0.0,
        use_filter=r.temperature != 0.0 and (r.top_k > 0 or r.top_p < 1.0),
        mesh=mesh if data_parallel else None,
        keep_rows=not data_parallel,  # the engine compacts off a mesh (`sampler.start`)
    )
    fn = lambda state, *a: sampler.decode_program(graphdef, state, None, *a, **static)
    args = (
        state,
        arr((bp, p), jnp.int32),
        arr((bp, p), jnp.bool_),
        prompt_cache,
        arr((bp * g,), jnp.int32),
        arr((bp * g,), jnp.bool_),
        arr((), jnp.uint32, whole),
        *(arr((), dt, whole) for dt in (jnp.int32, jnp.int32, jnp.int32)),
        *(arr((), dt, whole) for dt in (jnp.float32, jnp.int32, jnp.float32)),
        arr((padding.MinSizes().min_stop_ids,), jnp.int32, whole),
    )
    return jax.jit(fn), args


def decode_step_program(cfg, mesh, *, unrolled: bool = False):
    """(one jitted decode step of the sampler's model for all B * G rows, its abstract args).

    The weights are fed in the compute dtype, as the sampler feeds them
    (`sampler_weights.sampling_weights`: a copy cast once per weight version), not the fp32 masters:
    otherwise the compiled step would cast every weight at every step, a cost the sampler does
    not pay (issue 35)."""
    policy, mcfg, master = abstract_policy(cfg, mesh, unrolled=unrolled)
    dtype = build.DTYPES[cfg.model.dtype]
    params, frozen, rest = (_in_dtype(part, dtype) for part in master)
    b, g = cfg.batch.prompts, cfg.batch.generations
    p, t = cfg.batch.max_prompt_len, cfg.batch.max_completion_len
    batch_axes = sharding.batch_sharding(mesh).spec[0]
    ways = sharding.batch_size(mesh)
    k, d, layers = mcfg.num_kv_heads, mcfg.head_dim, mcfg.num_layers

    def rows(m, lead=()):  # m rows over (data, fsdp) when they divide, else replicated
        return NamedSharding(mesh, P(*lead, batch_axes) if m % ways == 0 else P())

    def cache(n, slots):
        spec = rows(n, lead=(None,))
        return kv_cache.KVCache(
            k=jax.ShapeDtypeStruct((layers, n, k, d, slots), dtype, sharding=spec),
            v=jax.ShapeDtypeStruct((layers, n, k, slots, d), dtype, sharding=spec),
            split=True,
        )

    def step(params, frozen, rest, tokens, positions, prompt_cache, own_cache, pmask, index):
        model = nnx.merge(policy.eval_graphdef, params, frozen, rest)
        return model.forward_cached_shared_prompt(
            tokens,
            positions,
            prompt_cache,
            own_cache,
            write_index=index,
            prompt_mask_BxP=pmask,
        )

    n = b * g
    args = (
        params,
        frozen,
        rest,
        jax.ShapeDtypeStruct((n, 1), jnp.int32, sharding=rows(n)),
        jax.ShapeDtypeStruct((n, 1), jnp.int32, sharding=rows(n)),
        cache(b, p),
        cache(n, t),
        jax.ShapeDtypeStruct((b, p), jnp.bool_, sharding=rows(b)),
        jax.ShapeDtypeStruct((), jnp.int32, sharding=NamedSharding(mesh, P())),
    )
    return jax.jit(step, donate_argnums=(6,)), args


# Per program: (the argument it donates, the output that takes its place in the next call): the
# train step's state comes back as its new state, the decode step's own-rows cache as its update.
DONATED = {"train": (0, 0), "decode": (6, 1)}


def program(kind: str, cfg, mesh, *, unrolled: bool = False):
    """('train' or 'decode') -> (jitted program, abstract args, `DONATED[kind]`)."""
    if kind == "train":
        fn, args = train_step_program(cfg, mesh, unrolled=unrolled)
    elif kind == "decode":
        fn, args = decode_step_program(cfg, mesh, unrolled=unrolled)
    else:
        raise ValueError(f"unknown program {kind!r}; expected one of {sorted(DONATED)}")
    return fn, args, DONATED[kind]
