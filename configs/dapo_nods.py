"""DAPO without dynamic sampling (the paper's "DAPO-No-DS"): DAPO's loss and rewards, 500 steps.

    python scripts/train.py --config=configs/dapo_nods.py:8b --workdir=runs/dapo_nods_8b
    python scripts/train.py --config=configs/dapo_nods.py:1.5b --workdir=runs/mmr_dapo_nods_1.5b \\
        --config.reweight.method=mmr
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import base
import dapo


def get_config(arg=None):
    c = dapo.dapo_deltas(base.get_config())
    c.name = "dapo_nods"
    return base.apply_arg(c, arg)
