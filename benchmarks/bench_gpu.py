"""A config's train step and decode step on this host's accelerator: time, throughput, MFU, memory.

    python benchmarks/bench_gpu.py --configs=configs/grpo.py:1.5b,configs/grpo_7b.py
    python benchmarks/bench_gpu.py --configs=configs/grpo.py:1.5b \\
        --set=batch.max_completion_len=1024 --set=loss.minibatches=4 --steps=5 --json=out.json

Each config runs in its own child process (so each one's device peak is its own), on random
weights of its model's real shapes (the checkpoint is not read: `third_party/hf_configs` gives the
architecture), at the config's dtypes, LoRA, remat policy, mesh and largest batch, exactly the
programs `scripts/train.py --dry_run --dry_run_devices=N` compiles (`training/compiled_dry_run`),
here compiled for the real backend and run.

Per config and program: compile seconds; XLA's memory analysis of the compiled program (per
device) and the device's own peak bytes in use; the steady time of a call (median of `--steps`
calls after one warm-up call). For the train step: tokens per second (prompt tokens once per
group, as the shared-prompt layout computes them, plus every completion token) and MFU, the
model FLOPs of the step over its time and the device's dense bf16 peak. Model FLOPs
(`gpu_flops.train_flops`, beside this file with the devices' peaks) count the matmuls and causal
attention, forward 2 FLOPs per multiply-add, the backward twice the forward for a full fine-tune
and once for LoRA (activation gradients only; the adapters' own FLOPs are left out), and no remat
recomputation: MFU in PaLM's sense, not the hardware's utilisation. For the decode step (one
token for all B * G rows against the prompt cache and the rows' own cache, both full): rows per
second, and the bytes its arguments hold (weights and caches, what one step must read) over its
time, against the device's peak memory bandwidth.
"""

from __future__ import annotations

import json
import pathlib
import sys

import gpu_flops  # benchmarks/, beside this file
from absl import flags

_REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(_REPO))
from mmr_jax.infra import bench_harness as harness  # noqa: E402
from mmr_jax.infra import user_errors  # noqa: E402

_CONFIGS = flags.DEFINE_list(
    "configs", ["configs/grpo.py:1.5b", "configs/grpo_7b.py"], "config files (path[:arg])"
)
_SET = flags.DEFINE_multi_string("set", [], "dotted config overrides for every config, key=value")
_STEPS = flags.DEFINE_integer("steps", 5, "timed calls per program (median reported)")
_PROGRAMS = flags.DEFINE_list("programs", ["train", "decode"], "train, decode")
_JSON = flags.DEFINE_string("json", None, "also write the rows to this JSON file")
_CHILD_TIMEOUT = flags.DEFINE_integer("child_timeout_s", 0, "stop a config after this (0: never)")
_CHILD = flags.DEFINE_string("child", None, "internal: run one config here, print one JSON line")

GIB = 2.0**30


def _load(spec: str, overrides: list[str]):
    """The config file's TrainConfig with `key=value` overrides (values as Python literals,
    else strings: `batch.max_completion_len=1024`, `model.path=/ckpt`)."""
    from mmr_jax.config import checks, command_line

    parsed = command_line.parse_assignments(overrides)
    config = command_line.set_keys(command_line.load_config_file(spec), parsed)
    return checks.from_config_dict(config)


def run_config(
    spec: str, overrides: list[str], steps: int, programs: list[str], on_progress=None
) -> dict:
    """One config's rows (in this process); `on_progress(result)` after each measurement (the
    result so far: a time limit that stops the process keeps it)."""
    on_progress = on_progress or (lambda result: None)
    import jax

    from mmr_jax.models import config as model_config
    from mmr_jax.training import compiled_dry_run, dry_run_programs

    cfg = _load(spec, overrides)
    mesh = compiled_dry_run.config_mesh(cfg)
    mcfg = model_config.ModelConfig.from_hf(model_config.config_file(cfg.model.path))
    device = jax.local_devices()[0]
    tflops_peak, tbps_peak = gpu_flops.device_peaks(device.device_kind)
    b, g = cfg.batch.prompts, cfg.batch.generations
    p, t = cfg.batch.max_prompt_len, cfg.batch.max_completion_len
    result = {
        "config": spec,
        "overrides": overrides,
        "device": device.device_kind,
        "devices": len(jax.devices()),
        "model": cfg.model.path,
        "lora": bool(cfg.lora.enabled),
        "remat": cfg.model.remat,
        "dtype": f"{cfg.model.dtype}/{cfg.model.param_dtype}",
        "shape": {"prompts": b, "generations": g, "prompt_len": p, "completion_len": t},
        "minibatches": cfg.loss.minibatches,
    }
    for program in programs:
        fn, args, donated = dry_run_programs.program(program, cfg, mesh)
        harness.progress(f"{program}: compiling")
        measured, compiled = compiled_dry_run.measure(program, fn, *args)
        harness.progress(f"{program}: compiled in {measured.compile_s + measured.lower_s:.1f} s")
        result[program] = {
            "compile_s": measured.trace_s + measured.lower_s + measured.compile_s,
            "xla_peak_gib": measured.peak_bytes / GIB,
            "partial": True,
        }
        on_progress(result)
        concrete = list(harness.random_on_device(args))
        # The first call (autotuning, allocation) apart; the donated state is carried over.
        timing = harness.steady_calls(compiled, concrete, steps=steps, donated=donated)
        first_s, step_s = timing.first_s, timing.median_s
        harness.progress(f"{program}: first call {first_s:.2f} s, step {step_s:.3f} s")
        row = {
            "compile_s": measured.trace_s + measured.lower_s + measured.compile_s,
            "first_call_s": first_s,
            "step_s": step_s,
            "xla_argument_gib": measured.argument_bytes / GIB,
            "xla_temp_gib": measured.temp_bytes / GIB,
            "xla_peak_gib": measured.peak_bytes / GIB,
            "device_peak_gib": peak / GIB if (peak := harness.jax_peak_bytes()) else None,
        }
        if program == "train":
            flops = gpu_flops.train_flops(
                mcfg,
                lora=bool(cfg.lora.enabled),
                prompts=b,
                generations=g,
                prompt_len=p,
                completion_len=t,
            )
            row["tokens_per_s"] = gpu_flops.step_tokens(b, g, p, t) / step_s
            row["model_tflops_per_s"] = flops / step_s / 1e12 / result["devices"]
            row["mfu"] = row["model_tflops_per_s"] / tflops_peak if tflops_peak else None
        else:
            row["rows_per_s"] = b * g / step_s
            row["read_tb_per_s"] = measured.argument_bytes / step_s / 1e12
            row["bandwidth_share"] = row["read_tb_per_s"] / tbps_peak if tbps_peak else None
        result[program] = row
        on_progress(result)
        del concrete, compiled
        jax.clear_caches()
    return result


