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

import argparse
import json
import pathlib
import re
import statistics
import sys
import time

import jax

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from mmr_jax.infra import bench_harness as harness

MODELS = {
    # name: (config file, devices)
    "smollm2": ("configs/cpu_smollm2.py", 1),
    "7b": ("configs/grpo_7b.py", 8),
}


def _load_config(path: str, **overrides):
    """The config file's TrainConfig, dotted `overrides` keys set first."""
    from mmr_jax import config_types

    config = config_types.load_config_file(path)
    return config_types.from_config_dict(config_types.set_keys(config, overrides))


def _random_like(args, seed=0):
    """Concrete arrays of the abstract arguments' shapes, dtypes and shardings."""
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(seed)

    def make(x):
        if jnp.issubdtype(x.dtype, jnp.floating):
            value = (0.02 * rng.standard_normal(x.shape)).astype(x.dtype)
        elif x.dtype == jnp.bool_:
            value = np.ones(x.shape, bool)
        else:
            value = np.zeros(x.shape, x.dtype)
        return jax.device_put(value, x.sharding)

    return jax.tree.map(make, args)


def _model(name: str):
    """(config, mesh, device count) of a `MODELS` entry."""
    from mmr_jax.training import compiled_dry_run

    path, devices = MODELS[name]
    cfg = _load_config(path)
    return cfg, compiled_dry_run.config_mesh(cfg, devices=jax.devices()[:devices]), devices


def bench_model(name: str, steps: int) -> list[dict]:
    from mmr_jax.training import compiled_dry_run

    cfg, mesh, devices = _model(name)
    rows = []
    for program in ("train step", "decode step"):
        for unrolled in (False, True):
            fn, args, donated = compiled_dry_run.program(
                program.split()[0], cfg, mesh, unrolled=unrolled
            )
            measured, compiled = compiled_dry_run.measure(program, fn, *args)
            row = {
                "trace_s": measured.trace_s,
                "lower_s": measured.lower_s,
                "compile_s": measured.compile_s,
                "temp": measured.temp_bytes,
            }
            row.update(model=name, program=program, layers="unrolled" if unrolled else "scanned")
            row["steady_s"] = None
            if steps and devices == 1:
                row["steady_s"] = harness.steady_calls(
                    compiled, _random_like(args), steps=steps, donated=donated
                ).median_s
            rows.append(row)
            print(_format_row(row), flush=True)
            jax.clear_caches()
    return rows


def parse_options(text: str) -> dict:
    """'a=false,b=2' -> {'a': False, 'b': 2}: XLA compiler options as JAX's `compile` takes them."""
    from mmr_jax import config_types

    items = [part for part in text.split(",") if part.strip()]
    try:
        return config_types.parse_assignments(items)
    except ValueError as e:
        raise ValueError(f"an XLA option is name=value: {e}") from None


def compare_options(name: str, steps: int, options: dict) -> list[dict]:
    """Each program of `name` (scanned) compiled with and without `options`, timed ABAB."""
    from mmr_jax.training import compiled_dry_run

    cfg, mesh, _ = _model(name)
    rows = []
    for program in ("train step", "decode step"):
        fn, args, donated = compiled_dry_run.program(program.split()[0], cfg, mesh)
        lowered = fn.trace(*args).lower()
        compiled, compile_s = [], []
        for opts in ({}, options):
            t0 = time.perf_counter()
            compiled.append(lowered.compile(compiler_options=opts or None))
            compile_s.append(time.perf_counter() - t0)
        inputs = [list(_random_like(args)) for _ in compiled]
        times: list[list[float]] = [[], []]
        for i in range(steps + 1):  # the first call of each is a warm-up, not counted
            for k in (0, 1) if i % 2 == 0 else (1, 0):
                t0 = time.perf_counter()
                out = compiled[k](*inputs[k])
                jax.block_until_ready(out)
                if i:
                    times[k].append(time.perf_counter() - t0)
                inputs[k][donated[0]] = out[donated[1]]
        default_s, option_s = (statistics.median(t) for t in times)
        row = {
            "model": name,
            "program": program,
            "options": options,
            "compile_s": compile_s[0],
            "compile_s_options": compile_s[1],
            "steady_s": default_s,
            "steady_s_options": option_s,
            "calls": steps,
        }
        print(
            f"{name:8s} {program:12s} compile {compile_s[0]:6.2f} s -> {compile_s[1]:6.2f} s "
            f"({compile_s[1] / compile_s[0]:4.2f}x); call {default_s * 1e3:8.1f} ms -> "
            f"{option_s * 1e3:8.1f} ms ({option_s / default_s:5.3f}x), median of {steps} each",
            flush=True,
        )
        rows.append(row)
        jax.clear_caches()
    return rows


