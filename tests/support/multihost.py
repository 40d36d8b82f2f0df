"""Real multi-process JAX runs on one CPU machine, for tests and benchmarks/bench_multihost.py.

`launch` starts N Python processes that form one JAX cluster (a coordinator on localhost, gloo
collectives), each with `devices` CPU devices, and runs this file's `worker` in each: start-up
through `distributed.initialize`, then `trainer.train` of a config given as JSON, logging as
scripts/train.py does (`<workdir>/train.log`, `train.process<i>.log`). `launch(1, 2)` is
the one-process reference on 2 devices. Nothing is mocked.

    procs = multihost.launch(config_dict, workdir, processes=2, devices=1)
    multihost.wait(procs, timeout=600)  # -> [(returncode, output)], in process order
"""

from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[2]
TARGET = set("0123456789")


def free_port(consecutive: int = 1) -> int:
    """A port P free now, with P + 1 .. P + consecutive - 1 free too (a study uses P + 1)."""
    while True:
        with socket.socket() as s:
            s.bind(("localhost", 0))
            port = s.getsockname()[1]
        try:
            for k in range(1, consecutive):
                with socket.socket() as s:
                    s.bind(("localhost", port + k))
            return port
        except OSError:
            continue


def start_all(cmds: list[list[str]], env: dict, cwd=REPO) -> list[subprocess.Popen]:
    """Starts every command at once (the processes of one cluster), output captured as text."""
    return [
        subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=cwd
        )
        for cmd in cmds
    ]


def outputs(procs: list[subprocess.Popen], timeout: float = 600) -> list[tuple[int, str, float]]:
    """(returncode, output, seconds until it had exited) of each of `start_all`'s processes."""
    import time

    t0 = time.monotonic()
    out = []
    for p in procs:
        text = p.communicate(timeout=timeout)[0]
        out.append((p.returncode, text, time.monotonic() - t0))
    return out


def launch(
    config: dict,
    workdir,
    *,
    processes: int,
    devices: int,
    port: int | None = None,
    extra_env: dict | None = None,
    per_process_config: list[dict] | None = None,
    per_process_env: list[dict] | None = None,
    cache_dir: str | None = None,
) -> list[subprocess.Popen]:
    """Starts the run's processes (outputs to `<workdir>/../<name>.process<i>.out`); process i
    gets `per_process_config[i]` and `per_process_env[i]` where given. With `cache_dir`, they
    load and store compiled programs there (XLA's persistent cache)."""
    workdir = pathlib.Path(workdir)
    workdir.parent.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    env = dict(os.environ, JAX_PLATFORMS="cpu", **(extra_env or {}))
    # The device count alone, not the tests' XLA_FLAGS (tests/conftest.py) with it: with those,
    # a 2-process run resumed after a kill is not bit for bit the uninterrupted one (Adam's nu of
    # the replicated norm weights differs; tests/end_to_end/multihost_test.py TestFaults,
    # 2026-11-26).
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    if cache_dir:  # XLA's persistent cache: its key holds the flags, so the tests' never load
        env.update(JAX_COMPILATION_CACHE_DIR=str(cache_dir))
        env.update(JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0.1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(REPO / "tests"), env.get("PYTHONPATH", "")])
    procs = []
    for i in range(processes):
        cfg_file = workdir.parent / f"{workdir.name}.config{i}.json"
        cfg = per_process_config[i] if per_process_config else config
        cfg_file.write_text(json.dumps(cfg))
        args = [sys.executable, "-u", __file__, f"--config_json={cfg_file}", f"--workdir={workdir}"]
        if processes > 1:
            args += [
                f"--coordinator_address=localhost:{port}",
                f"--num_processes={processes}",
                f"--process_id={i}",
            ]
        out = open(workdir.parent / f"{workdir.name}.process{i}.out", "w")
        procs.append(
            subprocess.Popen(
                args,
                env={**env, **(per_process_env[i] if per_process_env else {})},
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=REPO,
            )
        )
        procs[-1].out_path = out.name
    return procs


# Five small problems for scripts/evaluate.py on several processes (its own benchmark file, so
# the tests need no data folder).
EVAL_PROBLEMS = [
    {"id": f"p{i}", "problem": f"What is {a} + {b}? Answer in \\boxed{{}}.", "answer": a + b}
    for i, (a, b) in enumerate([(12, 35), (7, 8), (40, 2), (99, 1), (3, 30)])
]


