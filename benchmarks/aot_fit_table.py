"""Which shipped config fits which rented accelerator: `--dry_run_target` over a grid.

    python benchmarks/aot_fit_table.py --json=runs/aot_fit.json
    python benchmarks/aot_fit_table.py --configs=configs/grpo_7b.py --targets=h100:1,v5p:2x2x1

Each (config, target) is one child process, `scripts/train.py --config=C --dry_run
--dry_run_target=T --dry_run_json=...`, run with the target's compile-only venv
(`--gpu_python`, `--tpu_python`: .venv-aot-gpu / .venv-aot-tpu, built by scripts/setup_aot_env.sh).
A row: whether every program the run compiles fits (`fits`), the largest per-device total of
any program with what the run keeps beside it (GiB), the train step's compile seconds, on a TPU
the compiler's raw `optimal_seconds` of the train step (its cost model: a loop's body counted
once, -2 s for each additive scatter, so not the step's time; docs/performance.md), and the load
average before and after (compile seconds compare only at like loads). Then, per config, the
smallest target of the grid (fewest devices, then least memory) where it fits.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from mmr_jax.infra import aot_targets, bench_harness

REPO = pathlib.Path(__file__).resolve().parents[1]
CONFIGS = ("configs/grpo.py:1.5b", "configs/grpo_7b.py", "configs/grpo.py:8b")
TARGETS = ("h100:1", "h100:8", "h200:1", "h200:8", "v5e:2x4", "v5p:2x2x1", "v6e:2x4", "v5p:4x4x4")
FLAGS = {
    "configs": (",".join(CONFIGS), "comma-separated config specs"),
    "targets": (",".join(TARGETS), "comma-separated targets (infra/aot_targets.py)"),
    "overrides": ([], "a --config.KEY=VALUE for every config (repeatable)"),
    "remat": ("", "--dry_run_remat for every run (default: each config's)"),
    "gpu_python": (str(REPO / ".venv-aot-gpu/bin/python"), "python of the CUDA compile-only venv"),
    "tpu_python": (str(REPO / ".venv-aot-tpu/bin/python"), "python of the TPU compile-only venv"),
    "timeout_s": (3600.0, "seconds one config x target may take"),
}
GIB = 2.0**30


def one(config: str, target: str, args) -> dict:
    """The dry run of `config` on `target` in a child -> a row of the table."""
    t = aot_targets.parse_target(target)
    python = args.gpu_python if t.platform == "cuda" else args.tpu_python
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "dry_run.json")
        argv = [python, "scripts/train.py", f"--config={config}", "--dry_run"]
        argv += [f"--dry_run_target={target}", f"--dry_run_json={out}"]
        argv += [f"--config.{o}" for o in args.overrides]
        argv += [f"--dry_run_remat={args.remat}"] if args.remat else []
        # Compile seconds are only comparable on an idle machine: the load beside each one.
        load_before = os.getloadavg()[0]
        child = bench_harness.run_child(argv, timeout_s=args.timeout_s, echo_stderr=False)
        load = {"load_before": load_before, "load_after": os.getloadavg()[0]}
        if not os.path.exists(out):
            error = child.get("error", "no report")
            return {"config": config, "target": target, "error": error, **load}
        report = json.loads(pathlib.Path(out).read_text())
    return {**row(config, target, t, report), "overrides": list(args.overrides), **load}


def row(config: str, target: str, t, report: dict) -> dict:
    """A table row from one `aot_dry_run.to_json` report."""
    required = [r for r in report["rows"] if r["required"]]
    compiled = [r for r in required if r.get("error") is None]
    train = [r for r in compiled if r["name"].startswith("train step")]
    worst = max(compiled, key=lambda r: r["total_bytes"], default=None)
    mesh = "x".join(str(v) for v in report["mesh"].values())
    return {
        "config": config,
        "target": target,
        "devices": t.devices,
        "memory_gib": t.accelerator.memory_gib,
        "mesh": mesh,
        "fits": not report["failures"],
        "peak_gib": worst["total_bytes"] / GIB if worst else None,
        "worst_program": worst["name"] if worst else None,
        "train_compile_s": max((r["compile_s"] for r in train), default=None),
        # libtpu's raw figure: -2 s for each additive scatter, a loop's body counted once
        "tpu_optimal_s": [r.get("optimal_seconds_raw") for r in train]
        if t.platform == "tpu"
        else None,
        "failures": report["failures"],
        "programs": report["rows"],
    }


def smallest(rows: list[dict]) -> dict[str, str]:
    """Per config, the target it fits with the fewest devices, then the least memory a device."""
    out = {}
    for config in dict.fromkeys(r["config"] for r in rows):
        fits = [r for r in rows if r["config"] == config and r.get("fits")]
        best = min(fits, key=lambda r: (r["devices"], r["memory_gib"]), default=None)
        out[config] = f"{best['target']} (mesh {best['mesh']})" if best else "none of the grid"
    return out


COLUMNS = [
    ("config", "config", ""),
    ("target", "target", ""),
    ("mesh", "mesh", ""),
    ("fits", "fits", ""),
    ("peak_gib", "GiB/device", ".1f"),
    ("memory_gib", "of GiB", ".1f"),
    ("worst_program", "largest program", ""),
    ("train_compile_s", "train compile s", ".0f"),
    ("tpu_optimal_s", "TPU optimal_s (raw)", ""),
    ("load_before", "load", ".1f"),
]


def main(argv=None):
    args, _ = bench_harness.parse_args(__doc__, FLAGS, argv)
    rows = []
    for config in args.configs.split(","):
        for target in args.targets.split(","):
            bench_harness.progress(f"{config} on {target}")
            rows.append(one(config, target, args))
            bench_harness.write_json(args.json, {"rows": rows, "smallest": smallest(rows)})
    print(bench_harness.format_table(rows, COLUMNS))
    for config, where in smallest(rows).items():
        print(f"smallest fit of {config}: {where}")
    for r in rows:
        for failure in r.get("failures", []):
            print(f"{r['config']} on {r['target']}: {failure}")


if __name__ == "__main__":
    bench_harness.run(main)
