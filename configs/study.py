"""The CPU study (issue 18): GRPO vs MMR-GRPO vs DRA-GRPO on SmolLM2-135M, 3 seeds, same budget.

    python scripts/study.py --config=configs/study.py             # runs, or resumes, the grid
    python scripts/study.py --config=configs/study.py --report_only
    python scripts/study.py --config=configs/study.py --base_accuracy   # the untrained model
    python scripts/study.py --config=configs/study.py:pilot       # 1 seed, 4 steps: the pipeline

`train` is the base training config (`base_config`) with the study's task and held-out
evaluation; each variant is a delta on it (nested dicts of training keys); every run of the grid
is `train` + delta + seed. Optional rows: add `mmr_grpo_batch` or `mmr_grpo_lam05` to `run`.
Measured base accuracy of the task candidates: docs/study_cpu.md.
"""

import os
import sys

import ml_collections

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cpu_smollm2


def get_config(arg=None):
    c = ml_collections.ConfigDict()
    c.name = "cpu_arith"  # study name: report title, run names
    c.folder = "runs/study_cpu"  # one workdir per run, study_config.json, study.json, report.md
    c.base_config = "configs/cpu_smollm2.py"  # the training config `train` starts from (recorded)

    t = cpu_smollm2.get_config()
    t.name = "study"
    t.reweight.method = "none"  # the variants switch reweighting on
    t.total_steps = 40  # same budget for every run (the base model saturates within ~15-20)
    # The task (docs/study_cpu.md): sums of operands up to 10, the base model at ~10% pass@1.
    t.data.arithmetic_max_operand = 10
    t.data.arithmetic_ops = ("+",)
    t.eval.every = 2  # the base model's accuracy on it rises within ~15 steps: resolve that
    t.eval.at_start = True  # step 0: the base model, so "steps to 90% of peak" can be 0
    t.eval.source = "arithmetic"  # held-out set: own seed, removed from the training problems
    t.eval.arithmetic_problems = 64
    t.eval.n = 4  # pass@1 over 4 samples per problem
    t.eval.max_new_tokens = t.batch.max_completion_len
    t.eval.system_prompt = t.data.system_prompt  # the task's prompt, not the paper's math prompt
    t.eval.number_only = True  # as the training reward: restating "3 + 9" is not an answer
    t.checkpoint.every = 2
    t.logging.tensorboard = False
    c.train = t  # the base training config of every run

    c.variants = ml_collections.ConfigDict()  # name -> delta on `train` (nested training keys)
    c.variants.grpo = {}
    c.variants.mmr_grpo = {"reweight": {"method": "mmr"}}
    c.variants.dra_grpo = {"reweight": {"method": "dra"}}
    c.variants.mmr_grpo_batch = {"reweight": {"method": "mmr", "scope": "batch"}}
    c.variants.mmr_grpo_lam05 = {"reweight": {"method": "mmr", "lam": 0.5}}
    c.run = ("grpo", "mmr_grpo", "dra_grpo")  # variants run, in this order
    c.seeds = (1, 2, 3)  # training seeds (sampling, data order); the held-out set is fixed
    c.baselines = ("grpo", "dra_grpo")  # "best baseline peak": the highest mean peak of these
    c.compare = (("mmr_grpo", "grpo"), ("mmr_grpo", "dra_grpo"))  # paired a - b over seeds
    c.threshold = 0.9  # steps to this fraction of a peak

    if arg == "pilot":  # the whole pipeline, small: 1 seed, 2 steps, 16 held-out problems x 2
        c.name, c.folder, c.seeds = "cpu_arith_pilot", "runs/study_cpu_pilot", (1,)
        t.total_steps, t.eval.every, t.checkpoint.every = 2, 2, 1
        t.eval.arithmetic_problems, t.eval.n = 16, 2
        t.loss.minibatches = 4  # less activation memory on a shared machine; same gradient
    elif arg:
        raise ValueError(f"unknown config argument {arg!r}; expected 'pilot'")
    return c
