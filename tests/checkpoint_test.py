"""Checkpointer on a toy pytree; workdir guard."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from mmr_jax import checkpoint


def _state(scale=1.0):
    params = {"w": scale * jnp.ones((3, 4)), "b": {"x": jnp.arange(2.0)}}
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
    rng = jax.random.key_data(jax.random.key(7))
    return {"params": params, "opt_state": opt.init(params), "rng": rng, "step": jnp.int32(0)}


def _abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


class TestCheckpointer:
    def test_round_trip(self, tmp_path):
        ck = checkpoint.Checkpointer(tmp_path / "ck", keep=3)
        state = _state(2.0)
        ck.save(5, state, {"step": 5, "data": {"epoch": 1, "position": 3}})
        ck.wait()
        out, meta = ck.restore(_abstract(_state()))
        assert meta == {"step": 5, "data": {"epoch": 1, "position": 3}}
        jax.tree.map(np.testing.assert_array_equal, out, state)
        assert jax.tree.structure(out) == jax.tree.structure(state)
        ck.close()

    def test_keeps_last_k(self, tmp_path):
        ck = checkpoint.Checkpointer(tmp_path / "ck", keep=2)
        for step in range(1, 6):
            ck.save(step, _state(step), {"step": step})
        ck.wait()
        assert ck.all_steps() == [4, 5] and ck.latest_step() == 5
        out, _ = ck.restore(_abstract(_state()), step=4)
        np.testing.assert_array_equal(out["params"]["w"], 4 * np.ones((3, 4)))
        ck.close()

    def test_empty(self, tmp_path):
        ck = checkpoint.Checkpointer(tmp_path / "ck")
        assert ck.restore(_abstract(_state())) is None and ck.latest_step() is None
        ck.close()

    def test_unfinished_save_is_ignored(self, tmp_path):
        ck = checkpoint.Checkpointer(tmp_path / "ck", keep=3)
        ck.save(1, _state(), {"step": 1})
        ck.close()
        # What a killed writer leaves: an orbax temporary folder for the next step.
        (tmp_path / "ck" / "2.orbax-checkpoint-tmp-123").mkdir()
        ck = checkpoint.Checkpointer(tmp_path / "ck", keep=3)
        assert ck.latest_step() == 1
        ck.close()


class TestWorkdir:
    def test_same_config_resumes(self, tmp_path):
        checkpoint.prepare_workdir(tmp_path, {"a": 1, "total_steps": 5})
        checkpoint.prepare_workdir(tmp_path, {"a": 1, "total_steps": 9})  # extending is fine
        assert checkpoint.read_run_config(tmp_path) == {"a": 1, "total_steps": 9}

    def test_other_config_refused(self, tmp_path):
        checkpoint.prepare_workdir(tmp_path, {"loss": {"beta": 0.04}})
        with pytest.raises(
            checkpoint.RunMismatchError, match=r"loss.beta: 0.04 -> 0.0.*--overwrite"
        ):
            checkpoint.prepare_workdir(tmp_path, {"loss": {"beta": 0.0}})

    def test_overwrite_deletes_run(self, tmp_path):
        checkpoint.prepare_workdir(tmp_path, {"a": 1})
        (tmp_path / "checkpoints").mkdir()
        (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1}) + "\n")
        checkpoint.prepare_workdir(tmp_path, {"a": 2}, overwrite=True)
        assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "metrics.jsonl").exists()
        assert checkpoint.read_run_config(tmp_path) == {"a": 2}
