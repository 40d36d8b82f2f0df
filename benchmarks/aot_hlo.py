"""What the target's own compiler makes of the train step and the decode step, from optimized HLO.

    .venv-aot-gpu/bin/python benchmarks/aot_hlo.py                      # 1.5B, one H100, cuDNN
    .venv-aot-gpu/bin/python benchmarks/aot_hlo.py --attention=xla --json=aot_hlo_xla.json
    .venv-aot-tpu/bin/python benchmarks/aot_hlo.py --target=v5p:2x2x1 --attention=pallas_tpu \\
        --pack_max_len=0

Compiles `dry_run_programs.train_step_program` and `decode_step_program` of `--config` (default
the paper's 1.5B full fine-tune, configs/grpo.py:1.5b) at the paper's shapes (48 completions of
1024 tokens, 8 prompts x 6, 512-token prompts; `--prompts`, `--generations`, `--prompt_len`,
`--completion_len`) for the compile-only devices of `--target` (infra/aot_targets.py; the config's
mesh on them), and reads each optimized program with infra/hlo_stats.py: bytes written a call by
kind of op (a loop body counted once per trip), the share written by transpose, copy,
concatenate and pad ops (the issue's goal for the train step: <= 15%), the largest layout writes,
the attention custom calls, and XLA's memory analysis. No device: no autotuning, so the kernels
are the compiler's defaults; fusion, layouts and buffers are the real ones. Bytes written are
traffic, not time (reads are not counted).
"""

from __future__ import annotations

import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from mmr_jax.infra import bench_harness as harness
from mmr_jax.infra import hlo_stats

FLAGS = {
    "config": ("configs/grpo.py:1.5b", "config file (and its :arg)"),
    "target": ("h100:1", "compile-only target (infra/aot_targets.py)"),
    "attention": ("cudnn", "model.attention_impl of the train step"),
    "prompts": (8, "prompts a step (B)"),
    "generations": (6, "completions a prompt (G)"),
    "prompt_len": (512, "batch.max_prompt_len"),
    "completion_len": (1024, "batch.max_completion_len (completions feed one token less)"),
    "pack_max_len": (-1, "batch.pack_max_len (-1: the config's)"),
    "programs": ("train,decode", "which programs, comma separated"),
    "devices": (0, "compile for the target's first N devices (0: all of them)"),
    "top": (8, "layout writes listed, largest first"),
}
GOAL = 0.15  # the layout share goal for the train step
LAYOUT_COLUMNS = [("kind", "largest layout writes", ""), ("name", "op", ""), ("shape", "shape", ""),
                  ("mb", "MB each", ".2f"), ("count", "runs", "d")]  # fmt: skip


def _config(args):
    from mmr_jax.config import command_line

    b = {
        "batch.prompts": args.prompts,
        "batch.generations": args.generations,
        "batch.max_prompt_len": args.prompt_len,
        "batch.max_completion_len": args.completion_len,
    }
    if args.pack_max_len >= 0:
        b["batch.pack_max_len"] = args.pack_max_len
    return command_line.load_config(args.config, b)


def measure(program: str, fn, fargs, *, top: int) -> dict:
    """Compile one program; its memory analysis and what its optimized HLO writes."""
    t0 = time.perf_counter()
    compiled = fn.lower(*fargs).compile()
    seconds = time.perf_counter() - t0
    module = hlo_stats.parse(compiled.as_text())
    by_kind = hlo_stats.bytes_by_kind(module)
    layout = [w for w in hlo_stats.writes(module) if w.kind in hlo_stats.LAYOUT_KINDS]
    layout.sort(key=lambda w: -w.bytes)
    mem = compiled.memory_analysis()
    calls = hlo_stats.custom_calls(module, r"cudnn|tpu_custom_call|flash|attention")
    return {
        "program": program,
        "compile_s": seconds,
        "written_gb": sum(by_kind.values()) / 1e9,
        "layout_share": hlo_stats.layout_share(by_kind),
        "bytes_by_kind": by_kind,
        "largest_layout_writes": [
            {
                "kind": w.kind,
                "name": w.instruction.name,
                "shape": w.instruction.shape.split("{")[0][:60],
                "mb": w.bytes / 1e6,
                "count": w.count,
            }
            for w in layout[:top]
        ],
        "attention_calls": sorted(
            {
                f"{c.target} {c.name.rsplit('.', 1)[0]} q={c.operand_shapes[:1]} x{c.count}"
                for c in calls
            }
        ),
        "memory_gib": {
            k: getattr(mem, f"{k}_size_in_bytes") / 2**30
            for k in ("argument", "output", "alias", "temp")
        },
    }


def main(argv=None):
    args, _ = harness.parse_args(__doc__, FLAGS, argv)
    from mmr_jax.infra import aot_targets

    target = aot_targets.parse_target(args.target)
    devices = aot_targets.compile_only_devices(target)
    from mmr_jax.training import compiled_dry_run, dry_run_programs

    cfg = _config(args)
    mesh = compiled_dry_run.config_mesh(cfg, devices=devices[: args.devices or None])
    results = {"target": target.name, "devices": mesh.size, "config": args.config,
               "attention": args.attention,
               "shapes": {k: getattr(args, k) for k in ("prompts", "generations", "prompt_len",
                                                         "completion_len", "pack_max_len")},
               "programs": []}  # fmt: skip
    for program in args.programs.split(","):
        harness.progress(f"compiling the {program} step for {target.name}")
        if program == "train":
            fn, fargs = dry_run_programs.train_step_program(cfg, mesh, attention=args.attention)
        else:
            fn, fargs = dry_run_programs.decode_step_program(cfg, mesh)
        results["programs"].append(measure(program, fn, fargs, top=args.top))
    print(report(results))
    harness.write_json(args.json, results)
    return results


def report(results: dict) -> str:
    lines = [f"{results['config']} on {results['target']} ({results['devices']} devices), "
             f"attention {results['attention']}, shapes {results['shapes']}"]  # fmt: skip
    for r in results["programs"]:
        mem = r["memory_gib"]
        lines.append(
            f"\n{r['program']} step: compiled in {r['compile_s']:.1f} s; {r['written_gb']:.2f} GB "
            f"written a call; per device GiB: arguments {mem['argument']:.2f}, outputs "
            f"{mem['output']:.2f} (aliased {mem['alias']:.2f}), temporaries {mem['temp']:.2f}"
        )
        share = r["layout_share"]
        verdict = ""
        if r["program"] == "train":
            verdict = f" (goal <= {GOAL:.0%}: {'met' if share <= GOAL else 'NOT met'})"
        lines.append(f"transpose + copy + concatenate + pad: {share:.1%} of bytes written{verdict}")
        kinds = list(r["bytes_by_kind"].items())[:10]
        lines.append("by kind (GB): " + ", ".join(f"{k} {v / 1e9:.2f}" for k, v in kinds))
        lines.append(harness.format_table(r["largest_layout_writes"], LAYOUT_COLUMNS))
        lines += [f"  {c}" for c in r["attention_calls"]] or ["  no attention custom calls"]
    return "\n".join(lines)


if __name__ == "__main__":
    harness.run(main)
