"""Every program a run compiles, compiled by a TPU's or GPU's own compiler, without the device.

`scripts/train.py --config=... --dry_run --dry_run_target=h100:8` runs `run`: the target's
compile-only devices (`infra.aot_targets`), the config's mesh over them, and for each program a
run there compiles (`dry_run_programs`) the real compiler's figures per device: arguments,
outputs, temporaries, the program's peak, and the peak with what the run keeps on the device
beside the program (`Row.resident_bytes`), against the device's memory; the compile time; on a
TPU the compiler's own step-time estimate (`optimal_seconds` of `cost_analysis()`).

The programs: the train step for each remat policy asked and each attention backend a run there
may use (`attention_plan`), the log-prob pass when the config computes reference or old
log-probs, and the embedded sampler's prefill and decode loop (a TPU has no vLLM; on a GPU the
embedded engine is the fallback and the evaluator).

What it promises: the same compiler, partitioner, fusion and buffer assignment as a run on the
target, so "does not compile" is real, and the memory figures are the compiler's for that
program. What it does not: no GPU autotuning (kernels are the compiler's defaults), no
fragmentation or framework overhead (JAX's allocator, NCCL buffers, the CUDA context), and
`optimal_seconds` is the TPU compiler's cost model, not a measurement.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax

from mmr_jax.config import schema
from mmr_jax.infra import aot_targets
from mmr_jax.kernels import compile_platform
from mmr_jax.models import attention_impl, attention_probe
from mmr_jax.models import config as model_config
from mmr_jax.training import build, compiled_dry_run, dry_run_programs

GIB = 2.0**30


@dataclasses.dataclass(frozen=True)
class Row:
    """One program on the target: its figures, or why it did not compile."""

    name: str
    figures: compiled_dry_run.Compiled | None
    error: str | None = None
    # Bytes a device holds beside the program's own buffers while it runs: the trainer's state
    # (parameters, optimiser state) when the program does not take it as an argument, and the
    # sampler's compute-dtype copy of the weights, which the embedded engine keeps between calls.
    resident_bytes: int = 0
    required: bool = True  # False: compiled to inform (a backend the config does not choose)
    note: str = ""

    @property
    def total_bytes(self) -> int | None:
        return None if self.figures is None else self.figures.peak_bytes + self.resident_bytes


def attention_plan(cfg: schema.TrainConfig, mcfg, target) -> list[tuple[str, str, bool]]:
    """[(backend, why, required)] of the training forwards on `target`, by the start-up rule
    (`attention_probe.choose`): 'auto' cannot probe without a device, so on a GPU its first
    candidate and the 'xla' fallback are both compiled; cuDNN needs bf16/fp16. Raises ValueError
    where a run's start-up would refuse the configured backend."""
    impl, dtype, d = cfg.model.attention_impl, build.DTYPES[cfg.model.dtype], mcfg.head_dim
    eligible = attention_impl.cudnn_eligible(dtype, d)
    cudnn = impl in ("cudnn", "cudnn_maskfree")
    if target.platform == "cuda":
        if impl == "auto" and not eligible:
            return [("unfused", f"auto: cuDNN takes no {jax.numpy.dtype(dtype).name}", True)]
        if impl == "auto":
            first = attention_probe.CANDIDATES[0]
            return [
                (first, "auto: the first form a run probes (no device here to probe)", True),
                ("xla", "auto: the fallback when the probe rejects every cuDNN form", True),
            ]
        if cudnn and not eligible:
            raise ValueError(
                f"attention_impl={impl!r}: cuDNN takes no {jax.numpy.dtype(dtype).name} with "
                f"head dim {d}; a run refuses it at start-up (use 'auto' or 'xla')"
            )
        return [(impl, "configured", True)]
    if cudnn:
        raise ValueError(f"attention_impl={impl!r} is a GPU backend; a TPU run refuses it")
    if impl == "auto":  # the start-up rule itself: splash, or 'unfused' with packed completions
        return [(*attention_impl.auto_off_gpu("tpu", cfg.batch.layout == "packed"), True)]
    return [(impl, "configured", True)]


