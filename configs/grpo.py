"""GRPO (beta 0.04; format 1 + cosine 2), the paper's baseline; `reweight.method=mmr` gives
MMR-GRPO.

Sized for one 80 GB H100 at the paper's shapes (48 completions of up to 3584 tokens, 512-token
prompts), compiled for one by `--dry_run --dry_run_target=h100:1` (docs/performance.md, "Will it
fit?"): the 1.5B full fine-tune; the 7B and 8B with LoRA, whose frozen base is stored in bf16
(configs/base.py `apply_arg`; in fp32 the 8B needed 94.6 GiB a device, now 63.2 with the `xla`
attention fallback, 32.4 with cuDNN).

    python scripts/train.py --config=configs/grpo.py:7b --workdir=runs/grpo_7b
    python scripts/train.py --config=configs/grpo.py:1.5b --workdir=runs/mmr_grpo_1.5b \\
        --config.reweight.method=mmr
    python scripts/train.py --config=configs/grpo.py:8b,smoke --workdir=/tmp/smoke   # CPU
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import base


def get_config(arg=None):
    c = base.get_config()
    c.name = "grpo"
    return base.apply_arg(c, arg)
