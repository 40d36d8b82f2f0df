"""The whole RL step on this host: `scripts/train.py` on random weights, each phase per step.

    python benchmarks/rl_step.py --config=configs/grpo.py:1.5b \\
        --set=batch.max_completion_len=1024 --steps=2 --json=rl_step.json
    python benchmarks/rl_step.py --config=configs/grpo.py:1.5b,smoke --steps=1   # CPU

The trainer runs as a user runs it, in a child process, with `model.init=random` (random weights
of the config's architecture and a built tokenizer: no checkpoint, no download), arithmetic
prompts (no dataset), MMR on with the hashing encoder (no encoder download), the embedded
engine, no evaluation, checkpoints (none at the end either) or TensorBoard; then --set's
`key=value` overrides. Reported per step from its metrics.jsonl: every `time/*` phase
(rollout, rewards, embeddings, reweighting, reference log-probs, train, sync, compile),
`throughput/tokens` and tokens per second, and the completion lengths; the summary is the
median over the steps after the first (which compiles), or the first when there is only one.
--json is rewritten as each step's metrics arrive: a run stopped from outside keeps them.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

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
    "checkpoint.at_end": False,  # no final save (the 1.5B's is ~21 GB with Adam's state)
    "logging.every": 1,
    "logging.tensorboard": False,
    "logging.samples": 0,
    "reweight.method": "mmr",
    "reweight.embedding_model": "hashing",
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


def read_rows(workdir) -> list[dict]:
    """The run's metrics.jsonl rows so far (a half-written last line is left for later)."""
    path = pathlib.Path(workdir) / "metrics.jsonl"
    rows = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return rows


def report(args, rows: list[dict], rc) -> dict:
    steps = per_step(rows)
    return {
        "config": args.config,
        "set": args.set,
        "exit": rc,
        "steps": steps,
        "summary": summarize(steps),
    }


def main(argv=None) -> None:
    p = harness.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--config", default="configs/grpo.py:1.5b")
    p.add_argument("--set", action="append", default=[], help="config override key=value")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--workdir", default=None, help="the run's folder (default: a temp dir)")
    p.add_argument("--timeout_s", type=float, default=0, help="stop the run after (0: never)")
    p.add_argument("--json", default=None, help="written as each step's metrics arrive")
    args = p.parse_args(argv)
    workdir = args.workdir or tempfile.mkdtemp(prefix="rl_step_")
    cmd = command(args.config, args.steps, workdir, args.set)
    print(" ".join(cmd), flush=True)
    harness.write_json(args.json, report(args, [], "running"))
    # The trainer dies with this process (a time limit that stops this stops it too). The JSON
    # is rewritten whenever a step's metrics arrive, so a kill from outside keeps those steps.
    proc = subprocess.Popen(child_process.exec_argv(cmd), cwd=_REPO)
    deadline = time.monotonic() + args.timeout_s if args.timeout_s else None
    seen = 0
    while True:
        try:
            rc = proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            rc = None
            if deadline is not None and time.monotonic() > deadline:
                proc.kill()
                proc.wait()
                rc = "timed out"
        rows = read_rows(workdir)
        if len(rows) != seen or rc is not None:
            seen = len(rows)
            harness.write_json(args.json, report(args, rows, "running" if rc is None else rc))
        if rc is not None:
            break
    result = report(args, rows, rc)
    print(f"{args.config}: {len(result['steps'])} of {args.steps} steps, exit {rc}")
    print(format_summary(result["summary"]))
    if rc != 0 or len(result["steps"]) != args.steps:
        sys.exit(1)


if __name__ == "__main__":
    harness.run(main)
