"""Parameter counts and per-device memory of the paper's models on a mesh, without weights.

    python scripts/model_dry_run.py                    # all third_party/hf_configs/*.json
    python scripts/model_dry_run.py --mesh 1,8,1 --lora \\
        --config third_party/hf_configs/deepseek_r1_distill_qwen_7b.json  # LoRA r=64, 8-way FSDP
    python scripts/model_dry_run.py --mesh 1,-1,1 --hosts 4 --devices_per_host 8  # (4, 8, 1)

With --train_config, the real train and decode steps of a training config are lowered and
compiled (training/compiled_dry_run) for a pod of --hosts x --devices_per_host devices: that many
virtual CPU devices, device i on fake host i // devices_per_host, laid out as the config's mesh
is on that pod (hybrid by default: data across hosts, fsdp and tensor within one). The programs'
shardings and XLA's per-device memory are those of the pod's (on the CPU backend):

    python scripts/model_dry_run.py --train_config configs/grpo_7b.py --hosts 2 \\
        --devices_per_host 8 [--set mesh.over_hosts=flat ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax.numpy as jnp

from mmr_jax.models import config as config_lib
from mmr_jax.models import dry_run
from mmr_jax.models import lora as lora_lib

CONFIG_DIR = pathlib.Path(__file__).resolve().parents[1] / "third_party" / "hf_configs"


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--config",
        action="append",
        help="config.json path(s); default: all of third_party/hf_configs",
    )
    ap.add_argument(
        "--mesh", default="1,1,1", help="data,fsdp,tensor sizes, one may be -1 (default 1,1,1)"
    )
    ap.add_argument("--hosts", type=int, default=1, help="hosts of the pod (default 1)")
    ap.add_argument(
        "--devices_per_host",
        type=int,
        default=0,
        help="devices per host (default: the --mesh sizes' product on one host)",
    )
    ap.add_argument(
        "--over_hosts", default="hybrid", choices=["hybrid", "flat"], help="mesh.over_hosts"
    )
    ap.add_argument(
        "--lora", action="store_true", help="LoRA r=64, alpha=128 on q/k/v/o/gate/up/down"
    )
    ap.add_argument("--lora_rank", type=int, default=64)
    ap.add_argument("--param_dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--json", action="store_true", help="print one JSON object per model")
    ap.add_argument(
        "--train_config",
        help="configs/<file>.py[:arg]: compile its train and decode steps on the pod instead",
    )
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="with --train_config: a dotted config key to set (repeatable)",
    )
    return ap


def compiled(args) -> dict:
    """The config's steps compiled on `hosts x devices_per_host` virtual CPU devices; must run
    before anything initialises JAX's backends."""
    import jax

    if args.devices_per_host < 1:
        raise SystemExit("--train_config needs --devices_per_host (e.g. 8)")
    hosts = dry_run.pod_hosts(args.hosts, args.devices_per_host)
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", len(hosts))
    from mmr_jax.config import checks, command_line
    from mmr_jax.training import compiled_dry_run

    c = command_line.load_config_file(args.train_config)
    command_line.set_keys(c, command_line.parse_assignments(args.set))
    cfg = checks.from_config_dict(c)
    mesh = compiled_dry_run.config_mesh(cfg, hosts=hosts)
    host_of = dict(zip(jax.devices(), hosts, strict=True))
    result = compiled_dry_run.run(cfg, hosts=hosts)
    # Which fake host each device of every data row belongs to (row r: [fsdp x tensor]).
    result["row_hosts"] = [[host_of[d] for d in row.reshape(-1)] for row in mesh.devices]
    return result


def main(argv=None) -> None:
    args = _parser().parse_args(argv)
    if args.train_config:
        result = compiled(args)
        if args.json:
            programs = [dataclasses.asdict(p) for p in result["programs"]]
            print(json.dumps({**result, "programs": programs}))
        else:
            print(compiled_dry_run_table(result))
        return
    paths = args.config or sorted(str(p) for p in CONFIG_DIR.glob("*.json"))
    shape = [int(x) for x in args.mesh.split(",")]
    if args.hosts > 1 or args.devices_per_host or -1 in shape:
        per_host = args.devices_per_host
        if not per_host:
            raise SystemExit("--hosts or a -1 in --mesh needs --devices_per_host")
        mesh = dry_run.pod_mesh_shape(
            shape, hosts=args.hosts, devices_per_host=per_host, over_hosts=args.over_hosts
        )
    else:
        mesh = dry_run.MeshShape(*shape)
    lora = (
        lora_lib.LoraConfig(rank=args.lora_rank, alpha=2.0 * args.lora_rank) if args.lora else None
    )
    for path in paths:
        cfg = config_lib.ModelConfig.from_hf(path)
        s = dry_run.summarize(cfg, mesh=mesh, lora=lora, param_dtype=jnp.dtype(args.param_dtype))
        name = pathlib.Path(path).stem
        print(json.dumps({"model": name, **s}) if args.json else dry_run.format_summary(name, s))


def compiled_dry_run_table(result: dict) -> str:
    from mmr_jax.training import compiled_dry_run

    rows = "\n".join(
        f"  data row {r}: hosts {sorted(set(h))}" for r, h in enumerate(result["row_hosts"])
    )
    return compiled_dry_run.format_table(result) + "\nhosts of each data row:\n" + rows


if __name__ == "__main__":
    main()
