"""Study v3: MMR-GRPO against GRPO on one GPU, sized so that a 5-point effect can be seen.

The plan, written before any run: docs/study_v3/plan.md. In order (nothing of it has run yet):

    # 1. The training prompts the start policy solves in 1 to 7 of 8 samples (plan, section 1):
    python scripts/filter_prompts.py --checkpoint=deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B \\
        --source=../shared/data/train/math_train.jsonl --out=runs/study_v3/train_filtered.jsonl \\
        --n=8 --low=1 --high=7 --max_new_tokens=1024 --temperature=0.7
    # 2. The compiled program, on CPU, before any GPU time (the only part run so far):
    python scripts/train.py --config=configs/study_v3.py:train --dry_run --dry_run_devices=1
    # 3. The pilot gate: GRPO, seeds 1-3 (plan, section 3); then the seeds are fixed from it.
    python scripts/study.py --config=configs/study_v3.py:pilot
    # 4. The arms:
    python scripts/study.py --config=configs/study_v3.py --archive=docs/study_v3/study

Config argument: '' (the study), 'pilot' (GRPO only, seeds 1-3), 'train' (the training config
alone, for `scripts/train.py --dry_run`).
"""

import os
import sys

import ml_collections

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import base

FILTERED_TRAIN = "runs/study_v3/train_filtered.jsonl"  # written by scripts/filter_prompts.py
# Fixed from the pilot's step-0 pass@1 p0 (plan, section 4) in a commit before the first arm;
# provisional for p0 = 30%: p0 + 10 and p0 + 15 points, rounded down to a multiple of 5.
FIXED_THRESHOLDS = (0.40, 0.45)
# Fixed from the pilot's spread (plan, section 3: design.seeds_from_pilot, at most 10) in
# the same commit; provisional.
SEEDS = (1, 2, 3, 4, 5, 6, 7, 8)


def train_config() -> ml_collections.ConfigDict:
    t = base.get_config("1.5b")  # DeepSeek-R1-Distill-Qwen-1.5B, full fine-tune
    t.name = "study_v3"
    t.total_steps = 200
    t.batch.prompts = 32  # >= 32 prompts x 8 completions a step
    t.batch.generations = 8
    t.batch.max_prompt_len = 512
    t.batch.max_completion_len = 1024  # reasoning room (>= 256); the filter used the same budget
    t.loss.minibatches = 32  # 8 completions per minibatch
    t.optim.lr = 1e-6  # the paper's; the pilot checks that clipping is rare (plan, section 3)
    t.data.source = FILTERED_TRAIN
    t.eval.benchmarks = ("math500",)  # 500 held-out problems (MATH test; training is MATH train)
    t.eval.n = 4
    t.eval.max_new_tokens = 1024
    t.eval.every = 20  # steps 0, 20, ..., 200: 11 evaluations; final = mean of steps 120-200
    t.eval.at_start = True
    t.checkpoint.every = 20
    t.checkpoint.keep = 1
    t.logging.tensorboard = False
    return t


def get_config(arg=None):
    if arg == "train":
        return train_config()
    c = ml_collections.ConfigDict()
    c.name = "gpu_v3"
    c.folder = "runs/study_v3"
    c.base_config = "configs/grpo.py:1.5b"
    c.train = train_config()
    c.variants = ml_collections.ConfigDict()  # arm -> delta on `train`
    c.variants.grpo = {}
    c.variants.mmr_grpo = {"reweight": {"method": "mmr"}}  # the paper's text: group scope
    # This project's variant, not the paper's: uniform raw-reward groups get advantage 0.
    c.variants.mmr_grpo_guard = {"reweight": {"method": "mmr", "uniform_group_guard": True}}
    c.run = ("grpo", "mmr_grpo", "mmr_grpo_guard")
    c.seeds = SEEDS
    c.baselines = ("grpo",)
    c.compare = (  # a - b paired by seed; the first is the primary comparison (plan.md)
        ("mmr_grpo", "grpo"),
        ("mmr_grpo_guard", "grpo"),
        ("mmr_grpo_guard", "mmr_grpo"),
    )
    c.threshold = 0.9  # steps to 90% of a peak (reported beside the fixed thresholds)
    c.fixed_thresholds = FIXED_THRESHOLDS
    if arg == "pilot":  # the gate: GRPO must learn, and its spread sizes the study
        c.name, c.folder = "gpu_v3_pilot", "runs/study_v3_pilot"
        c.run, c.seeds, c.compare = ("grpo",), (1, 2, 3), ()
    elif arg:
        raise ValueError(f"unknown config argument {arg!r}; expected 'pilot' or 'train'")
    return c
