"""The whole RL step on this host: `scripts/train.py` on random weights, each phase per step.

    python benchmarks/rl_step.py --config=configs/grpo.py:1.5b \\
        --set=batch.max_completion_len=1024 --steps=2 --json=rl_step.json
    python benchmarks/rl_step.py --config=configs/grpo.py:1.5b,smoke --steps=1   # CPU

The trainer runs as a user runs it, in a child process, with `model.init=random` (random weights
of the config's architecture and a built tokenizer: no checkpoint, no download), arithmetic
prompts (no dataset), MMR on with the hashing encoder (no encoder download), the embedded
engine, no evaluation, checkpoints or TensorBoard; then --set's `key=value` overrides. Reported
per step from its metrics.jsonl: every `time/*` phase (rollout, rewards, embeddings,
reweighting, reference log-probs, train, sync, compile), `throughput/tokens` and tokens per
second, and the completion lengths; the summary is the median over the steps after the first
(which compiles), or the first when there is only one.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import subprocess
import sys
import tempfile

_REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(_REPO))
from mmr_jax.infra import bench_harness as harness  # noqa: E402
from mmr_jax.infra import child_process  # noqa: E402

# What makes the run need nothing but this tree (overridable by --set).
BASE = {
    "model.init": "random",
    "data.source": "arithmetic",
    "eval.every": 0,
    "checkpoint.every": 0,
    "logging.every": 1,
    "logging.tensorboard": False,
    "logging.samples": 0,
    "mmr.enabled": True,
    "mmr.embedding_model": "hashing",
}
KEPT = ("time/", "throughput/", "completion/length")


def command(config: str, steps: int, workdir: str, sets: list[str]) -> list[str]:
    over = dict(BASE, total_steps=steps)
    for s in sets:
        key, sep, value = s.partition("=")
        if not sep:
            raise ValueError(f"--set wants key=value, got {s!r}")
        over[key] = value
    argv = [sys.executable, str(_REPO / "scripts" / "train.py"), f"--config={config}"]
    return argv + [f"--workdir={workdir}"] + [f"--config.{k}={v}" for k, v in over.items()]


def per_step(rows: list[dict]) -> list[dict]:
    """The kept figures of each metrics.jsonl row, in step order."""
    rows = sorted(rows, key=lambda r: r["step"])
    return [{"step": r["step"], **{k: v for k, v in r.items() if k.startswith(KEPT)}} for r in rows]


def summarize(steps: list[dict]) -> dict:
    """Median of every figure over the steps after the first (the first alone if only one)."""
    if not steps:
        return {}
    timed = steps[1:] or steps
    keys = sorted({k for s in timed for k in s if k != "step"})
    return {k: statistics.median(s[k] for s in timed if k in s) for k in keys}


def format_summary(summary: dict) -> str:
    lines = [f"  {k:<34s} {v:12.3f}" for k, v in summary.items() if k.startswith("time/")]
    lines += [f"  {k:<34s} {v:12.1f}" for k, v in summary.items() if not k.startswith("time/")]
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--config", default="configs/grpo.py:1.5b")
    p.add_argument("--set", action="append", default=[], help="config override key=value")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--workdir", default=None, help="the run's folder (default: a temp dir)")
    p.add_argument("--timeout_s", type=float, default=0, help="stop the run after (0: never)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    workdir = args.workdir or tempfile.mkdtemp(prefix="rl_step_")
    cmd = command(args.config, args.steps, workdir, args.set)
    print(" ".join(cmd), flush=True)
    try:
        # The trainer dies with this process (a time limit that stops this stops it too).
        run = subprocess.run(
            child_process.exec_argv(cmd), cwd=_REPO, timeout=args.timeout_s or None
        )
        rc = run.returncode
    except subprocess.TimeoutExpired:
        rc = "timed out"
    path = pathlib.Path(workdir) / "metrics.jsonl"
    rows = (
        [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []
    )
    steps = per_step(rows)
    result = {"config": args.config, "set": args.set, "exit": rc, "steps": steps}
    result["summary"] = summarize(steps)
    harness.write_json(args.json, result)
    print(f"{args.config}: {len(steps)} of {args.steps} steps, exit {rc}")
    print(format_summary(result["summary"]))
    if rc != 0 or len(steps) != args.steps:
        sys.exit(1)


if __name__ == "__main__":
    main()
