"""The warm-up of study v2 (issue 26): SmolLM2-135M learns the answer format on one-digit sums.

Done once, before any candidate is measured or any arm runs; every arm starts from its export.
The task (sums of two operands 1-9, 81 questions) is disjoint from every study-v2 task
(`mmr_jax.problems.tasks`), so the arms learn those from scratch, not from the warm-up.

    python scripts/train.py --config=configs/study_v2_warmup.py --workdir=runs/study_v2_warmup
    cp -r runs/study_v2_warmup/step_12 checkpoints/smollm2-135m-warm   # the arms' model.path
    mkdir -p docs/study_v2/warmup && cp runs/study_v2_warmup/{metrics.jsonl,run.json} \\
        docs/study_v2/warmup/                                           # archived with this command

GRPO, 12 steps: in the first study every run had learnt the format by step 4 (completions
15-19 -> 7-10 tokens, held-out pass@1 ~7% -> 63-78%); 12 steps leave a margin. Held-out format
check: 32 of the 81 questions x 4 samples every 4 steps (those 32 are not trained on).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import base
import cpu_smollm2


def get_config(arg=None):
    c = cpu_smollm2.get_config()
    c.name = "study_v2_warmup"
    c.seed = 0  # not one of the arms' seeds 1-6
    c.reweight.method = "none"  # plain GRPO: the warm-up favours no arm
    c.total_steps = 12
    c.data.source = "arithmetic"
    c.data.arithmetic_max_operand = 9  # one-digit operands: no study-v2 question looks like these
    c.data.arithmetic_ops = ("+",)
    c.eval.every = 4
    c.eval.at_start = True
    c.eval.source = "arithmetic"
    c.eval.arithmetic_problems = 32
    c.eval.n = 4
    c.eval.max_new_tokens = c.batch.max_completion_len
    c.eval.system_prompt = c.data.system_prompt
    c.eval.number_only = True
    c.checkpoint.every = 12
    c.checkpoint.export_hf = True  # <workdir>/step_12: the HF folder the arms start from
    c.logging.tensorboard = False
    return base.apply_arg(c, arg)
