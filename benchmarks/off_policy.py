"""Synchronous vs one-step off-policy rollouts (`rollout.off_policy_lag` 0 and 1), same run, one
command: each mode's step time, and the phases that overlap.

    python benchmarks/off_policy.py --steps=4 --json=off_policy.json          # CPU default
    python benchmarks/off_policy.py --config=configs/grpo.py:1.5b,smoke --set=model.init=random

Each mode is `scripts/train.py` in a child process (as `benchmarks/rl_step.py` runs it: no
evaluation, checkpoints or TensorBoard, MMR with the hashing encoder, arithmetic prompts), under
`taskset -c <--cpus>`. With the embedded engine trainer and sampler are one process, so it is
pinned to all of --cpus (default 0,1: both cores of the CPU box) and the off-policy mode overlaps
the update with the next step's sampling inside it. With a vLLM server started apart, pinned to
other cores (`taskset -c 0 vllm serve ...`), pass `--cpus=1 --set=rollout.engine=vllm
--set=rollout.url=http://127.0.0.1:8000` (docs/off_policy.md).

Reported per mode: the median over the steps after the first (which compiles) of time/step and
its phases (time/rollout, time/train, time/rollout_wait: the update's wait for the next step's
rollout), the wall time of the whole child and its peak RSS. The speedup is sync time/step over
off-policy's.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import threading
import time

_REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(_REPO))
from mmr_jax import bench_harness as harness  # noqa: E402
from mmr_jax import child_process  # noqa: E402

rl_step = harness.load("rl_step")

MODES = {"sync": 0, "off_policy": 1}
COLUMNS = [
    ("mode", "mode", ""),
    ("steps", "steps", "d"),
    ("time/step", "step s", ".2f"),
    ("time/rollout", "rollout s", ".2f"),
    ("time/train", "train s", ".2f"),
    ("time/rollout_wait", "wait s", ".2f"),
    ("wall_s", "wall s", ".1f"),
    ("peak_rss_gib", "RSS GiB", ".2f"),
    ("speedup", "speedup", ".2f"),
]


def command(config: str, steps: int, workdir: str, sets: list[str], lag: int, cpus: str):
    """The pinned child command of one mode (`rl_step.command` with the lag set)."""
    argv = rl_step.command(config, steps, workdir, [*sets, f"rollout.off_policy_lag={lag}"])
    return ["taskset", "-c", cpus, *argv] if cpus else argv


def run_mode(mode: str, args) -> dict:
    workdir = tempfile.mkdtemp(prefix=f"off_policy_{mode}_")
    cmd = command(args.config, args.steps, workdir, args.set, MODES[mode], args.cpus)
    harness.progress(" ".join(cmd))
    if cmd[0] == "taskset":  # the trainer dies with this process (taskset execs it)
        cmd = [*cmd[:3], *child_process.exec_argv(cmd[3:])]
    else:
        cmd = child_process.exec_argv(cmd)
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=_REPO)  # taskset and the wrapper exec: one pid throughout
    timer = threading.Timer(args.timeout_s, proc.kill) if args.timeout_s else None
    if timer is not None:
        timer.start()
    try:
        _, status, usage = os.wait4(proc.pid, 0)  # its own peak RSS, not the earlier modes'
    finally:
        if timer is not None:
            timer.cancel()
    rc = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - t0
    path = pathlib.Path(workdir) / "metrics.jsonl"
    text = path.read_text() if path.exists() else ""
    rows = [json.loads(x) for x in text.splitlines() if x.strip()]
    lags = [r.get("rollout/policy_lag", 0.0) for r in sorted(rows, key=lambda r: r["step"])]
    steps = rl_step.per_step(rows)
    out = {"mode": mode, "exit": rc, "steps": len(steps), "wall_s": wall, "policy_lag": lags}
    out["peak_rss_gib"] = usage.ru_maxrss / 2**20  # KiB on Linux
    out.update(rl_step.summarize(steps))
    out["per_step"] = steps
    if rc != 0 or len(steps) != args.steps:
        out["error"] = f"exit {rc}, {len(steps)} of {args.steps} steps (workdir {workdir})"
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--config", default="configs/cpu_smollm2.py")
    p.add_argument("--set", action="append", default=[], help="config override key=value")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--cpus", default="0,1", help="taskset -c list of the trainer ('' = none)")
    p.add_argument("--modes", default="sync,off_policy")
    p.add_argument("--timeout_s", type=float, default=0, help="per mode (0: no limit)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    args.set = ["model.init=pretrained", *args.set]  # rl_step's default is random weights
    rows = [run_mode(m, args) for m in args.modes.split(",")]
    base = next((r for r in rows if r["mode"] == "sync" and "time/step" in r), None)
    for r in rows:
        if base is not None and r.get("time/step"):
            r["speedup"] = base["time/step"] / r["time/step"]
    result = {"config": args.config, "set": args.set, "cpus": args.cpus, "rows": rows}
    harness.write_json(args.json, result)
    print(f"{args.config} {' '.join(args.set)} | taskset -c {args.cpus or '(none)'}")
    print(harness.format_table(rows, COLUMNS))
    if any("error" in r for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
