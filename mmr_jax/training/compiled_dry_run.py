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
import numpy as np
from absl import logging
from flax import nnx

from mmr_jax.config import schema
from mmr_jax.models import config as model_config
from mmr_jax.models import loading, sharding
from mmr_jax.step import train_step
from mmr_jax.training import build, dry_run_programs

# The programs, built in dry_run_programs (re-exported: the benchmarks and tests import them here).
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
    # The compiler's cost model (`compiled.cost_analysis()`): flops and, on a TPU, its own
    # estimate of the program's run time (None where the backend gives none, or gives <= 0). Both
    # count a loop's body once, whatever its trip count (the scanned layers, the minibatches, the
    # decode loop), so neither is the program's total; libtpu scores an additive scatter into two
    # indexed dimensions (the gradient of the log-prob's gather) as -2 s, so a train step's raw
    # figure (`optimal_seconds_raw`) is negative (tests/training/tpu_cost_model_test.py).
    flops: float | None = None
    optimal_seconds: float | None = None
    optimal_seconds_raw: float | None = None

    @property
    def peak_bytes(self) -> int:
        """Live at once on a device: arguments, outputs not aliased to them, temporaries."""
        return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes


def config_mesh(cfg: schema.TrainConfig, devices=None, hosts=None) -> jax.sharding.Mesh:
    """The config's (data, fsdp, tensor) mesh over `devices` (default: all); `hosts[i]`, the host
    of device i, lays it as on that many hosts (virtual devices grouped as a pod's hosts)."""
    return sharding.make_mesh(
        *cfg.mesh.shape, devices=devices, over_hosts=cfg.mesh.over_hosts, hosts=hosts
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
    cost = _cost(compiled)
    estimate = cost.get("optimal_seconds")
    figures = Compiled(
        name=name,
        trace_s=t1 - t0,
        lower_s=t2 - t1,
        compile_s=t3 - t2,
        argument_bytes=int(mem.argument_size_in_bytes),
        output_bytes=int(mem.output_size_in_bytes),
        alias_bytes=int(mem.alias_size_in_bytes),
        temp_bytes=int(mem.temp_size_in_bytes),
        flops=cost.get("flops"),
        optimal_seconds=estimate if estimate is not None and estimate > 0 else None,
        optimal_seconds_raw=estimate,
    )
    return figures, compiled


def _cost(compiled) -> dict[str, float]:
    """`cost_analysis()` as one dict (a list of one per program in some JAX versions)."""
    try:
        cost = compiled.cost_analysis()
    except Exception:  # a backend without a cost model
        return {}
    if isinstance(cost, list | tuple):
        cost = cost[0] if cost else {}
    return {k: float(v) for k, v in (cost or {}).items() if k in ("flops", "optimal_seconds")}


def compile_train_step(cfg: schema.TrainConfig, mesh, *, remat: str | None = None):
    """The trainer's jitted train step, lowered and compiled on `mesh` for the largest batch."""
    step, args = dry_run_programs.train_step_program(cfg, mesh, remat=remat)
    return measure(f"train step (remat {remat or cfg.model.remat})", step, *args)[0]


def compile_decode_step(cfg: schema.TrainConfig, mesh) -> Compiled:
    """One decode step of the embedded sampler's model for all B * G rows, on `mesh`."""
    step, args = dry_run_programs.decode_step_program(cfg, mesh)
    return measure("decode step", step, *args)[0]


def run(cfg: schema.TrainConfig, *, policies=None, hosts=None) -> dict[str, Any]:
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
    cfg: schema.TrainConfig, *, hosts: int, devices_per_host: int
) -> dict[str, int]:
    """The (data, fsdp, tensor) sizes `make_mesh` gives `cfg.mesh` on `hosts` x `devices_per_host`
    devices (`sharding.mesh_sizes`: its layout and errors). A shape written in full is taken as
    written, whether or not these devices fit it (a pod's mesh dry-run on a laptop)."""
    shape = tuple(cfg.mesh.shape)
    if -1 not in shape:
        return dict(zip(sharding.AXES, shape, strict=True))
    return sharding.mesh_sizes(
        shape, hosts=hosts, devices_per_host=devices_per_host, over_hosts=cfg.mesh.over_hosts
    )


def dry_run(cfg: schema.TrainConfig) -> dict[str, Any]:
    """Builds model, optimiser state and mesh abstractly (no weights); returns, logs the sizes.

    The mesh is the one this cluster's run builds (`dry_run_mesh_sizes` over its processes).
    """
    from mmr_jax.models import dry_run as model_dry_run

    mcfg = model_config.ModelConfig.from_hf(
        model_config.config_file(cfg.model.path), remat=cfg.model.remat
    )
    lora = build.lora_config(cfg)
    frozen_dtype = build.DTYPES.get(cfg.model.frozen_dtype)  # '' -> param_dtype, as a run
    abstract = loading.abstract_model(
        mcfg,
        dtype=build.DTYPES[cfg.model.dtype],
        param_dtype=build.DTYPES[cfg.model.param_dtype],
        lora=lora,
        frozen_dtype=frozen_dtype,
    )
    trainable = nnx.LoRAParam if lora is not None else nnx.Param
    _, params, _, _ = nnx.split(abstract, trainable, nnx.Param, ...)
    optimizer, _ = train_step.make_optimizer(cfg.optim, total_updates=cfg.total_updates)
    opt_state = jax.eval_shape(optimizer.init, params)
    granules = len({sharding.granule(d) for d in jax.devices()})  # hosts, or TPU slices
    mesh = model_dry_run.MeshShape(
        **dry_run_mesh_sizes(cfg, hosts=granules, devices_per_host=jax.device_count() // granules)
    )
    out = model_dry_run.summarize(
        mcfg,
        mesh=mesh,
        lora=lora,
        param_dtype=build.DTYPES[cfg.model.param_dtype],
        frozen_dtype=frozen_dtype,
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