def eval_benchmark_dir(folder: pathlib.Path) -> pathlib.Path:
    """`folder` holding math500.jsonl with `EVAL_PROBLEMS`."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "math500.jsonl").write_text("".join(json.dumps(p) + "\n" for p in EVAL_PROBLEMS))
    return folder


def evaluate(ckpt, data_dir, out_dir, *extra: str, processes: int) -> list[subprocess.Popen]:
    """scripts/evaluate.py on `processes` processes (a localhost cluster when more than one):
    the 5 problems of `data_dir`, n = 2, 8 new tokens, completions kept; `extra` flags added.
    Each process's output is its Popen's stdout (text)."""
    cmd = [
        sys.executable, str(REPO / "scripts" / "evaluate.py"),
        f"--config={REPO / 'configs' / 'eval.py'}",
        f"--config.checkpoint={ckpt}", f"--config.output_dir={out_dir}",
        f"--config.data_dir={data_dir}",
        "--config.benchmarks=('math500',)", "--config.max_problems=5", "--config.n=2",
        "--config.ks=(1,2)", "--config.max_new_tokens=8", "--config.grader_workers=0",
        "--config.keep_completions=True", *extra,
    ]  # fmt: skip
    port = free_port()
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    procs = []
    for i in range(processes):
        flags = []
        if processes > 1:
            flags = [f"--coordinator_address=localhost:{port}", f"--num_processes={processes}"]
            flags.append(f"--process_id={i}")
        procs.append(
            subprocess.Popen(
                cmd + flags, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
            )
        )
    return procs


def finished(procs: list[subprocess.Popen], timeout: float = 600) -> list[str]:
    """The outputs of `procs` (from `evaluate`), each asserted to have exited 0."""
    outs = [p.communicate(timeout=timeout)[0] for p in procs]
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 0, out[-3000:]
    return outs


def wait(procs: list[subprocess.Popen], timeout: float) -> list[tuple[int, str]]:
    """[(returncode, output)] of every process; kills them all and raises after `timeout`."""
    import time

    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        outs = "\n".join(pathlib.Path(p.out_path).read_text()[-3000:] for p in procs)
        raise TimeoutError(f"processes still running after {timeout} s:\n{outs}") from None
    return [(p.returncode, pathlib.Path(p.out_path).read_text()) for p in procs]


def _register_test_reward() -> None:
    import numpy as np

    from mmr_jax import rewards

    if "test_target" in rewards.REGISTRY:
        return

    def share(completion):
        return sum(ch in TARGET for ch in completion) / max(len(completion), 1)

    @rewards.register("test_target")
    def _target(completions, answers, *, lengths=None):
        """Pays for the share of digit characters (as tests/training/trainer_test.py's test
        reward)."""
        del answers, lengths
        return np.array([share(c) for c in completions], np.float32)

    @rewards.register("test_target_even")
    def _target_even(completions, answers, *, lengths=None):
        """`test_target` on problems with an even answer, 0 on the others: as a DAPO filter it
        drops about half the groups, so the dynamic-sampling retry loop runs."""
        del lengths
        even = [int(a) % 2 == 0 for a in answers]
        return np.array([share(c) if e else 0.0 for c, e in zip(completions, even, strict=True)])


def worker(argv: list[str]) -> int:
    """One process of a launched run: start-up, then `trainer.train`; exit codes as train.py's."""
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--config_json", required=True)
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--coordinator_address")
    parser.add_argument("--num_processes", type=int)
    parser.add_argument("--process_id", type=int)
    # Start-up only (every process registered): generous, the processes import JAX side by side
    # on 2 cores beside the rest of a test run.
    parser.add_argument("--timeout_s", type=int, default=300)
    args = parser.parse_args(argv)

    from mmr_jax import distributed

    try:
        opts = distributed.options_from_flags(
            distributed="off",
            coordinator_address=args.coordinator_address,
            num_processes=args.num_processes,
            process_id=args.process_id,
            timeout_s=args.timeout_s,
        )
        distributed.initialize(opts)
    except (ValueError, distributed.DistributedError) as e:
        print(f"ERROR: {type(e).__name__}: {e}", flush=True)
        return 2
    import jax
    import ml_collections

    from mmr_jax.config import checks
    from mmr_jax.infra import console
    from mmr_jax.training import trainer

    # As scripts/train.py: process 0 prints (and logs to train.log); the others log to a file.
    index = jax.process_index()
    name = "train.log" if index == 0 else f"train.process{index}.log"
    console.setup(pathlib.Path(args.workdir) / name, stdout=index == 0)
    _register_test_reward()
    cfg = checks.from_config_dict(
        ml_collections.ConfigDict(json.loads(pathlib.Path(args.config_json).read_text()))
    )
    try:
        trainer.train(cfg, args.workdir)
    except distributed.PeerLostError as e:
        print(f"ERROR: PeerLostError: {e}", flush=True)
        os._exit(3)  # JAX's exit barrier would wait for the dead process
    except distributed.DistributedError as e:
        print(f"ERROR: {type(e).__name__}: {e}", flush=True)
        return 2
    print("WORKER DONE", flush=True)
    return 0


if __name__ == "__main__":
    sys.path[:0] = [str(REPO), str(REPO / "tests")]
    sys.exit(worker(sys.argv[1:]))