def _format_row(r: dict) -> str:
    steady = "-" if r["steady_s"] is None else f"{r['steady_s'] * 1e3:9.1f}"
    total = r["trace_s"] + r["lower_s"] + r["compile_s"]
    return (
        f"{r['model']:8s} {r['program']:12s} {r['layers']:9s} {r['trace_s']:8.2f} "
        f"{r['lower_s']:8.2f} {r['compile_s']:9.2f} {total:8.2f} {r['temp'] / 2**30:9.2f} "
        f"{steady:>9s}"
    )


class ProgramSeconds:
    """JAX's compile events of this process summed per program (the `fun_name` JAX reports with
    each event: `train_step`, `_decode_loop`, or the op name of an eager call such as
    `convert_element_type`), so a run's compilation can be traced to what built it. JAX's
    listeners cannot be removed: one is registered, and callers take differences (`since`)."""

    def __init__(self):
        self.seconds: dict[str, dict[str, float]] = {}
        from jax import monitoring

        from mmr_jax.infra import compile_stats

        self._parts = compile_stats.EVENTS
        monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, event: str, duration: float, fun_name: str = "?", **_) -> None:
        part = self._parts.get(event)
        if part is not None:
            # JAX names the trace `f` and the lowering and backend compile `jit(f)`: one program.
            name = re.sub(r"^(?:jit|pjit)\((.*)\)$", r"\1", fun_name)
            row = self.seconds.setdefault(name, {"trace": 0.0, "lower": 0.0, "backend": 0.0})
            row[part] += duration
            if part == "backend":
                row["builds"] = row.get("builds", 0) + 1

    def snapshot(self) -> dict[str, dict[str, float]]:
        return {k: dict(v) for k, v in self.seconds.items()}

    def since(self, before: dict[str, dict[str, float]]) -> list[dict]:
        """Per program since `before`: name, builds, trace/lower/backend/total seconds,
        largest total first."""
        rows = []
        for name, now in self.seconds.items():
            was = before.get(name, {})
            row = {k: now.get(k, 0.0) - was.get(k, 0.0) for k in ("trace", "lower", "backend")}
            row["total"] = sum(row.values())
            row["builds"] = int(now.get("builds", 0) - was.get("builds", 0))
            if row["total"] > 0:
                rows.append({"program": name, **row})
        return sorted(rows, key=lambda r: -r["total"])


def print_programs(rows: list[dict], top: int) -> None:
    """The `top` programs by compile seconds, the rest summed on one line."""
    # builds: backend events, each an XLA compile or (warm cache) a load from disk
    print(f"  {'program':40s} {'builds':>6s} {'trace s':>8s} {'lower s':>8s} {'backend s':>9s}")
    for r in rows[:top]:
        print(
            f"  {r['program'][:40]:40s} {r['builds']:6d} {r['trace']:8.2f} {r['lower']:8.2f} "
            f"{r['backend']:9.2f}"
        )
    rest = rows[top:]
    if rest:
        total = {k: sum(r[k] for r in rest) for k in ("trace", "lower", "backend")}
        builds = sum(r["builds"] for r in rest)
        print(
            f"  {f'{len(rest)} other programs':40s} {builds:6d} {total['trace']:8.2f} "
            f"{total['lower']:8.2f} {total['backend']:9.2f}"
        )


class CacheLoads:
    """Programs loaded from XLA's on-disk cache, and the seconds the loads took. JAX reports a
    load both as its own event (counted here) and as the program's backend compile event (so
    the compile totals already include it); a loaded program still costs its trace and
    lowering."""

    EVENT = "/jax/compilation_cache/cache_retrieval_time_sec"

    def __init__(self):
        self.seconds = 0.0
        self.loads = 0
        from jax import monitoring

        monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, event: str, duration: float, **_) -> None:
        if event == self.EVENT:
            self.seconds += duration
            self.loads += 1


