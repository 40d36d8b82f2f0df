"""Dr.GRPO: advantages r - mean (no std), loss sum / (B * max_len), beta 0.04; format 1 + cosine 2.

    python scripts/train.py --config=configs/dr_grpo.py:8b --workdir=runs/dr_grpo_8b
    python scripts/train.py --config=configs/dr_grpo.py:1.5b --workdir=runs/mmr_dr_grpo_1.5b \\
        --config.reweight.method=mmr
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import base


def get_config(arg=None):
    c = base.get_config()
    c.name = "dr_grpo"
    c.advantage.estimator = "dr_grpo"
    c.loss.aggregation = "seq_mean_token_sum_norm"
    return base.apply_arg(c, arg)
