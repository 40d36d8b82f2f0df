"""The real train step and decode step compiled for a config's mesh, against abstract parameters.

`scripts/train.py --dry_run --dry_run_devices=8` runs this on 8 virtual CPU devices: no weights,
no accelerator. XLA lowers and compiles the same programs a run on 8 accelerators would (the SPMD
partitioning, the scanned layer, the remat policy) and its memory analysis says what each device
holds: arguments (parameters, optimiser state, the batch), outputs, and temporaries (activations
kept for the backward pass, gradients, workspace). Compiled for the CPU backend, so the figures
are XLA:CPU's buffer assignment, not the GPU's: kernels, fusion and layouts differ, so the
temporaries are an estimate of the same order, not a promise. The parameter, optimiser and batch
bytes are exact.

The train step's batch is the shared-prompt layout (prompts [B, P], completions [B * G, T]) at
the config's largest shapes (max_prompt_len, max_completion_len); the decode step is one token
for all B * G rows against the prompt cache (P slots) and the rows' own cache (T slots).
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from mmr_jax.config import config_types
from mmr_jax.models import config as model_config
from mmr_jax.models import kv_cache, loading, sharding
from mmr_jax.step import step_batch, train_step
from mmr_jax.training import build

GIB = 2.0**30


@dataclasses.dataclass(frozen=True)
class Compiled:
    """One program's compile times (seconds) and XLA's per-device memory analysis (bytes)."""

    name: str
    trace_s: float
    lower_s: float
    compile_s: float
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int

    @property
    def peak_bytes(self) -> int:
        """Live at once on a device: arguments, outputs not aliased to them, temporaries."""
        return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes


def config_mesh(cfg: config_types.TrainConfig, devices=None, hosts=None) -> jax.sharding.Mesh:
    """The config's (data, fsdp, tensor) mesh over `devices` (default: all); `hosts[i]`, the host
    of device i, lays it as on that many hosts (virtual devices grouped as a pod's hosts)."""
    return sharding.make_mesh(*cfg.mesh.shape, devices=devices, layout=cfg.mesh.layout, hosts=hosts)


def _with_shardings(state, mesh):
    """Abstract parameters -> ShapeDtypeStructs carrying their partition rule's sharding."""

    def place(path, var):
        value = var.get_value()
        spec = sharding.named_sharding(path, tuple(value.shape), mesh)
        return var.replace(jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=spec))

    flat = [(p, place(p, v)) for p, v in nnx.to_flat_state(state)]
    return nnx.from_flat_state(flat)


def abstract_policy(
    cfg: config_types.TrainConfig, mesh, *, remat: str | None = None, unrolled: bool = False
):
    """(policy, model config, (params, frozen, rest)) of the config's model, abstract, sharded on
    `mesh`. `unrolled`: the layers' scan fully unrolled (what an unscanned model compiles; for
    benchmarks/bench_compile.py)."""
    mcfg = model_config.ModelConfig.from_hf(
        build._hf_config(cfg.model.path), remat=remat or cfg.model.remat
    )
    if unrolled:
        mcfg = dataclasses.replace(mcfg, scan_unroll=mcfg.num_layers)
    if jax.default_backend() == "gpu":  # the backend a run would use (probed); else 'xla'
        mcfg = dataclasses.replace(mcfg, attention_impl=cfg.model.attention_impl)
        impl = build.attention_choice(cfg, mcfg).implementation
        mcfg = dataclasses.replace(mcfg, attention_impl=impl)
    abstract = loading.abstract_model(
        mcfg,
        dtype=build.DTYPES[cfg.model.dtype],
        param_dtype=build.DTYPES[cfg.model.param_dtype],
        lora=build.lora_config(cfg),
    )
    policy = build.split_model(abstract)
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


def _abstract_state(cfg, params, mesh) -> train_step.TrainState:
    optimizer, _ = build.make_optimizer(cfg)
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


