"""The tiny study of the study tests: configs/study.py:pilot at test size, and its CLI flags."""

import pathlib
import sys

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "configs"))
import study as study_config  # noqa: E402

from mmr_jax.config import command_line  # noqa: E402


def tiny_study(ckpt, folder, **train):
    """configs/study.py:pilot made tiny: 2 runs (grpo, mmr_grpo) x seed 1 of 3 steps on the
    checkpoint `ckpt`, evaluated every step on 4 held-out sums; `train` sets training keys
    ('optim.lr': 1e-3)."""
    c = study_config.get_config("pilot")
    c.folder = str(folder)
    c.run = ("grpo", "mmr_grpo")
    c.compare = (("mmr_grpo", "grpo"),)
    c.baselines = ("grpo",)
    t = c.train
    t.model.path = str(ckpt)
    t.reweight.embedding_model = "hashing"
    t.data.system_prompt = t.eval.system_prompt = ""
    t.batch.prompts, t.batch.generations, t.loss.minibatches = 2, 4, 2
    t.batch.max_prompt_len, t.batch.max_completion_len = 32, 16
    t.rewards.weights = {"accuracy": 0.0, "format": 0.0, "cosine": 1.0}
    t.optim.lr = 1e-3
    t.total_steps, t.eval.every, t.checkpoint.every = 3, 1, 1
    t.eval.arithmetic_problems, t.eval.n, t.eval.max_new_tokens = 4, 2, 8
    t.logging.samples = 0
    command_line.set_keys(t, train)
    return c


def overrides(c) -> list[str]:
    """The CLI flags that make configs/study.py:pilot into `c` (the keys `tiny_study` sets). Each
    key once: absl does not take a repeated `--config.run` as the last one given."""
    t = c.train
    flags = [f"--config.folder={c.folder}"]
    flags += [f"--config.{key}={tuple(c[key])!r}" for key in ("run", "compare", "baselines")]
    for key in ("model.path", "reweight.embedding_model", "data.system_prompt",
                "eval.system_prompt", "batch.prompts", "batch.generations", "loss.minibatches",
                "batch.max_prompt_len",
                "batch.max_completion_len", "optim.lr", "total_steps", "eval.every",
                "checkpoint.every", "eval.arithmetic_problems", "eval.n", "eval.max_new_tokens",
                "logging.samples"):  # fmt: skip
        node = t
        for p in key.split("."):
            node = node[p]
        flags.append(f"--config.train.{key}={node}")
    flags += [f"--config.train.rewards.weights.{k}={v}" for k, v in t.rewards.weights.items()]
    return flags


def strip_wall_clock(tree):
    """A study.json tree without its wall-clock fields (`train_s`, `wall_s`): what must be equal
    between two runs of one study."""
    if isinstance(tree, dict):
        return {
            k: strip_wall_clock(v) for k, v in tree.items() if "train_s" not in k and k != "wall_s"
        }
    if isinstance(tree, list):
        return [strip_wall_clock(v) for v in tree]
    return tree
