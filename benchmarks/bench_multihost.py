"""Step time of 1 process x 2 devices against 2 processes x 1 device (same mesh (1, 2, 1)), and the
time the 2-process run spends in host-side cross-process collectives per step.

    python benchmarks/bench_multihost.py                      # the CPU default (SmolLM2), 4 steps
    python benchmarks/bench_multihost.py --steps=6 --out=/tmp/bench_multihost.json

Both layouts run the same config as real processes on this machine (tests/support/multihost.py:
a localhost coordinator, gloo collectives). Step 1 compiles, so the figures are medians over the
later steps. `time/collectives` counts the rollout gathers (completions with their rewards and
embeddings, one per generation round) and the weight copies to the per-process samplers; the
metric reduction, which queues behind the next train step, is not counted, and the train step's
own collectives run inside its jit (they show in `time/train` against the one-process run). On a
shared CPU the numbers are noisy.
"""

import json
import pathlib
import statistics
import sys
import tempfile
import time

from absl import flags

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]
from mmr_jax.config import command_line  # noqa: E402
from mmr_jax.infra import bench_harness as harness  # noqa: E402
from mmr_jax.infra import metrics, user_errors  # noqa: E402

from support import multihost  # noqa: E402

_CONFIG = flags.DEFINE_string("config", "configs/cpu_smollm2.py", "Config file (configs/*.py).")
_STEPS = flags.DEFINE_integer("steps", 4, "Training steps per layout (step 1 compiles).")
_OUT = flags.DEFINE_string("out", None, "Also write the figures here as JSON.")
_TIMEOUT = flags.DEFINE_integer("timeout_s", 1800, "Per layout.")
KEYS = (
    "time/step", "time/rollout", "time/rewards", "time/embeddings", "time/train", "time/sync",
    "time/collectives",
)  # fmt: skip


def _config() -> dict:
    c = command_line.load_config_file(str(REPO / _CONFIG.value))
    c.total_steps = _STEPS.value
    c.checkpoint.every = _STEPS.value
    c.logging.tensorboard = False
    c.logging.samples = 0
    c.eval.every = 0
    c.mesh.shape = (1, 2, 1)
    if not pathlib.Path(c.model.path).is_absolute():
        c.model.path = str(REPO / c.model.path)
    return json.loads(json.dumps(c.to_dict()))


def _layout(cfg: dict, root: pathlib.Path, processes: int, devices: int) -> dict:
    work = root / f"p{processes}_d{devices}"
    t0 = time.perf_counter()
    results = multihost.wait(
        multihost.launch(cfg, work, processes=processes, devices=devices), _TIMEOUT.value
    )
    for rc, out in results:
        if rc != 0:
            raise RuntimeError(f"{processes} x {devices} failed:\n{out[-3000:]}")
    rows = metrics.read_jsonl(work / metrics.METRICS_FILE)[1:]  # step 1 compiles
    out = {
        k: statistics.median(r[k] for r in rows) for k in KEYS if all(k in r for r in rows) and rows
    }
    out["wall_s"] = time.perf_counter() - t0
    out["steps_timed"] = len(rows)
    return out


def main(argv):
    del argv
    cfg = _config()
    with tempfile.TemporaryDirectory() as tmp:
        root = pathlib.Path(tmp)
        one = _layout(cfg, root, 1, 2)
        two = _layout(cfg, root, 2, 1)
    print(f"{cfg['name']}: {_STEPS.value} steps, mesh (1, 2, 1); medians over steps 2..")
    print(f"{'':24s}{'1 proc x 2 dev':>16s}{'2 proc x 1 dev':>16s}")
    for k in (*KEYS, "wall_s"):
        a, b = one.get(k), two.get(k)
        fmt = lambda v: f"{v:16.2f}" if v is not None else f"{'-':>16s}"
        print(f"{k:24s}{fmt(a)}{fmt(b)}")
    if _OUT.value:
        harness.write_json(_OUT.value, {"1x2": one, "2x1": two})


if __name__ == "__main__":
    user_errors.run(main)
