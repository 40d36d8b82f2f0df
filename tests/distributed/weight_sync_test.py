"""mmr_jax/distributed/weight_sync.py: the weight hand-over of a multi-process run, gathered once
per process (never a copy on every device of the mesh), only what changed (the adapters under
LoRA), by one cached program; in one process and in real 2-process CPU clusters."""

import gc
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from mmr_jax import distributed
from mmr_jax.distributed import weight_sync

from support import weight_sync_worker

jax.config.update("jax_numpy_rank_promotion", "raise")


class TestGatherSpec:
    @pytest.mark.parametrize(
        "shape,local,spec",
        [
            ((8, 4), 2, P("local")),
            ((3, 4), 2, P(None, "local")),  # the first axis that divides
            ((3, 5), 2, P()),  # none divides: whole on each local device
            ((), 4, P()),
            ((8, 4), 1, P()),  # one device per process: the copy is whole already
        ],
    )
    def test_layout(self, shape, local, spec):
        assert weight_sync.gather_spec(shape, jnp.float32, local) == spec

    def test_rng_keys_stay_whole(self):
        keys = jax.random.split(jax.random.key(0), 4)
        assert weight_sync.gather_spec(keys.shape, keys.dtype, 2) == P()


class TestHostMesh:
    def test_one_row_per_process(self):
        mesh = weight_sync.host_mesh(jax.devices())
        assert mesh.axis_names == ("process", "local")
        assert mesh.devices.shape == (1, len(jax.devices()))

    def test_unequal_processes_are_a_named_error(self):
        class Dev:
            def __init__(self, p, i):
                self.process_index, self.id = p, i

        with pytest.raises(distributed.DistributedError, match="same number"):
            weight_sync.host_mesh([Dev(0, 0), Dev(0, 1), Dev(1, 2)])


class TestLocalCopies:
    """One process: every array is process-local, so the copies are local transfers; what is
    tested is which arrays are copied again and where the copies lie."""

    def test_copy_once_while_the_array_lives(self):
        copies = weight_sync.LocalCopies()
        tree = {"w": jnp.arange(6.0).reshape(2, 3), "n": 3, "b": jnp.ones(4, jnp.int32)}
        first = copies.copy(tree)
        assert first["n"] == 3
        for k in ("w", "b"):
            np.testing.assert_array_equal(np.asarray(first[k]), np.asarray(tree[k]))
            assert first[k] is not tree[k]  # a buffer of its own: the trainer may donate its own
            assert first[k].sharding.device_set == {jax.local_devices()[0]}
        again = copies.copy(tree)
        assert again["w"] is first["w"] and again["b"] is first["b"]  # not copied twice
        assert len(copies) == 2

        tree["w"] = tree["w"] + 1  # an update: a new array, copied; the old one's copy dropped
        gc.collect()
        third = copies.copy(tree)
        assert third["w"] is not first["w"] and third["b"] is first["b"]
        np.testing.assert_array_equal(np.asarray(third["w"]), np.arange(1.0, 7.0).reshape(2, 3))
        assert len(copies) == 2

    def test_a_deleted_copy_is_made_again(self):
        copies = weight_sync.LocalCopies()
        x = jnp.arange(4.0)
        first = copies.copy([x])[0]
        first.delete()  # e.g. donated by whoever held it
        second = copies.copy([x])[0]
        assert second is not first
        np.testing.assert_array_equal(np.asarray(second), np.arange(4.0))

    def test_a_dropped_copy_is_not_kept(self):
        """The cache holds copies weakly: one its user dropped is gone, and made again."""
        copies = weight_sync.LocalCopies()
        x = jnp.arange(4.0)
        first = copies.copy([x])[0]
        assert len(copies) == 1
        del first
        gc.collect()
        assert len(copies) == 0
        np.testing.assert_array_equal(np.asarray(copies.copy([x])[0]), np.arange(4.0))

    def test_local_copy_uses_the_process_copies(self):
        x = jnp.arange(3.0)
        a = distributed.local_copy({"x": x})
        assert distributed.local_copy({"x": x})["x"] is a["x"]


def test_vllm_engine_reads_adapters_alone_under_lora():
    """What `ShareEngine.sync_weights` asks of a vLLM engine: the adapters alone under LoRA."""
    from mmr_jax.rollout import vllm_engine

    prop = vllm_engine.VllmEngine.syncs_adapters_only
    assert prop.fget(types.SimpleNamespace(lora=True)) is True
    assert prop.fget(types.SimpleNamespace(lora=False)) is False


def _check(run: dict, *, devices: int) -> None:
    syncs = run["syncs"]
    assert len(syncs) == 3
    for s in syncs:
        assert s["equal"] and s["on_first_device"], s  # the trainer's weights, bit for bit
    # A cached program: the engine's build compiled it; no sync compiles (before: one each).
    assert sum(s["compiles"] for s in syncs) <= 1 and all(s["compiles"] == 0 for s in syncs[1:])
    # Only what changed: LoRA the adapters (the embedded engine keeps the base copied when it
    # was built; a vLLM engine, which drops its copies, never needs the base again), else every
    # parameter; the non-parameter state (RNG) once.
    changed = run["adapter_bytes"] if run["lora"] else run["param_bytes"]
    assert changed > 0
    assert [s["bytes"] for s in syncs] == [changed] * 3, (syncs, changed)
    assert run["build"]["bytes"] == run["model_bytes"]  # the whole model, once
    if run["lora"]:
        assert changed * 10 < run["model_bytes"]  # the test means something: adapters are small
    # One copy per process, split over its devices: no device holds the whole model.
    assert syncs[-1]["max_device_bytes"] <= run["model_bytes"] / devices + 4096, syncs[-1]


@pytest.mark.slow
@pytest.mark.parametrize("devices", [1, 2])
def test_two_processes_full_and_lora(devices):
    modes = ["full", "lora", "vllm_lora", "disagree"]
    results = weight_sync_worker.cluster(
        devices, f"--modes={','.join(modes)}", "--syncs=3", "--check=1"
    )
    for process, runs in enumerate(results):
        assert [r["mode"] for r in runs] == modes
        # Processes about to gather different arrays: a named error on each, not a hang.
        assert runs[-1]["error"].startswith("DistributedError: weight copy: process"), runs[-1]
        for run in runs[:-1]:
            assert run["process"] == process and run["local_devices"] == devices
            _check(run, devices=devices)