def per_device_bytes(tree) -> int:
    """Bytes one device holds of an abstract tree (each leaf's shard under its sharding)."""
    total = 0
    for x in jax.tree.leaves(tree):
        shape = x.sharding.shard_shape(x.shape) if x.sharding is not None else x.shape
        total += math.prod(shape) * x.dtype.itemsize
    return total


def _sampler_copy_bytes(master, sampler_state) -> int:
    """Bytes a device holds of the sampler's weights that are a copy (a cast of a master leaf);
    leaves already in the compute dtype are the model's own arrays
    (`sampler_weights.sampling_weights`)."""
    masters = {x.dtype for x in jax.tree.leaves(master)}
    copied = [x for x in jax.tree.leaves(sampler_state) if x.dtype not in masters]
    if len(masters) == 1 and not copied:
        return 0
    return per_device_bytes(copied)


def _compile(name, build_program, *, resident=0, required=True, note=""):
    """Builds and compiles one program -> (Row, (fn, args, executable) or None); any failure is
    the row's error (one line)."""
    try:
        fn, args = build_program()
        figures, compiled = compiled_dry_run.measure(name, fn, *args)
    except Exception as e:  # the compiler's or the program's own error, named by the report
        text = str(e).strip().splitlines()
        error = f"{type(e).__name__}: {text[0][:300] if text else ''}"
        return Row(name, None, error, 0, required, note), None
    return Row(name, figures, None, resident, required, note), (fn, args, compiled)


def _sampler_rows(cfg, mesh, policy, master, trainer_bytes) -> list[Row]:
    """The embedded sampler's prefill and decode loop (the loop takes the prefill's cache with
    the shardings the compiled prefill gives it)."""
    graphdef, weights, dp = dry_run_programs.sampler_weights(cfg, mesh, policy, master)
    # Beside the sampler's arguments (its weights) the trainer's state stays on the device, less
    # the leaves the sampler reads as they are (not a copy).
    shared = per_device_bytes(weights) - _sampler_copy_bytes(master, weights)
    beside = max(trainer_bytes - shared, 0)
    prefill, done = _compile(
        "sampler prefill",
        lambda: dry_run_programs.prefill_program(cfg, mesh, graphdef, weights, dp),
        resident=beside,
    )
    if done is None:
        return [prefill]
    fn, args, compiled = done
    cache = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        jax.eval_shape(fn, *args),
        compiled.output_shardings,
    )
    loop, _ = _compile(
        "sampler decode loop",
        lambda: dry_run_programs.decode_loop_program(cfg, mesh, graphdef, weights, dp, cache),
        resident=beside,
        note="the first call, all B x G rows (the compacted calls after it run fewer)",
    )
    return [prefill, loop]


def run(cfg: schema.TrainConfig, target, *, policies=None) -> dict[str, Any]:
    """Compiles the run's programs for `target` (an `aot_targets.Target`); returns the report:
    the target, the mesh, the attention plan and one `Row` a program."""
    devices = aot_targets.compile_only_devices(target)
    mesh = compiled_dry_run.config_mesh(cfg, devices=devices)
    mcfg = model_config.ModelConfig.from_hf(model_config.config_file(cfg.model.path))
    out = {
        "target": target.name,
        "description": target.describe(),
        "memory_bytes": target.accelerator.memory_bytes,
        "mesh": dict(mesh.shape),
        "devices": len(devices),
        "hosts": target.hosts,
        "attention": [],
        "rows": [],
    }
    try:
        plan = attention_plan(cfg, mcfg, target)
    except ValueError as e:
        out["rows"].append(Row("train step", None, str(e)))
        return out
    out["attention"] = [(impl, why) for impl, why, _ in plan]
    rows = out["rows"]
    with compile_platform.compiling_for("gpu" if target.platform == "cuda" else "tpu"):
        policy, _, master = dry_run_programs.abstract_policy(cfg, mesh, attention=plan[0][0])
        state = dry_run_programs.abstract_state(cfg, master[0], mesh)
        trainer_bytes = per_device_bytes((state, master[1], master[2]))
        _, weights, _ = dry_run_programs.sampler_weights(cfg, mesh, policy, master)
        embedded = cfg.rollout.engine == "embedded"
        copy = _sampler_copy_bytes(master, weights) if embedded else 0
        for remat in policies or (cfg.model.remat,):
            for impl, why, required in plan:
                program = functools.partial(
                    dry_run_programs.train_step_program, cfg, mesh, remat=remat, attention=impl
                )
                name = f"train step (remat {remat}, attention {impl})"
                rows.append(_compile(name, program, resident=copy, required=required, note=why)[0])
        logp = dry_run_programs.logprob_program(cfg, mesh, attention=plan[0][0])
        if logp is not None:
            resident = per_device_bytes(state.opt_state) + copy
            rows.append(_compile("log-prob pass", lambda: logp, resident=resident)[0])
        rows.extend(_sampler_rows(cfg, mesh, policy, master, trainer_bytes))
    return out


