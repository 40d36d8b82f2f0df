"""`multihost.worker` that also saves each step's batch as every process built it, for the
N-processes-equal-1-process contract on the CPU default (tests/end_to_end/multihost_batch_test.py).

    procs = batch_dump.launch(config_dict, workdir, processes=2, devices=1)
    multihost.wait(procs, timeout)
    batch_dump.load(workdir, step=2, process=1)  # {'tokens', 'mask', 'advantages', ...}

Each process writes `<workdir>.batch.p<i>.s<n>.npz` at its n-th `pipeline.make_batch` (one per
step): the sampled tokens and their mask (the B groups, after the gather), the embeddings and
rewards the advantages came from, and the advantages. Nothing else changes in the run.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import numpy as np

REPO = pathlib.Path(__file__).resolve().parents[2]


def path(workdir, step: int, process: int) -> pathlib.Path:
    workdir = pathlib.Path(workdir)
    return workdir.parent / f"{workdir.name}.batch.p{process}.s{step}.npz"


def load(workdir, step: int, process: int = 0) -> dict[str, np.ndarray]:
    with np.load(path(workdir, step, process)) as f:
        return {k: f[k] for k in f.files}


def launch(config: dict, workdir, *, processes: int, devices: int) -> list[subprocess.Popen]:
    """As `multihost.launch` (the same flags, environment and outputs), with this file's worker."""
    import json

    from support import multihost

    workdir = pathlib.Path(workdir)
    workdir.parent.mkdir(parents=True, exist_ok=True)
    port = multihost.free_port()
    env = dict(os.environ, JAX_PLATFORMS="cpu", MMR_JAX_COMPILE_CACHE="off")
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(REPO / "tests"), env.get("PYTHONPATH", "")])
    cfg_file = workdir.parent / f"{workdir.name}.config.json"
    cfg_file.write_text(json.dumps(config))
    procs = []
    for i in range(processes):
        args = [sys.executable, "-u", __file__, f"--config_json={cfg_file}", f"--workdir={workdir}"]
        if processes > 1:
            args += [
                f"--coordinator_address=localhost:{port}",
                f"--num_processes={processes}",
                f"--process_id={i}",
                "--timeout_s=300",
            ]
        out = open(workdir.parent / f"{workdir.name}.process{i}.out", "w")
        procs.append(
            subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
        )
        procs[-1].out_path = out.name
    return procs


def _install(workdir: str) -> None:
    import jax
    from jax.experimental import multihost_utils

    from mmr_jax.step import pipeline

    real, calls = pipeline.make_batch, [0]

    def make_batch(cfg, groups, **kw):
        batch, info = real(cfg, groups, **kw)
        calls[0] += 1
        np.savez(
            path(workdir, calls[0], jax.process_index()),
            tokens=groups.tokens,
            mask=groups.mask,
            total=groups.total,
            embeddings=groups.embeddings if groups.embeddings is not None else np.zeros(0),
            advantages=multihost_utils.process_allgather(batch.advantages, tiled=True),
            sampler_logps=groups.sampler_logps if groups.sampler_logps is not None else np.zeros(0),
        )
        return batch, info

    pipeline.make_batch = make_batch


if __name__ == "__main__":
    sys.path[:0] = [str(REPO), str(REPO / "tests")]
    from support import multihost

    argv = sys.argv[1:]
    workdir = next(a.split("=", 1)[1] for a in argv if a.startswith("--workdir="))
    _install(workdir)
    import functools

    from mmr_jax import distributed

    # A CPU shared with other jobs can starve a process past JAX's 30 s heartbeat.
    distributed.options_from_flags = functools.partial(
        distributed.options_from_flags, heartbeat_s=600
    )
    sys.exit(multihost.worker(argv))