def format_table(results: list[dict]) -> str:
    fmt, lines = harness.fmt, []
    for r in results:
        if "error" in r:
            lines.append(f"{r['config']}: FAILED: {r['error']}")
            continue
        s = r["shape"]
        lines.append(
            f"{r['config']} on {r['devices']} x {r['device']}: {r['model']} "
            f"({'LoRA' if r['lora'] else 'full'}, {r['dtype']}, remat {r['remat']}), "
            f"{s['prompts']} prompts x {s['generations']}, prompt {s['prompt_len']}, "
            f"completion {s['completion_len']}, {r['minibatches']} minibatches"
        )
        lines.append(
            f"  {'program':8s} {'compile s':>9s} {'1st call s':>10s} {'step s':>8s} "
            f"{'tokens/s':>9s} {'TFLOP/s':>8s} {'MFU':>6s} {'rows/s':>8s} {'read TB/s':>9s} "
            f"{'BW':>6s} {'XLA peak':>9s} {'dev peak':>9s}"
        )
        for program in ("train", "decode"):
            row = r.get(program)
            if row is None:
                continue
            lines.append(
                f"  {program:8s} {row['compile_s']:9.1f} {row['first_call_s']:10.2f} "
                f"{row['step_s']:8.3f} {fmt(row.get('tokens_per_s'), '9.0f'):>9s} "
                f"{fmt(row.get('model_tflops_per_s'), '8.1f'):>8s} "
                f"{fmt(row.get('mfu'), '6.1%'):>6s} {fmt(row.get('rows_per_s'), '8.0f'):>8s} "
                f"{fmt(row.get('read_tb_per_s'), '9.2f'):>9s} "
                f"{fmt(row.get('bandwidth_share'), '6.1%'):>6s} "
                f"{row['xla_peak_gib']:8.2f}G {fmt(row['device_peak_gib'], '8.2f'):>8s}G"
            )
    return "\n".join(lines)


def main(argv):
    del argv
    if _CHILD.value:
        # The parent's results so far, then this config's as it goes (--json's file).
        path = pathlib.Path(_JSON.value) if _JSON.value else None
        done = json.loads(path.read_text()) if path and path.exists() else []

        def on_progress(result):
            harness.write_json(path, [*done, {**result, "partial": True}])

        harness.emit(
            run_config(_CHILD.value, _SET.value, _STEPS.value, _PROGRAMS.value, on_progress)
        )
        return
    results = []
    harness.write_json(_JSON.value, results)
    for spec in _CONFIGS.value:
        args = [
            f"--child={spec}",
            f"--steps={_STEPS.value}",
            f"--programs={','.join(_PROGRAMS.value)}",
        ]
        args += [f"--set={s}" for s in _SET.value]
        args += [f"--json={_JSON.value}"] if _JSON.value else []
        print(f"running {spec} ...", flush=True)
        result = harness.run_child(
            harness.self_argv(__file__, *args), timeout_s=_CHILD_TIMEOUT.value
        )
        results.append(result if "error" not in result else {"config": spec, **result})
        print(format_table(results[-1:]), flush=True)
        harness.write_json(_JSON.value, results)  # after every config: a timeout keeps the rest
    print("\n" + format_table(results), flush=True)
    if any("error" in r for r in results):
        sys.exit(1)


if __name__ == "__main__":
    user_errors.run(main)