def failures(result: dict[str, Any]) -> list[str]:
    """One line per required program that does not compile or does not fit ([] when all do)."""
    memory, out = result["memory_bytes"], []
    for row in result["rows"]:
        if not row.required:
            continue
        if row.error is not None:
            out.append(f"{row.name} does not compile for {result['target']}: {row.error}")
        elif row.total_bytes > memory:
            out.append(
                f"{row.name} does not fit on {result['target']}: {row.total_bytes / GIB:.2f} GiB "
                f"a device > {memory / GIB:.1f} GiB"
            )
    return out


def format_report(result: dict[str, Any]) -> str:
    """The report as a table, one line per program (GiB per device), and its notes."""
    memory = result["memory_bytes"]
    mesh = "x".join(str(v) for v in result["mesh"].values())
    lines = [
        f"{result['description']}; mesh (data, fsdp, tensor) = {mesh}",
        "per device, from the target compiler's memory analysis (GiB); 'beside': what the run "
        "keeps on the device beside the program; 'total' = peak + beside",
        f"{'program':46s} {'compile s':>9s} {'args':>7s} {'outputs':>7s} {'temp':>7s} "
        f"{'peak':>7s} {'beside':>7s} {'total':>7s} {'of mem':>6s} {'est. s':>7s}",
    ]
    for row in result["rows"]:
        c = row.figures
        if c is None:
            lines.append(f"{row.name:46s} FAILED: {row.error}")
            continue
        est = f"{c.optimal_seconds:7.3f}" if c.optimal_seconds else f"{'-':>7s}"
        lines.append(
            f"{row.name:46s} {c.compile_s:9.1f} {c.argument_bytes / GIB:7.2f} "
            f"{c.output_bytes / GIB:7.2f} {c.temp_bytes / GIB:7.2f} {c.peak_bytes / GIB:7.2f} "
            f"{row.resident_bytes / GIB:7.2f} {row.total_bytes / GIB:7.2f} "
            f"{row.total_bytes / memory:6.0%} {est}"
        )
    for impl, why in result["attention"]:
        lines.append(f"attention {impl}: {why}")
    if any(
        r.figures is not None and r.figures.optimal_seconds_raw is not None for r in result["rows"]
    ):
        lines.append(
            "est. s: the TPU compiler's cost model (optimal_seconds), a loop's body counted once "
            "(the scanned layers, the minibatches, the decode loop): not the program's time; '-' "
            "where it is <= 0 (libtpu scores an additive scatter as -2 s)"
        )
    for row in result["rows"]:
        if row.figures is not None and not row.required and row.total_bytes > memory:
            lines.append(f"(informational) {row.name} would not fit")
        if row.error is not None and not row.required:
            lines.append(f"(informational, not this config's backend) {row.name} failed")
    return "\n".join(lines)


def to_json(result: dict[str, Any]) -> dict[str, Any]:
    """The report as plain JSON (bytes and seconds)."""
    out = {k: v for k, v in result.items() if k != "rows"}
    out["rows"] = [
        {
            "name": r.name,
            "required": r.required,
            "error": r.error,
            "note": r.note,
            "resident_bytes": r.resident_bytes,
            "total_bytes": r.total_bytes,
            "fits": r.error is None and r.total_bytes <= result["memory_bytes"],
            **(dataclasses.asdict(r.figures) if r.figures is not None else {}),
            **({"peak_bytes": r.figures.peak_bytes} if r.figures is not None else {}),
        }
        for r in result["rows"]
    ]
    out["failures"] = failures(result)
    return out
