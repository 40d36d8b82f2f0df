"""Config of the crash harness's runs (tests/support/crash_harness.py): a variant's smoke config.

    python scripts/train.py --config=tests/support/crash_harness_config.py:dapo --workdir=/tmp/h \\
        --config.model.path=<tiny checkpoint>
"""

import importlib
import pathlib
import sys

_REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(_REPO))
sys.path.insert(0, str(_REPO / "tests"))
from support import crash_harness  # noqa: E402


def get_config(arg: str = "grpo"):
    """The config of a harness run: `configs/<arg>.py:smoke`, shrunk further (see crash_harness)."""
    sys.path.insert(0, str(_REPO / "configs"))
    c = importlib.import_module(arg).get_config("smoke")
    crash_harness.register_digit_reward()
    c.data.source = "arithmetic"
    c.data.system_prompt = ""
    c.reweight.embedding_model = "hashing"  # no encoder to load (`:smoke` keeps the CPU default's)
    c.batch.max_prompt_len = 32
    c.batch.max_completion_len = 16
    c.optim.lr = 1e-3
    c.optim.warmup_ratio = 0.0
    c.rewards.weights = {crash_harness.DIGIT_REWARD: 1.0}
    c.dynamic_sampling.filter_reward = crash_harness.DIGIT_REWARD
    c.checkpoint.every = 1
    c.checkpoint.keep = 3
    c.logging.samples = 0
    c.logging.tensorboard = False
    return c
