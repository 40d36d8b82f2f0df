"""Checkpointer on a toy pytree; workdir guard."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mmr_jax.training import checkpoint, run_guard

from support import checkpoint_trees as trees


class TestCheckpointer:
    def test_round_trip(self, tmp_path):
        ck = checkpoint.Checkpointer(tmp_path / "ck", keep=3)
        state = trees.state(2.0)
        ck.save(5, state, {"step": 5, "data": {"epoch": 1, "position": 3}})
        ck.wait()
        out, meta = ck.restore(trees.abstract(trees.state()))
        assert meta == {"step": 5, "data": {"epoch": 1, "position": 3}}
        jax.tree.map(np.testing.assert_array_equal, out, state)
        assert jax.tree.structure(out) == jax.tree.structure(state)
        ck.close()

    def test_keeps_last_k(self, tmp_path):
        ck = checkpoint.Checkpointer(tmp_path / "ck", keep=2)
        for step in range(1, 6):
            ck.save(step, trees.state(step), {"step": step})
        ck.wait()
        assert ck.all_steps() == [4, 5] and ck.latest_step() == 5
        out, _ = ck.restore(trees.abstract(trees.state()), step=4)
        np.testing.assert_array_equal(out["params"]["w"], 4 * np.ones((3, 4)))
        ck.close()

    def test_empty(self, tmp_path):
        ck = checkpoint.Checkpointer(tmp_path / "ck")
        assert ck.restore(trees.abstract(trees.state())) is None and ck.latest_step() is None
        ck.close()

    def test_unfinished_save_is_ignored(self, tmp_path):
        ck = checkpoint.Checkpointer(tmp_path / "ck", keep=3)
        ck.save(1, trees.state(), {"step": 1})
        ck.close()
        # What a killed writer leaves: an orbax temporary folder for the next step.
        (tmp_path / "ck" / "2.orbax-checkpoint-tmp-123").mkdir()
        ck = checkpoint.Checkpointer(tmp_path / "ck", keep=3)
        assert ck.latest_step() == 1
        ck.close()


class TestUnreadableCheckpoint:
    @pytest.mark.parametrize("corruption", sorted(trees.CORRUPTIONS))
    def test_previous_one_restored(self, tmp_path, corruption):
        ck = checkpoint.Checkpointer(tmp_path / "ck", keep=None)
        for step in (1, 2, 3):
            ck.save(step, trees.state(step), {"step": step})
        ck.close()
        trees.CORRUPTIONS[corruption](tmp_path / "ck" / "3")
        ck = checkpoint.Checkpointer(tmp_path / "ck", keep=None)
        out, meta = ck.restore(trees.abstract(trees.state()))
        assert meta == {"step": 2}
        np.testing.assert_array_equal(out["params"]["w"], 2 * np.ones((3, 4)))
        # Kept for a person to look at, out of the way of the run's next save of step 3.
        assert (tmp_path / "ck" / f"3{checkpoint.UNREADABLE_SUFFIX}").is_dir()
        assert ck.all_steps() == [1, 2]
        ck.save(3, trees.state(30), {"step": 3})
        ck.wait()
        out, meta = ck.restore(trees.abstract(trees.state()))
        assert meta == {"step": 3} and float(out["params"]["w"][0, 0]) == 30.0
        ck.close()

    def test_none_readable_is_an_error(self, tmp_path):
        ck = checkpoint.Checkpointer(tmp_path / "ck", keep=None)
        ck.save(1, trees.state(), {"step": 1})
        ck.close()
        ck = checkpoint.Checkpointer(tmp_path / "ck", keep=None)
        wrong = trees.abstract(
            {**trees.state(), "params": {"w": jnp.ones((5, 5))}}
        )  # another model
        with pytest.raises(checkpoint.CheckpointRestoreError, match=r"tried steps \[1\]"):
            ck.restore(wrong)
        assert ck.all_steps() == [1]  # not moved aside: the checkpoint is fine, the caller is not
        ck.close()


class TestWorkdir:
    def test_same_config_resumes(self, tmp_path):
        run_guard.prepare_workdir(tmp_path, {"a": 1, "total_steps": 5})
        run_guard.prepare_workdir(tmp_path, {"a": 1, "total_steps": 9})  # extending is fine
        assert run_guard.read_run_config(tmp_path) == {"a": 1, "total_steps": 9}

    def test_other_config_refused(self, tmp_path):
        run_guard.prepare_workdir(tmp_path, {"loss": {"beta": 0.04}})
        with pytest.raises(
            run_guard.RunMismatchError, match=r"loss.beta: 0.04 -> 0.0.*--overwrite"
        ):
            run_guard.prepare_workdir(tmp_path, {"loss": {"beta": 0.0}})

    def test_a_key_added_since_counts_as_its_default(self, tmp_path):
        # A run stored before loss.objective existed ran as its default 'ppo_clip'.
        run_guard.prepare_workdir(tmp_path, {"loss": {"beta": 0.0}})
        run_guard.prepare_workdir(tmp_path, {"loss": {"beta": 0.0, "objective": "ppo_clip"}})
        with pytest.raises(
            run_guard.RunMismatchError, match=r"loss.objective: 'ppo_clip' -> 'cispo'"
        ):
            run_guard.prepare_workdir(tmp_path, {"loss": {"beta": 0.0, "objective": "cispo"}})
        with pytest.raises(run_guard.RunMismatchError, match=r"made.up: '<absent>' -> 1"):
            run_guard.prepare_workdir(tmp_path, {"loss": {"beta": 0.0}, "made": {"up": 1}})

    def test_overwrite_deletes_run(self, tmp_path):
        run_guard.prepare_workdir(tmp_path, {"a": 1})
        (tmp_path / "checkpoints").mkdir()
        (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1}) + "\n")
        run_guard.prepare_workdir(tmp_path, {"a": 2}, overwrite=True)
        assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "metrics.jsonl").exists()
        assert run_guard.read_run_config(tmp_path) == {"a": 2}
