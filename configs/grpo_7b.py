"""GRPO on DeepSeek-R1-Distill-Qwen-7B with LoRA (r 64, alpha 128); the README's example. Fits
one H100 (56.4 GiB a device with the `xla` attention fallback, 31.2 with cuDNN: `--dry_run
--dry_run_target=h100:1`, docs/performance.md).

python scripts/train.py --config=configs/grpo_7b.py --workdir=runs/grpo_7b \\
    --config.reweight.method=mmr
python scripts/train.py --config=configs/grpo_7b.py:smoke --workdir=/tmp/smoke   # CPU
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import grpo


def get_config(arg=None):
    # The frozen base is stored in the compute dtype (bf16; fp32 under :smoke), as for every
    # LoRA size (configs/base.py `apply_arg`): in fp32 it was 28.4 of the 7B step's 30.2 GiB of
    # arguments. The adapters stay fp32 master weights.
    return grpo.get_config(",".join(filter(None, ["7b", arg])))