def abstract_batch(cfg: config_types.TrainConfig, mesh) -> train_step.Batch:
    """The step's largest shared-prompt batch, split over the mesh's (data, fsdp) axes; an
    array whose rows do not divide is replicated, as the trainer places it
    (`distributed.row_sharding`; e.g. 8 prompts on 16 devices)."""
    from mmr_jax import distributed

    b, g = cfg.batch.prompts, cfg.batch.generations
    p, t = cfg.batch.max_prompt_len, cfg.batch.max_completion_len

    def arr(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=distributed.row_sharding(shape, mesh))

    n = b * g
    return train_step.Batch(
        tokens=arr((n, t), jnp.int32),
        attention_mask=arr((n, t), jnp.bool_),
        completion_mask=arr((n, t), jnp.bool_),
        advantages=arr((n,), jnp.float32),
        old_logps=arr((n, t), jnp.float32) if step_batch.needs_old_logps(cfg) else None,
        ref_logps=arr((n, t), jnp.float32) if cfg.loss.beta > 0 else None,
        sampler_logps=arr((n, t), jnp.float32) if cfg.loss.tis_cap > 0 else None,
        prompt_tokens=arr((b, p), jnp.int32),
        prompt_mask=arr((b, p), jnp.bool_),
    )


def measure(name: str, jitted, *args) -> tuple[Compiled, Any]:
    """Traces, lowers and compiles `jitted` for `args`, each timed; -> (figures, executable)."""
    t0 = time.perf_counter()
    traced = jitted.trace(*args)
    t1 = time.perf_counter()
    lowered = traced.lower()
    t2 = time.perf_counter()
    compiled = lowered.compile()
    t3 = time.perf_counter()
    mem = compiled.memory_analysis()
    figures = Compiled(
        name=name,
        trace_s=t1 - t0,
        lower_s=t2 - t1,
        compile_s=t3 - t2,
        argument_bytes=int(mem.argument_size_in_bytes),
        output_bytes=int(mem.output_size_in_bytes),
        alias_bytes=int(mem.alias_size_in_bytes),
        temp_bytes=int(mem.temp_size_in_bytes),
    )
    return figures, compiled


def train_step_program(cfg, mesh, *, remat: str | None = None, unrolled: bool = False):
    """(the trainer's jitted train step, its abstract arguments) for the largest batch."""
    policy, _, (params, frozen, rest) = abstract_policy(cfg, mesh, remat=remat, unrolled=unrolled)
    optimizer, schedule = build.make_optimizer(cfg)
    step = train_step.jit_train_step(
        graphdef=build.train_graphdef(cfg, policy),
        optimizer=optimizer,
        schedule=schedule,
        cfg=build.step_config(cfg),
    )
    state = _abstract_state(cfg, params, mesh)
    return step, (state, abstract_batch(cfg, mesh), frozen, rest)


def decode_step_program(cfg, mesh, *, unrolled: bool = False):
    """(one jitted decode step of the sampler's model for all B * G rows, its abstract args).

    The weights are fed in the compute dtype, as the sampler feeds them
    (`sampler.sampling_weights`: a copy cast once per weight version), not the fp32 masters:
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


def compile_train_step(cfg: config_types.TrainConfig, mesh, *, remat: str | None = None):
    """The trainer's jitted train step, lowered and compiled on `mesh` for the largest batch."""
    step, args = train_step_program(cfg, mesh, remat=remat)
    return measure(f"train step (remat {remat or cfg.model.remat})", step, *args)[0]


def compile_decode_step(cfg: config_types.TrainConfig, mesh) -> Compiled:
    """One decode step of the embedded sampler's model for all B * G rows, on `mesh`."""
    step, args = decode_step_program(cfg, mesh)
    return measure("decode step", step, *args)[0]


def run(cfg: config_types.TrainConfig, *, policies=None, hosts=None) -> dict[str, Any]:
    """Compiles the train step (for each remat policy in `policies`, default: the config's) and
    the decode step on the config's mesh over this host's devices (`hosts`: as `config_mesh`);
    returns the figures."""
    mesh = config_mesh(cfg, hosts=hosts)
    policies = policies or (cfg.model.remat,)
    out = {"mesh": dict(mesh.shape), "devices": math.prod(mesh.shape.values()), "programs": []}
    out["hosts"] = len(set(hosts)) if hosts is not None else jax.process_count()
    for policy in policies:
        out["programs"].append(compile_train_step(cfg, mesh, remat=policy))
    out["programs"].append(compile_decode_step(cfg, mesh))
    return out


