"""DAPO with dynamic sampling: clip 0.2 / 0.28, no KL, token-mean loss, accuracy 1 + cosine 1,
groups with zero accuracy variance dropped and refilled (at most 10 generation batches), 200 steps.

    python scripts/train.py --config=configs/dapo.py:7b --workdir=runs/dapo_7b
    python scripts/train.py --config=configs/dapo.py:1.5b --workdir=runs/mmr_dapo_1.5b \\
        --config.reweight.method=mmr

As the paper's table has it, without overlong shaping. The full DAPO recipe adds the soft overlong
punishment (eq. 13, reward 'overlong' with weight 1; its lengths rewards.overlong_*) by the
config argument `full`:

    python scripts/train.py --config=configs/dapo.py:7b,full --workdir=runs/dapo_full_7b
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import base


def dapo_deltas(c):
    """DAPO's losses and rewards, shared with `dapo_nods.py`."""
    c.loss.eps_low = 0.2
    c.loss.eps_high = 0.28
    c.loss.beta = 0.0
    c.loss.aggregation = "token_mean"
    c.rewards.weights = {"accuracy": 1.0, "format": 0.0, "cosine": 1.0}
    return c


def get_config(arg=None):
    parts = [p.strip() for p in (arg or "").split(",") if p.strip()]
    full = "full" in parts
    c = dapo_deltas(base.get_config())
    c.name = "dapo"
    c.total_steps = 200
    c.dynamic_sampling.enabled = True
    c.dynamic_sampling.filter_reward = "accuracy"
    c.dynamic_sampling.max_generation_batches = 10
    if full:  # DAPO's soft overlong punishment (the recipe), lengths from rewards.overlong_*
        c.rewards.weights = dict(c.rewards.weights, overlong=1.0)
    base.apply_arg(c, ",".join(p for p in parts if p != "full"))
    c.name = f"dapo:{arg}" if arg else c.name
    return c
