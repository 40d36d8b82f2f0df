"""The CPU default: MMR-GRPO on SmolLM2-135M-Instruct, easy generated arithmetic, full fine-tune.

A 2-core CPU shows the reward rising within about 30 minutes. Build the checkpoint once with
`python scripts/prepare_smollm2.py`, then:

    python scripts/train.py --config=configs/cpu_smollm2.py --workdir=runs/cpu_smollm2
    python scripts/plot_run.py runs/cpu_smollm2 --out=runs/cpu_smollm2/curves.png

`:smoke` shortens it to a few steps.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import base


def get_config(arg=None):
    c = base.get_config()
    c.name = "cpu_smollm2"
    c.total_steps = 30
    c.model.path = "checkpoints/smollm2-135m-instruct"
    c.model.dtype = "float32"  # CPUs have no fast bf16 matmul
    c.model.remat = False
    c.optim.lr = 2e-5  # a small model moves little at the paper's 1e-6 within 30 steps
    c.optim.warmup_ratio = 0.05
    c.batch.prompts = 4
    c.batch.generations = 8
    c.batch.max_prompt_len = 96
    c.batch.max_completion_len = 48
    c.batch.length_buckets = 2
    c.rollout.temperature = 0.7
    c.rewards.weights = {"accuracy": 1.0, "format": 0.0, "cosine": 0.0}
    c.loss.beta = 0.0  # no reference pass: halves the forward work on a CPU
    c.loss.minibatches = 2
    c.mmr.enabled = True
    c.mmr.embedding_model = "hashing"  # no encoder download; sentence-transformers when installed
    c.data.source = "arithmetic"  # generated one-step arithmetic ("What is 17 + 25?")
    c.data.system_prompt = "Answer with the number only, as \\boxed{N}."
    c.eval.every = 0
    c.checkpoint.every = 10
    c.checkpoint.keep = 2
    c.logging.samples = 1
    return base.apply_arg(c, arg)
