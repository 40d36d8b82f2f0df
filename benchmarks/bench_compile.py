"""Compile time of the train step and the decode step: layers scanned against unrolled.

    python benchmarks/bench_compile.py                       # SmolLM2 (1 device) and 7B (8 devices)
    python benchmarks/bench_compile.py --models=smollm2 --steps=5 --json=bench_compile.json
    python benchmarks/bench_compile.py --train_run=8     # compilation's share of a CPU-default run
    python benchmarks/bench_compile.py --train_run=8 --compile_price_steps=1,0   # with / without
                                                      # padding to compiled lengths (shape_reuse)
    python benchmarks/bench_compile.py --train_run=8 --programs=20   # which programs the run built
    python benchmarks/bench_compile.py --train_run=8 --xla_cache=warm  # a second run of the config:
                                                      # XLA's on-disk cache filled by a first one
    python benchmarks/bench_compile.py --compare_options=xla_cpu_use_fusion_emitters=false --steps=9
                                                      # XLA options against the defaults (SmolLM2)

For each model and program, in one process: trace, lower and compile seconds with the layers
run by one scan (what the trainer compiles) and fully unrolled (`scan_unroll = num_layers`: the
straight-line program of an unscanned model, the baseline), XLA's per-device temporary memory,
and, for SmolLM2 (which this machine can run), the steady time of a call once compiled (median
of `--steps` calls on random weights and inputs of the config's shapes).

With `--compare_options`: each SmolLM2 program (scanned) is traced and lowered once, then compiled
twice, with the scripts' options and with these XLA compiler options added (`name=value`, comma
separated; JAX passes them to XLA per program), and the two executables' calls alternate
(ABAB..., so drift on a shared machine falls on both): compile seconds and median call time of
each, and their ratios.

With `--train_run=N` (the runs are in `compile_run.py`, beside this file): the CPU default trained
N steps in this process, checkpoints and evaluation off; JAX's compile seconds over the whole run
against the summed step time, per `--compile_price_steps` value, optionally per program.

Models: `smollm2` is configs/cpu_smollm2.py on one CPU device (the CPU default's shapes);
`7b` is configs/grpo_7b.py compiled against abstract parameters for its mesh on 8 virtual CPU
devices, as `scripts/train.py --dry_run --dry_run_devices=8` does (compile only: no weights).
"""

from __future__ import annotations

import pathlib
import sys
import time

import jax

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from mmr_jax.config import command_line
from mmr_jax.infra import bench_harness as harness

compile_run = harness.load("compile_run")  # benchmarks/, beside this file: --train_run

MODELS = {
    # name: (config file, devices)
    "smollm2": ("configs/cpu_smollm2.py", 1),
    "7b": ("configs/grpo_7b.py", 8),
}
PROGRAMS = ("train step", "decode step")
COLUMNS = [
    ("model", "model", ""), ("program", "program", ""), ("layers", "layers", ""),
    ("trace_s", "trace s", ".2f"), ("lower_s", "lower s", ".2f"),
    ("compile_s", "compile s", ".2f"), ("total_s", "total s", ".2f"),
    ("temp_gib", "temp GiB", ".2f"), ("steady_ms", "steady ms", ".1f"),
]  # fmt: skip


def _model(name: str):
    """(config, mesh, device count) of a `MODELS` entry."""
    from mmr_jax.training import compiled_dry_run

    path, devices = MODELS[name]
    cfg = command_line.load_config(path)
    return cfg, compiled_dry_run.config_mesh(cfg, devices=jax.devices()[:devices]), devices


def bench_model(name: str, steps: int) -> list[dict]:
    """Each program of `name` scanned and unrolled: trace, lower, compile seconds, temp memory,
    and (one device) the steady time of a call."""
    from mmr_jax.training import compiled_dry_run, dry_run_programs

    cfg, mesh, devices = _model(name)
    rows = []
    for program in PROGRAMS:
        for unrolled in (False, True):
            kind = program.split()[0]
            fn, args, donated = dry_run_programs.program(kind, cfg, mesh, unrolled=unrolled)
            measured, compiled = compiled_dry_run.measure(program, fn, *args)
            row = dict(model=name, program=program, layers="unrolled" if unrolled else "scanned")
            row |= dict(trace_s=measured.trace_s, lower_s=measured.lower_s, steady_s=None)
            row |= dict(compile_s=measured.compile_s, temp=measured.temp_bytes)
            if steps and devices == 1:
                inputs = harness.random_on_device(args)
                row["steady_s"] = harness.steady_calls(
                    compiled, inputs, steps=steps, donated=donated
                ).median_s
            rows.append(row)
            harness.progress(f"{name} {program} {row['layers']}: compile {row['compile_s']:.1f} s")
            jax.clear_caches()
    return rows


