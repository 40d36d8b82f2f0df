"""A training run's compilation share, for `bench_compile.py --train_run`: the CPU default trained
in this process (`bench_run`), JAX's compile seconds against the summed step time, with or
without XLA's on-disk cache warm (`train_runs`), printed with its top programs (`print_run`).
"""

from __future__ import annotations

import json
import pathlib

import jax

from mmr_jax.config import command_line
from mmr_jax.infra import bench_harness as harness

PARTS = ("builds", "trace", "lower", "backend")
# builds: backend events, each an XLA compile or (warm cache) a load from disk
PROGRAM_COLUMNS = [
    ("program", "program", ""), ("builds", "builds", "d"), ("trace", "trace s", ".2f"),
    ("lower", "lower s", ".2f"), ("backend", "backend s", ".2f"),
]  # fmt: skip


def bench_run(config, steps, workdir, price=None, programs=None, loads=None) -> dict:
    """The config file `config` trained for `steps` steps in this process, checkpoints and
    evaluation off: JAX's compilation seconds over the whole run (setup included) against the
    summed step time (time/step in metrics.jsonl). `price`: batch.compile_price_steps (None: the
    config's); `programs`, `loads`: compile_stats.ProgramSeconds and compile_stats.CacheLoads to
    read."""
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
    cfg = command_line.load_config(config, overrides)
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
    """One run's line, its packed lengths, and (`top`) its programs by compile seconds."""
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


def train_runs(args, config: str) -> list[dict]:
    """A run of `config` per --compile_price_steps value (after an unmeasured one that fills
    the cache, with --xla_cache=warm), each printed."""
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
            bench_run(config, args.train_run, args.workdir, price)  # fills the cache, not measured
        runs.append(bench_run(config, args.train_run, args.workdir, price, programs, loads))
    for out in runs:
        print_run(out, args.programs)
    return runs
