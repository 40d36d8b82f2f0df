"""The vLLM server `off_policy.py --engine=vllm` runs beside its trainer, pinned apart: its launch
options as the trainer would launch it (`server_options`), its start, restart and stop (`Server`),
and the peak summed RSS of its processes (`GroupRss`).
"""

from __future__ import annotations

import os
import pathlib
import threading

from mmr_jax.infra import bench_harness as harness

_REPO = harness.REPO
rl_step = harness.load("rl_step")


def server_options(config: str, sets: list[str], cpus: str, port: int):
    """`vllm_launch.LaunchOptions` of the server the trainer of `config` with `sets` would
    launch itself (its model, served name, lengths, seed, LoRA rank), pinned to `cpus`."""
    from mmr_jax.config import command_line
    from mmr_jax.rollout import vllm_launch

    path, sep, arg = config.partition(":")
    c = command_line.load_config_file(f"{_REPO / path}{sep}{arg}")  # as the child, from _REPO
    over = {**rl_step.BASE, **command_line.parse_assignments(sets)}
    command_line.set_keys(c, over)
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