def format_table(result: dict[str, Any]) -> str:
    """One line per program: compile seconds and per-device GiB from XLA's memory analysis."""
    mesh = "x".join(str(v) for v in result["mesh"].values())
    lines = [
        f"compiled on {result['devices']} devices ({result.get('hosts', 1)} host(s)), "
        f"mesh (data, fsdp, tensor) = {mesh}; "
        "per device, from XLA's memory analysis (GiB):",
        f"{'program':50s} {'lower s':>8s} {'compile s':>9s} {'arguments':>9s} "
        f"{'outputs':>8s} {'aliased':>8s} {'temp':>8s} {'peak':>8s}",
    ]
    for c in result["programs"]:
        lines.append(
            f"{c.name:50s} {c.trace_s + c.lower_s:8.1f} {c.compile_s:9.1f} "
            f"{c.argument_bytes / GIB:9.2f} "
            f"{c.output_bytes / GIB:8.2f} {c.alias_bytes / GIB:8.2f} {c.temp_bytes / GIB:8.2f} "
            f"{c.peak_bytes / GIB:8.2f}"
        )
    return "\n".join(lines)


# ----- sizes without compiling ------------------------------------------------------------------


def dry_run_mesh_sizes(
    cfg: config_types.TrainConfig, *, hosts: int, devices_per_host: int
) -> dict[str, int]:
    """The (data, fsdp, tensor) sizes `make_mesh` gives `cfg.mesh` on `hosts` x `devices_per_host`
    devices (`sharding.mesh_sizes`: its layout and errors). A shape written in full is taken as
    written, whether or not these devices fit it (a pod's mesh dry-run on a laptop)."""
    shape = tuple(cfg.mesh.shape)
    if -1 not in shape:
        return dict(zip(sharding.AXES, shape, strict=True))
    return sharding.mesh_sizes(
        shape, hosts=hosts, devices_per_host=devices_per_host, layout=cfg.mesh.layout
    )


def dry_run(cfg: config_types.TrainConfig) -> dict[str, Any]:
    """Builds model, optimiser state and mesh abstractly (no weights); returns, logs the sizes.

    The mesh is the one this cluster's run builds (`dry_run_mesh_sizes` over its processes).
    """
    from mmr_jax.models import dry_run as model_dry_run

    mcfg = model_config.ModelConfig.from_hf(build._hf_config(cfg.model.path), remat=cfg.model.remat)
    lora = build.lora_config(cfg)
    abstract = loading.abstract_model(
        mcfg,
        dtype=build.DTYPES[cfg.model.dtype],
        param_dtype=build.DTYPES[cfg.model.param_dtype],
        lora=lora,
    )
    trainable = nnx.LoRAParam if lora is not None else nnx.Param
    _, params, _, _ = nnx.split(abstract, trainable, nnx.Param, ...)
    optimizer, _ = build.make_optimizer(cfg)
    opt_state = jax.eval_shape(optimizer.init, params)
    granules = len({sharding.granule(d) for d in jax.devices()})  # hosts, or TPU slices
    mesh = model_dry_run.MeshShape(
        **dry_run_mesh_sizes(cfg, hosts=granules, devices_per_host=jax.device_count() // granules)
    )
    out = model_dry_run.summarize(
        mcfg, mesh=mesh, lora=lora, param_dtype=build.DTYPES[cfg.model.param_dtype]
    )
    out["opt_state_gib"] = (
        sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(opt_state))
        / 2**30
    )
    out["params_total"] = out["params"] + out["lora_params"]
    logging.info("dry run %s (%s)", cfg.name, mcfg.model_type)
    logging.info("%s", model_dry_run.format_summary(cfg.name, out))
    logging.info(
        "%s params, %s trainable; optimiser state %.2f GiB in all",
        f"{out['params_total']:,}",
        f"{out['trainable']:,}",
        out["opt_state_gib"],
    )
    return out
