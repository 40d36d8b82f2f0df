"""Parameter counts and per-device memory of the paper's models on a mesh, without weights.

    python scripts/model_dry_run.py                    # all third_party/hf_configs/*.json
    python scripts/model_dry_run.py --mesh 1,8,1 --lora \
        --config third_party/hf_configs/deepseek_r1_distill_qwen_7b.json  # LoRA r=64, 8-way FSDP
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax.numpy as jnp

from mmr_jax.models import config as config_lib
from mmr_jax.models import dry_run
from mmr_jax.models import lora as lora_lib

CONFIG_DIR = pathlib.Path(__file__).resolve().parents[1] / "third_party" / "hf_configs"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--config",
        action="append",
        help="config.json path(s); default: all of third_party/hf_configs",
    )
    ap.add_argument("--mesh", default="1,1,1", help="data,fsdp,tensor sizes (default 1,1,1)")
    ap.add_argument(
        "--lora", action="store_true", help="LoRA r=64, alpha=128 on q/k/v/o/gate/up/down"
    )
    ap.add_argument("--lora_rank", type=int, default=64)
    ap.add_argument("--param_dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--json", action="store_true", help="print one JSON object per model")
    args = ap.parse_args(argv)
    paths = args.config or sorted(str(p) for p in CONFIG_DIR.glob("*.json"))
    mesh = dry_run.MeshShape(*(int(x) for x in args.mesh.split(",")))
    lora = (
        lora_lib.LoraConfig(rank=args.lora_rank, alpha=2.0 * args.lora_rank) if args.lora else None
    )
    for path in paths:
        cfg = config_lib.ModelConfig.from_hf(path)
        s = dry_run.summarize(cfg, mesh=mesh, lora=lora, param_dtype=jnp.dtype(args.param_dtype))
        name = pathlib.Path(path).stem
        print(json.dumps({"model": name, **s}) if args.json else dry_run.format_summary(name, s))


if __name__ == "__main__":
    main()
