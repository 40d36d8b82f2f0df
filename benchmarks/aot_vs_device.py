"""The same program compiled for this machine's GPU and for a compile-only copy of it, compared.

    python benchmarks/aot_vs_device.py --json=aot_vs_device.json        # on a GPU host
    python benchmarks/aot_vs_device.py --set=batch.max_completion_len=1024 --programs=train

Run A of scripts/gpu_check.sh starts with this: it tells how far the figures of a compile without
a device (`scripts/train.py --dry_run --dry_run_target=...`, infra/aot_targets.py) can be
trusted. For each program (the train step and one decode step of `--configs`,
training/dry_run_programs.py) it compiles twice, for one device: on this machine's first device,
and on a compile-only device whose description is XLA's spec of the same card
(third_party/xla_gpu_specs/, the card named by `device_kind`: an H100 or H200), with no GPU
consulted, as a user's laptop would. Both are compiled by this process's CUDA plugin (the same
compiler version); the deviceless one cannot autotune. Printed: XLA's memory analysis of each
(arguments, outputs, aliased, temporaries, peak) and compile seconds, and the deviceless figure
over the device's. On a machine without a GPU (`--cpu_smoke`) the "device" side is the CPU and
the deviceless side is skipped: only the script's path is checked.
"""

from __future__ import annotations

import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from mmr_jax.infra import bench_harness as harness

FLAGS = {
    "configs": ("configs/grpo.py:1.5b", "config file (and its :arg)"),
    "set": ([], "config override key=value (repeatable)"),
    "programs": ("train,decode", "which programs, comma separated"),
    "attention": ("", "the train step's model.attention_impl ('': the config's, resolved)"),
    "cpu_smoke": (False, "no GPU here: compile on the CPU only (checks the script)"),
}
FIELDS = ("argument", "output", "alias", "temp")
COLUMNS = [("program", "program", ""), ("side", "compiled for", ""),
           ("compile_s", "compile s", ".1f"), ("argument", "arguments GiB", ".3f"),
           ("output", "outputs GiB", ".3f"), ("alias", "aliased GiB", ".3f"),
           ("temp", "temp GiB", ".3f"), ("peak", "peak GiB", ".3f")]  # fmt: skip


def card_spec(device_kind: str):
    """The accelerator of aot_targets whose spec describes this card, or None."""
    from mmr_jax.infra import aot_targets

    kind = device_kind.lower()
    for name, acc in aot_targets.ACCELERATORS.items():
        if acc.platform == "cuda" and name in kind:
            return acc
    return None


def deviceless_device(acc):
    """One compile-only device from the card's XLA spec (the plugin already up: no CPU switch)."""
    from jax.experimental import topologies

    from mmr_jax.infra import aot_targets

    spec = (aot_targets.SPEC_DIR / acc.spec_file).read_text()
    desc = topologies.get_topology_desc(
        platform="cuda", topology_name="", topology="1x1x1", target_config=spec
    )
    return desc.devices[0]


def compile_on(program: str, cfg, device, attention: str | None) -> dict:
    from mmr_jax.training import compiled_dry_run, dry_run_programs

    mesh = compiled_dry_run.config_mesh(cfg, devices=[device])
    if program == "train":
        fn, args = dry_run_programs.train_step_program(cfg, mesh, attention=attention)
    else:
        fn, args = dry_run_programs.decode_step_program(cfg, mesh)
    t0 = time.perf_counter()
    mem = fn.lower(*args).compile().memory_analysis()
    row = {"compile_s": time.perf_counter() - t0}
    row.update({f: getattr(mem, f"{f}_size_in_bytes") / 2**30 for f in FIELDS})
    row["peak"] = row["argument"] + row["output"] - row["alias"] + row["temp"]
    return row


def main(argv=None):
    args, _ = harness.parse_args(__doc__, FLAGS, argv)
    import jax

    from mmr_jax.config import command_line

    cfg = command_line.load_config(args.configs, command_line.parse_assignments(args.set))
    device = jax.devices()[0]
    acc = None if args.cpu_smoke else card_spec(device.device_kind)
    if not args.cpu_smoke and acc is None:
        raise SystemExit(f"no XLA spec for {device.device_kind!r} in third_party/xla_gpu_specs")
    sides = {f"this {device.platform} ({device.device_kind})": device}
    if acc is not None:
        sides[f"deviceless {acc.name} spec"] = deviceless_device(acc)
    rows = []
    for program in args.programs.split(","):
        for side, dev in sides.items():
            harness.progress(f"{program}: compiling for {side}")
            try:
                row = compile_on(program, cfg, dev, args.attention or None)
            except Exception as e:  # one side failing still reports the other
                row = {"error": f"{type(e).__name__}: {e}"[:300]}
            rows.append({"program": program, "side": side, **row})
            # as it goes: a run stopped by its time limit keeps the rows before
            harness.write_json(args.json, {"config": args.configs, "set": args.set, "rows": rows})
        if len(sides) == 2 and "error" not in rows[-1] and "error" not in rows[-2]:
            ratio = {k: _ratio(rows[-1][k], rows[-2][k]) for k in ("temp", "peak")}
            rows.append({"program": program, "side": "deviceless / device", **ratio})
    print(harness.format_table(rows, COLUMNS))
    harness.write_json(args.json, {"config": args.configs, "set": args.set, "rows": rows})
    return rows


def _ratio(a: float, b: float):
    return a / b if b else None


if __name__ == "__main__":
    harness.run(main)
