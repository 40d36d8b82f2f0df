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

Models: `smollm2` is configs/cpu_smollm2.py on one CPU device (the CPU default's shapes);
`7b` is configs/grpo_7b.py compiled against abstract parameters for its mesh on 8 virtual CPU
devices, as `scripts/train.py --dry_run --dry_run_devices=8` does (compile only: no weights).
"""

from __future__ import annotations

import json
import pathlib
import sys
import time

import jax

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from mmr_jax.config import config_overrides
from mmr_jax.infra import bench_harness as harness

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
PARTS = ("builds", "trace", "lower", "backend")
# builds: backend events, each an XLA compile or (warm cache) a load from disk
PROGRAM_COLUMNS = [
    ("program", "program", ""), ("builds", "builds", "d"), ("trace", "trace s", ".2f"),
    ("lower", "lower s", ".2f"), ("backend", "backend s", ".2f"),
]  # fmt: skip


def _model(name: str):
    """(config, mesh, device count) of a `MODELS` entry."""
    from mmr_jax.training import compiled_dry_run

    path, devices = MODELS[name]
    cfg = config_overrides.load_config(path)
    return cfg, compiled_dry_run.config_mesh(cfg, devices=jax.devices()[:devices]), devices


def bench_model(name: str, steps: int) -> list[dict]:
    """Each program of `name` scanned and unrolled: trace, lower, compile seconds, temp memory,
    and (one device) the steady time of a call."""
    from mmr_jax.training import compiled_dry_run

    cfg, mesh, devices = _model(name)
    rows = []
    for program in PROGRAMS:
        for unrolled in (False, True):
            kind = program.split()[0]
            fn, args, donated = compiled_dry_run.program(kind, cfg, mesh, unrolled=unrolled)
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
    from mmr_jax.config import config_overrides

    items = [part for part in text.split(",") if part.strip()]
    try:
        return config_overrides.parse_assignments(items)
    except ValueError as e:
        raise ValueError(f"an XLA option is name=value: {e}") from None


def compare_options(name: str, steps: int, options: dict) -> list[dict]:
    """Each program of `name` (scanned) compiled with and without `options`, timed in turns."""
    from mmr_jax.training import compiled_dry_run

    cfg, mesh, _ = _model(name)
    rows = []
    for program in PROGRAMS:
        fn, args, donated = compiled_dry_run.program(program.split()[0], cfg, mesh)
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


def bench_run(steps, workdir, price=None, programs=None, loads=None) -> dict:
    """The CPU default trained for `steps` steps in this process, checkpoints and evaluation off:
    JAX's compilation seconds over the whole run (setup included) against the summed step time
    (time/step in metrics.jsonl). `price`: batch.compile_price_steps (None: the config's);
    `programs`, `loads`: compile_stats.ProgramSeconds and compile_stats.CacheLoads to read."""
    import shutil

    from mmr_jax.infra import compile_stats
    from mmr_jax.training import trainer

    jax.clear_caches()  # a second run in this process compiles everything again, as a new one
    clock = compile_stats.CLOCK.start()
    before = clock.totals()
    programs_before = programs.snapshot() if programs else {}
    loads_before = (loads.seconds, loads.loads) if loads else (0.0, 0)
    overrides = {"total_steps": steps, "checkpoint.every": 0, "eval.every": 0}
    if price is not None:
        overrides["batch.compile_price_steps"] = price
    cfg = config_overrides.load_config(MODELS["smollm2"][0], overrides)
    shutil.rmtree(workdir, ignore_errors=True)
    trainer.train(cfg, workdir)
    compile_s = {k: v - before[k] for k, v in clock.totals().items()}
    records = [json.loads(line) for line in open(pathlib.Path(workdir) / "metrics.jsonl")]
    stepped = [r for r in records if "time/step" in r]
    step_s = [r["time/step"] for r in stepped]
    total = sum(compile_s.values())
    return {
        "compile_price_steps": cfg.batch.compile_price_steps,
        "packed_len": [r.get("batch/packed_len") for r in stepped],
        "packed_len_needed": [r.get("batch/packed_len_needed") for r in stepped],
        "step_s": step_s,
        "steps": len(step_s),
        "step_s_sum": sum(step_s),
        "first_step_s": step_s[0],
        "compile_s": total,
        "compile_parts_s": compile_s,
        "compile_share": total / sum(step_s),
        "programs": programs.since(programs_before) if programs else [],
        "cache_loads": loads.loads - loads_before[1] if loads else 0,
        "cache_load_s": loads.seconds - loads_before[0] if loads else 0.0,
    }


def print_run(out: dict, top: int) -> None:
    parts = ", ".join(f"{k} {v:.1f} s" for k, v in out["compile_parts_s"].items())
    line = (
        f"compile_price_steps {out['compile_price_steps']:g}: {out['steps']} steps: "
        f"{out['step_s_sum']:.1f} s of steps (first {out['first_step_s']:.1f} s); compilation "
        f"{out['compile_s']:.1f} s ({parts}) = {100 * out['compile_share']:.0f}% of the step time"
    )
    if out["cache_loads"]:
        line += f"; {out['cache_loads']} programs loaded from the cache in "
        line += f"{out['cache_load_s']:.1f} s (within backend)"
    lens = zip(out["packed_len_needed"], out["packed_len"], strict=True)
    print(
        line + "\n  packed length needed -> run at: " + ", ".join(f"{a:g}->{b:g}" for a, b in lens)
    )
    if not top:
        return
    rows, rest = out["programs"][:top], out["programs"][top:]  # the rest summed on one line
    if rest:
        rows.append({"program": f"{len(rest)} other programs"})
        rows[-1] |= {k: sum(r[k] for r in rest) for k in PARTS}
    shown = [{**r, "program": r["program"][:40]} for r in rows]
    print(harness.format_table(shown, PROGRAM_COLUMNS))


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


def train_runs(args) -> list[dict]:
    from mmr_jax.infra import compile_cache, compile_stats

    prices = [float(p) for p in args.compile_price_steps.split(",") if p] or [None]
    programs = compile_stats.ProgramSeconds() if args.programs else None
    loads = None
    if args.xla_cache == "warm":
        import tempfile

        folder = tempfile.mkdtemp(prefix="bench_compile_xla_")
        compile_cache.enable({compile_cache.ENV: folder})  # the scripts' threshold
        loads = compile_stats.CacheLoads()
    runs = []
    for price in prices:
        if loads is not None:
            bench_run(args.train_run, args.workdir, price)  # fills the cache, not measured
        runs.append(bench_run(args.train_run, args.workdir, price, programs, loads))
    for out in runs:
        print_run(out, args.programs)
    return runs


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
        rows = train_runs(args)
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
    main()
