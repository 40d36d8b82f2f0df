"""scripts/train.py itself on several local CPU processes (the real entry point, its exit paths
included), for tests/distributed/failures_test.py; and one process's command line and checkpoint
reader, for the resume tests (tests/training/trainer_test.py,
tests/end_to_end/remote_workdir_test.py).

    procs = train_script.launch(config_dict, workdir, processes=2, per_process_env=[{}, {...}])
    subprocess.run(train_script.train_cmd(workdir, ckpt, steps=3), ...)
    initial, trained, meta = train_script.params(workdir, cfg)

The config (a plain dict, e.g. `testing.smoke_config(...).to_dict()`) is written as JSON with a
config file that reads it, so that `--config=` takes it as any configs/*.py file.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

from support import multihost

REPO = pathlib.Path(__file__).resolve().parents[2]
_CONFIG_FILE = """import json
import ml_collections


def get_config(arg=None):
    del arg
    return ml_collections.ConfigDict(json.loads(open({path!r}).read()))
"""


def cluster_config(ckpt, *, steps: int) -> dict:
    """GRPO smoke config as a plain dict for `launch`: mesh (1, 2, 1) in every layout (fsdp over
    2 devices, whether 1 process has them or 2), accuracy reward only."""
    from support import testing

    sys.path.insert(0, str(REPO / "configs"))
    try:
        import grpo
    finally:
        sys.path.remove(str(REPO / "configs"))
    return testing.smoke_config(
        grpo,
        ckpt,
        steps=steps,
        **{
            "logging.tensorboard": False,
            "mesh.shape": (1, 2, 1),
            "rewards.weights": {"accuracy": 1.0, "format": 0.0},
            "dynamic_sampling.filter_reward": "accuracy",
        },
    ).to_dict()


def config_file(config: dict, folder) -> pathlib.Path:
    """A configs/*.py-style file returning `config` (JSON next to it)."""
    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / "config.json"
    data.write_text(json.dumps(config))
    path = folder / "config_json.py"
    path.write_text(_CONFIG_FILE.format(path=str(data)))
    return path


def launch(
    config: dict,
    workdir,
    *,
    processes: int,
    devices: int = 1,
    per_process_env: list[dict] | None = None,
    extra_args: tuple[str, ...] = (),
) -> list[subprocess.Popen]:
    """Starts `processes` runs of scripts/train.py forming one cluster (outputs to
    `<workdir>/../<name>.process<i>.out`, path in `proc.out_path`)."""
    workdir = pathlib.Path(workdir)
    cfg_file = config_file(config, workdir.parent / f"{workdir.name}.config")
    port = multihost.free_port()
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    # MMR_JAX_COMPILE_CACHE: the tests' cache (tests/conftest.py), so the processes share programs
    procs = []
    for i in range(processes):
        args = [
            sys.executable,
            "-u",
            str(REPO / "scripts" / "train.py"),
            f"--config={cfg_file}",
            f"--workdir={workdir}",
            *extra_args,
        ]
        if processes > 1:
            args += [
                f"--coordinator_address=localhost:{port}",
                f"--num_processes={processes}",
                f"--process_id={i}",
            ]
        out = open(workdir.parent / f"{workdir.name}.process{i}.out", "w")
        proc_env = {**env, **(per_process_env[i] if per_process_env else {})}
        procs.append(
            subprocess.Popen(args, env=proc_env, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
        )
        procs[-1].out_path = out.name
    return procs


def output(proc: subprocess.Popen) -> str:
    return pathlib.Path(proc.out_path).read_text()


def train_cmd(workdir, ckpt, steps, *, repo=REPO) -> list[str]:
    """scripts/train.py on configs/grpo.py:smoke for `steps` steps of MMR-GRPO on the checkpoint
    `ckpt` (arithmetic data, a checkpoint every step, 5 kept), as one process's command line;
    `repo`: the source tree whose script and config run (another commit's, unpacked)."""
    repo = pathlib.Path(repo)
    # Commits before issue 53 spell MMR as mmr.enabled (a run.json of theirs stores it so).
    new_keys = "c.reweight.method" in (repo / "configs" / "base.py").read_text()
    return [
        sys.executable,
        str(repo / "scripts" / "train.py"),
        f"--config={repo / 'configs' / 'grpo.py'}:smoke",
        f"--workdir={workdir}",
        f"--config.model.path={ckpt}",
        f"--config.total_steps={steps}",
        "--config.data.source=arithmetic",
        "--config.data.system_prompt=",
        "--config.reweight.method=mmr" if new_keys else "--config.mmr.enabled=True",
        # What `:smoke` sets differs between commits (issue 55 moved it to the CPU default's
        # task): written out, so that a run of an older commit is the same config today.
        f"--config.{'reweight' if new_keys else 'mmr'}.embedding_model=hashing",
        "--config.data.arithmetic_max_operand=10",
        "--config.data.arithmetic_ops=('+',)",
        "--config.dynamic_sampling.max_generation_batches=4",
        "--config.rewards.accuracy_number_only=True",
        "--config.rewards.weights.accuracy=1.0",
        "--config.rewards.weights.cosine=0.0",
        "--config.rewards.weights.format=0.0",
        "--config.batch.max_prompt_len=32",
        "--config.batch.max_completion_len=16",
        "--config.optim.lr=0.001",
        "--config.checkpoint.every=1",
        "--config.checkpoint.keep=5",
        "--config.logging.samples=0",
    ]


def params(workdir, cfg, step=None):
    """(initial params of `cfg`'s model, the params checkpointed in `workdir` at `step` (the
    latest if None), that checkpoint's metadata)."""
    import jax

    from mmr_jax.step import train_step
    from mmr_jax.training import build, checkpoint

    ck = checkpoint.Checkpointer(pathlib.Path(workdir) / checkpoint.CKPT_DIR, keep=None)
    policy = build.load_policy(cfg)
    optimizer, _ = train_step.make_optimizer(cfg.optim, total_updates=cfg.total_updates)
    state = train_step.init_state(policy.params, optimizer, seed=cfg.seed, loss=cfg.loss)
    tree, meta = ck.restore(
        jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), checkpoint.state_tree(state)
        ),
        step,
    )
    ck.close()
    return policy.params, tree["params"], meta
