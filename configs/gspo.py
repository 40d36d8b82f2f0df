"""GSPO (Zheng et al. 2025): sequence-level ratio exp(mean_t log(pi / pi_old)), clipped per
sequence at 1 - 3e-4 / 1 + 4e-4 (the paper's v2, section 5.1; TRL's paper index), no KL,
seq-mean-token-mean; format 1 + cosine 2 as GRPO. `reweight.method=mmr` gives MMR-GSPO.

The ratio is 1 on the first pass over a batch, where GSPO is GRPO; it acts from the second, so
the variant takes two passes (`loss.iterations=2`, TRL's num_iterations) where the paper splits
each rollout batch into 4 successive updates; that form is one override away (issue 47):
`--config.loss.iterations=1 --config.loss.updates_per_batch=4`.

    python scripts/train.py --config=configs/gspo.py:7b --workdir=runs/gspo_7b
    python scripts/train.py --config=configs/gspo.py:1.5b --workdir=runs/mmr_gspo_1.5b \\
        --config.reweight.method=mmr
    python scripts/train.py --config=configs/gspo.py:8b,smoke --workdir=/tmp/smoke   # CPU
    # GSPO-token (same loss; the same gradient unless loss.tis_mode is token_*):
    python scripts/train.py --config=configs/gspo.py:7b --workdir=runs/gspo_token_7b \\
        --config.loss.importance_sampling_level=sequence_token
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import base


def get_config(arg=None):
    c = base.get_config()
    c.name = "gspo"
    c.loss.importance_sampling_level = "sequence"
    c.loss.eps_low = 3e-4
    c.loss.eps_high = 4e-4
    c.loss.beta = 0.0
    c.loss.aggregation = "seq_mean_token_mean"
    c.loss.iterations = 2
    return base.apply_arg(c, arg)
