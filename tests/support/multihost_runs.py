"""Training runs of the multi-process tests: their config, launch, and metric comparisons.

    cfg = multihost_runs.config(grpo, tiny_llama_dir, steps=3)
    multihost_runs.ok(multihost_runs.run(cfg, workdir, processes=2, devices=1))
    multihost_runs.assert_same(multihost_runs.metrics(one), multihost_runs.metrics(two))

`config` is a variant's smoke config on arithmetic problems with a reward a tiny random model
gets varied values of (`multihost.TARGET` digits), mesh (1, 2, 1) in every layout; `restore`
reads a workdir's latest checkpoint in this process (one device) for `crash_harness.differences`.
"""

from __future__ import annotations

import json
import math
import pathlib

import numpy as np

from mmr_jax.infra import metrics
from mmr_jax.step import train_step
from mmr_jax.training import build

from support import multihost, testing

# Host-side timings and throughput differ between runs; everything else must agree.
UNTIMED = ("time/", "throughput/")
# mismatch/* are differences of two log-probs of the same tokens (sampler vs trainer), each of
# magnitude up to ~log(V) = 6.2 with an fp32 ulp of 4.8e-7: they are rounding noise themselves,
# and two layouts round differently. Four ulps of 8.0.
_ROUNDING_KEYS, _ROUNDING_ATOL = ("mismatch/",), 4 * float(np.spacing(np.float32(8.0)))


def config(module, ckpt, *, steps=2, **overrides) -> dict:
    """`testing.smoke_config` with MMR on, TensorBoard off and the same (data, fsdp, tensor)
    mesh shape in both layouts (fsdp over 2 devices), then dotted `overrides`; as plain JSON."""
    fixed = {"logging.tensorboard": False, "mesh.shape": (1, 2, 1)}
    c = testing.smoke_config(module, ckpt, steps=steps, mmr=True, **{**fixed, **overrides})
    return json.loads(json.dumps(c.to_dict()))


def launch(cfg, workdir, *, processes, devices, **kw):
    """`multihost.launch` with the tests' persistent compilation cache: the runs of a module
    (the same config on 1 and 2 processes, again after a kill) compile each program once."""
    kw.setdefault("cache_dir", testing.XLA_CACHE_DIR)
    return multihost.launch(cfg, workdir, processes=processes, devices=devices, **kw)


def run(cfg, workdir, *, processes, devices, timeout=900, **kw):
    """[(returncode, output)] of a launched run (`launch`), waited for."""
    return multihost.wait(launch(cfg, workdir, processes=processes, devices=devices, **kw), timeout)


def ok(results):
    for rc, out in results:
        assert rc == 0 and "WORKER DONE" in out, out[-4000:]


def metrics_of(workdir) -> list[dict]:
    """The run's metric rows without the timings."""
    rows = metrics.read_jsonl(pathlib.Path(workdir) / metrics.METRICS_FILE)
    return [{k: v for k, v in r.items() if not k.startswith(UNTIMED)} for r in rows]


def assert_same(a: list[dict], b: list[dict]):
    """The same steps and metrics, within fp32 rounding (the contract's tolerance)."""
    assert [r["step"] for r in a] == [r["step"] for r in b] and a
    for ra, rb in zip(a, b, strict=True):
        assert set(ra) == set(rb), set(ra) ^ set(rb)
        for k in ra:
            atol = _ROUNDING_ATOL if k.startswith(_ROUNDING_KEYS) else 1e-6
            assert math.isclose(ra[k], rb[k], rel_tol=2e-5, abs_tol=atol), (
                ra["step"],
                k,
                ra[k],
                rb[k],
            )


def restore(workdir):
    """(checkpoint tree, meta) of `workdir`'s latest checkpoint, read on this process's device."""
    import jax

    from mmr_jax.config import checks
    from mmr_jax.training import checkpoint, workdir_guard

    cfg = checks.from_config_dict(workdir_guard.read_run_config(workdir))
    policy = build.load_policy(cfg)
    optimizer, _ = train_step.make_optimizer(cfg.optim, total_updates=cfg.total_updates)
    state = train_step.init_state(policy.params, optimizer, seed=cfg.seed, loss=cfg.loss)
    ck = checkpoint.Checkpointer(pathlib.Path(workdir) / checkpoint.CKPT_DIR, keep=None)
    # A checkpoint of several processes restores here only with a sharding given for every leaf.
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device),
        checkpoint.state_tree(state),
    )
    try:
        return ck.restore(abstract)
    finally:
        ck.close()


def header_resume_step(output: str) -> int | None:
    """The step a run's header says it resumes from (None: a new run)."""
    line = next(x for x in output.splitlines() if "| workdir " in x)
    return int(line.rsplit("resuming from step ", 1)[1]) if "resuming from" in line else None
