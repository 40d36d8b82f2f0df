"""The CPU default: MMR-GRPO on SmolLM2-135M-Instruct, easy generated arithmetic, full fine-tune.

A 2-core CPU shows the reward rising within minutes; the run ends with the accuracy on 32
held-out sums before and after training. Build the checkpoint once with
`python scripts/prepare_smollm2.py`, then:

    python scripts/train.py --config=configs/cpu_smollm2.py --workdir=runs/cpu_smollm2
    python scripts/plot_run.py runs/cpu_smollm2 --out=runs/cpu_smollm2/curves.png

`:smoke` shortens it to a few steps. Evaluate its checkpoints (held-out sums, as in the run):

    python scripts/evaluate.py --config=configs/eval.py:run --config.run_dir=runs/cpu_smollm2
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import base


def get_config(arg=None):
    c = base.get_config()
    c.name = "cpu_smollm2"
    base.cpu_task(c)  # SmolLM2-135M-Instruct, sums of 1-10, accuracy reward, MiniLM
    c.total_steps = 30
    c.optim.lr = 2e-5  # a small model moves little at the paper's 1e-6 within 30 steps
    c.optim.warmup_ratio = 0.05
    c.batch.prompts = 4
    c.batch.generations = 8
    c.batch.max_prompt_len = 64
    c.batch.max_completion_len = 32
    c.batch.min_bucket_len = 8  # buckets 8, 12, 16, 24, 32 (completions average ~9 tokens)
    c.rollout.temperature = 0.7
    c.loss.beta = 0.0  # no reference pass: halves the forward work on a CPU
    c.loss.minibatches = 2
    c.reweight.method = "mmr"
    # Accuracy on 32 held-out sums (never trained on), before the first step and after the last:
    # the number training moves (the base model scores 0 on the MATH-500 style benchmarks).
    c.eval.source = "arithmetic"
    c.eval.arithmetic_problems = 32
    c.eval.at_start = True
    c.eval.every = c.total_steps
    c.eval.n = 8
    c.eval.max_new_tokens = 32
    c.eval.system_prompt = base.CPU_SYSTEM_PROMPT
    c.eval.number_only = True
    c.checkpoint.every = 10
    c.checkpoint.keep = 2
    c.logging.samples = 1
    return base.apply_arg(c, arg)
