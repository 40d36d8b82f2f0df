"""GRPO on DeepSeek-R1-Distill-Qwen-7B with LoRA (r 64, alpha 128); the README's example.

python scripts/train.py --config=configs/grpo_7b.py --workdir=runs/grpo_7b --config.mmr.enabled=True
python scripts/train.py --config=configs/grpo_7b.py:smoke --workdir=/tmp/smoke   # CPU
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import grpo


def get_config(arg=None):
    return grpo.get_config(",".join(filter(None, ["7b", arg])))