def parse_options(text: str) -> dict:
    """'a=false,b=2' -> {'a': False, 'b': 2}: XLA compiler options as JAX's `compile` takes them."""
    from mmr_jax.config import command_line

    items = [part for part in text.split(",") if part.strip()]
    try:
        return command_line.parse_assignments(items)
    except ValueError as e:
        raise ValueError(f"an XLA option is name=value: {e}") from None


def compare_options(name: str, steps: int, options: dict) -> list[dict]:
    """Each program of `name` (scanned) compiled with and without `options`, timed in turns."""
    from mmr_jax.training import dry_run_programs

    cfg, mesh, _ = _model(name)
    rows = []
    for program in PROGRAMS:
        fn, args, donated = dry_run_programs.program(program.split()[0], cfg, mesh)
        lowered = fn.trace(*args).lower()
        compiled, compile_s = [], []
        for opts in ({}, options):
            t0 = time.perf_counter()
            compiled.append(lowered.compile(compiler_options=opts or None))
            compile_s.append(time.perf_counter() - t0)
        inputs = [list(harness.random_on_device(args)) for _ in compiled]

        def call(k):
            out = jax.block_until_ready(compiled[k](*inputs[k]))
            inputs[k][donated[0]] = out[donated[1]]

        default_s, option_s = harness.alternate([lambda: call(0), lambda: call(1)], steps=steps)
        rows.append({"model": name, "program": program, "options": options, "calls": steps})
        rows[-1] |= {"compile_s": compile_s[0], "compile_s_options": compile_s[1]}
        rows[-1] |= {"steady_s": default_s, "steady_s_options": option_s}
        print(
            f"{name:8s} {program:12s} compile {compile_s[0]:6.2f} s -> {compile_s[1]:6.2f} s "
            f"({compile_s[1] / compile_s[0]:4.2f}x); call {default_s * 1e3:8.1f} ms -> "
            f"{option_s * 1e3:8.1f} ms ({option_s / default_s:5.3f}x), median of {steps} each",
            flush=True,
        )
        jax.clear_caches()
    return rows


FLAGS = {
    "models": ("smollm2,7b", "comma list of " + ",".join(MODELS)),
    "steps": (5, "timed calls per compiled program"),
    "train_run": (0, "instead: train the CPU default this many steps, compilation's share"),
    "workdir": ("/tmp/bench_compile_run", "for --train_run"),
    "compile_price_steps": (
        "",
        "for --train_run: batch.compile_price_steps, comma list, a run each",
    ),
    "programs": (0, "for --train_run: also list this many programs by compile seconds"),
    "compare_options": ("", "instead: XLA options (name=value,...) against the defaults, SmolLM2"),
    # off: every program compiled (a config's first run); warm: XLA's on-disk cache as the scripts
    # use it, filled by an unmeasured run first (a second run, a resume, a study's later runs).
    "xla_cache": ("off", "for --train_run: off or warm", ("off", "warm")),
}


def models(args) -> list[dict]:
    names = [m for m in args.models.split(",") if m]
    unknown = sorted(set(names) - set(MODELS))
    if unknown:
        sys.exit(f"unknown models {unknown}; known: {sorted(MODELS)}")
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", max(MODELS[m][1] for m in names))
    rows = [row for name in names for row in bench_model(name, args.steps)]
    shown = [
        {
            **r,
            "total_s": r["trace_s"] + r["lower_s"] + r["compile_s"],
            "temp_gib": r["temp"] / 2**30,
        }
        | {"steady_ms": None if r["steady_s"] is None else 1e3 * r["steady_s"]}
        for r in rows
    ]
    print(harness.format_table(shown, COLUMNS))
    by = {(r["model"], r["program"], r["layers"]): r for r in shown}
    print("\nscanned against unrolled (total compile seconds; steady time):")
    for name in names:
        for program in PROGRAMS:
            s, u = by[(name, program, "scanned")], by[(name, program, "unrolled")]
            line = f"  {name:8s} {program:12s} compile {u['total_s'] / s['total_s']:5.2f}x faster"
            if s["steady_s"] and u["steady_s"]:
                line += f", steady step {s['steady_s'] / u['steady_s']:5.2f}x the unrolled time"
            print(line)
    return rows


def main():
    from mmr_jax.infra import compile_cache

    args, _ = harness.parse_args(__doc__.split("\n\n")[0], FLAGS)
    # As scripts/train.py compiles on a CPU host (LLVM level 1). By default without the on-disk
    # cache: every program here is compiled, none loaded.
    compile_cache.cpu_compile_flag()
    if args.train_run:
        rows = compile_run.train_runs(args, MODELS["smollm2"][0])
    elif args.compare_options:
        options = parse_options(args.compare_options)
        print(
            f"smollm2 (configs/cpu_smollm2.py, scanned): the scripts' XLA options, then + {options}"
        )
        rows = compare_options("smollm2", args.steps, options)
    else:
        rows = models(args)
    harness.write_json(args.json, rows)


if __name__ == "__main__":
    harness.run(main)