def bench_run(
    steps: int,
    workdir: str,
    price: float | None = None,
    programs: ProgramSeconds | None = None,
    loads: CacheLoads | None = None,
) -> dict:
    """The CPU default trained for `steps` steps in this process, checkpoints and evaluation off:
    JAX's compilation seconds over the whole run (setup included) against the summed step time
    (time/step in metrics.jsonl). `price`: batch.compile_price_steps (None: the config's)."""
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
    cfg = _load_config(MODELS["smollm2"][0], **overrides)
    shutil.rmtree(workdir, ignore_errors=True)
    trainer.train(cfg, workdir)
    after = clock.totals()
    compile_s = {k: after[k] - before[k] for k in after}
    records = [json.loads(line) for line in open(pathlib.Path(workdir) / "metrics.jsonl")]
    step_s = [r["time/step"] for r in records if "time/step" in r]
    total = sum(compile_s.values())
    return {
        "compile_price_steps": cfg.batch.compile_price_steps,
        "packed_len": [r.get("batch/packed_len") for r in records if "time/step" in r],
        "packed_len_needed": [
            r.get("batch/packed_len_needed") for r in records if "time/step" in r
        ],
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


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="smollm2,7b", help="comma list of " + ",".join(MODELS))
    ap.add_argument("--steps", type=int, default=5, help="timed calls per compiled program")
    ap.add_argument("--json", default=None, help="also write the rows here")
    ap.add_argument(
        "--train_run",
        type=int,
        default=0,
        help="instead: train the CPU default this many steps and report compilation's share",
    )
    ap.add_argument("--workdir", default="/tmp/bench_compile_run", help="for --train_run")
    ap.add_argument(
        "--compile_price_steps",
        default="",
        help="for --train_run: comma list of batch.compile_price_steps, one run each, in order",
    )
    ap.add_argument(
        "--programs",
        type=int,
        default=0,
        help="for --train_run: also list this many programs by compile seconds (the rest summed)",
    )
    ap.add_argument(
        "--compare_options",
        default="",
        help="instead: XLA compiler options (name=value,...) against the defaults, per SmolLM2 "
        "program, compiled and called in this process",
    )
    ap.add_argument(
        "--xla_cache",
        choices=("off", "warm"),
        default="off",
        help="for --train_run: off (every program compiled, as a config's first run) or warm "
        "(XLA's on-disk cache, as the scripts use it, filled by an unmeasured run of the same "
        "config first: a config's second run, a resumed run, a study's later runs)",
    )
    args = ap.parse_args()
    from mmr_jax.infra import compile_cache

    # As scripts/train.py compiles on a CPU host (LLVM level 1). By default without the on-disk
    # cache: every program here is compiled, none loaded.
    compile_cache.cpu_compile_flag()
    if args.train_run:
        prices = [float(p) for p in args.compile_price_steps.split(",") if p] or [None]
        programs = ProgramSeconds() if args.programs else None
        loads = None
        if args.xla_cache == "warm":
            import tempfile

            folder = tempfile.mkdtemp(prefix="bench_compile_xla_")
            compile_cache.enable({compile_cache.ENV: folder})  # the scripts' threshold
            loads = CacheLoads()
        runs = []
        for price in prices:
            if loads is not None:
                bench_run(args.train_run, args.workdir, price)  # fills the cache, not measured
            runs.append(bench_run(args.train_run, args.workdir, price, programs, loads))
        for out in runs:
            parts = ", ".join(f"{k} {v:.1f} s" for k, v in out["compile_parts_s"].items())
            print(
                f"compile_price_steps {out['compile_price_steps']:g}: {out['steps']} steps: "
                f"{out['step_s_sum']:.1f} s of steps (first {out['first_step_s']:.1f} s); "
                f"compilation {out['compile_s']:.1f} s ({parts}) = "
                f"{100 * out['compile_share']:.0f}% of the step time"
                + (
                    f"; {out['cache_loads']} programs loaded from the cache in "
                    f"{out['cache_load_s']:.1f} s (within backend)"
                    if loads
                    else ""
                )
            )
            lens = zip(out["packed_len_needed"], out["packed_len"], strict=True)
            print(
                "  packed length needed -> run at: " + ", ".join(f"{a:g}->{b:g}" for a, b in lens)
            )
            if args.programs:
                print_programs(out["programs"], args.programs)
        if args.json:
            harness.write_json(args.json, runs)
        return
    if args.compare_options:
        options = parse_options(args.compare_options)
        print(
            f"smollm2 (configs/cpu_smollm2.py, scanned): the scripts' XLA options, then + {options}"
        )
        rows = compare_options("smollm2", args.steps, options)
        if args.json:
            harness.write_json(args.json, rows)
        return
    names = [m for m in args.models.split(",") if m]
    unknown = sorted(set(names) - set(MODELS))
    if unknown:
        sys.exit(f"unknown models {unknown}; known: {sorted(MODELS)}")
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", max(MODELS[m][1] for m in names))
    print(
        f"{'model':8s} {'program':12s} {'layers':9s} {'trace s':>8s} {'lower s':>8s} "
        f"{'compile s':>9s} {'total s':>8s} {'temp GiB':>9s} {'steady ms':>9s}"
    )
    rows = [row for name in names for row in bench_model(name, args.steps)]
    by = {(r["model"], r["program"], r["layers"]): r for r in rows}
    print("\nscanned against unrolled (total compile seconds; steady time):")
    for name in names:
        for program in ("train step", "decode step"):
            s, u = by[(name, program, "scanned")], by[(name, program, "unrolled")]
            ts = s["trace_s"] + s["lower_s"] + s["compile_s"]
            tu = u["trace_s"] + u["lower_s"] + u["compile_s"]
            line = f"  {name:8s} {program:12s} compile {tu / ts:5.2f}x faster"
            if s["steady_s"] and u["steady_s"]:
                line += f", steady step {s['steady_s'] / u['steady_s']:5.2f}x the unrolled time"
            print(line)
    if args.json:
        harness.write_json(args.json, rows)


if __name__ == "__main__":
    main()
