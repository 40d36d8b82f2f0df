"""GRPO (beta 0.04; format 1 + cosine 2), the paper's baseline; `reweight.method=mmr` gives
MMR-GRPO.

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
