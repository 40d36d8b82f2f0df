"""CISPO (MiniMax-M1, Chen et al. 2025, eq. 4): -sg[clip(ratio, 1 - eps_low, 1 + eps_high)] * A *
logp, token-mean over the batch's tokens, no KL. The weight has no lower bound (eps_low = 1: the
paper "did not impose a lower bound") and is capped at 1 + eps_high = 5 (TRL's recommended
epsilon_high = 5.0 for loss_type='cispo', the ScaleRL paper's eps_max). Format 1 + cosine 2 as
GRPO. `reweight.method=mmr` gives MMR-CISPO.

On the first pass over a batch the weight is 1 and the gradient is the plain policy gradient; it
acts from the second pass, so the variant takes two (`loss.iterations=2`), as configs/gspo.py.

    python scripts/train.py --config=configs/cispo.py:7b --workdir=runs/cispo_7b
    python scripts/train.py --config=configs/cispo.py:1.5b --workdir=runs/mmr_cispo_1.5b \\
        --config.reweight.method=mmr
    python scripts/train.py --config=configs/cispo.py:8b,smoke --workdir=/tmp/smoke   # CPU
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import base


def get_config(arg=None):
    c = base.get_config()
    c.name = "cispo"
    c.loss.objective = "cispo"
    c.loss.eps_low = 1.0
    c.loss.eps_high = 4.0
    c.loss.beta = 0.0
    c.loss.aggregation = "token_mean"
    c.loss.iterations = 2
    return base.apply_arg(c, arg)
