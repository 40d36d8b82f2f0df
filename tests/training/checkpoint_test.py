"""Checkpointer on a toy pytree; workdir guard."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mmr_jax.training import checkpoint, checkpoint_read, workdir_guard

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


def _started(workdir, config, *, checkpointed=True, **resolved):
    """What a run's start leaves: the guard's check, run.json (`claim`), and a checkpoint of
    step 1 (an empty step folder: the guard reads the step names only)."""
    workdir_guard.prepare_workdir(workdir, config)
    workdir_guard.claim(workdir, config, **resolved)
    if checkpointed:
        (workdir / checkpoint.CKPT_DIR / "1").mkdir(parents=True, exist_ok=True)


class TestWorkdir:
    def test_same_config_resumes(self, tmp_path):
        _started(tmp_path, {"a": 1, "total_steps": 5})
        _started(tmp_path, {"a": 1, "total_steps": 9})  # extending is fine
        assert workdir_guard.read_run_config(tmp_path) == {"a": 1, "total_steps": 9}

    def test_other_config_refused(self, tmp_path):
        _started(tmp_path, {"loss": {"beta": 0.04}})
        with pytest.raises(
            workdir_guard.RunMismatchError,
            match=r"steps \[1\].*loss.beta: 0.04 -> 0.0.*--overwrite",
        ):
            workdir_guard.prepare_workdir(tmp_path, {"loss": {"beta": 0.0}})

    def test_a_key_added_since_counts_as_its_default(self, tmp_path):
        # A run stored before loss.objective existed ran as its default 'ppo_clip'.
        _started(tmp_path, {"loss": {"beta": 0.0}})
        workdir_guard.prepare_workdir(tmp_path, {"loss": {"beta": 0.0, "objective": "ppo_clip"}})
        with pytest.raises(
            workdir_guard.RunMismatchError, match=r"loss.objective: 'ppo_clip' -> 'cispo'"
        ):
            workdir_guard.prepare_workdir(tmp_path, {"loss": {"beta": 0.0, "objective": "cispo"}})
        with pytest.raises(workdir_guard.RunMismatchError, match=r"made.up: '<absent>' -> 1"):
            workdir_guard.prepare_workdir(tmp_path, {"loss": {"beta": 0.0}, "made": {"up": 1}})

    def test_the_check_writes_nothing_but_the_folder(self, tmp_path):
        workdir_guard.prepare_workdir(tmp_path / "run", {"a": 1})
        assert list((tmp_path / "run").iterdir()) == []  # a start that fails claims nothing

    def test_a_run_without_checkpoint_does_not_bind_the_workdir(self, tmp_path):
        # Started (run.json written), then stopped before its first checkpoint.
        _started(tmp_path, {"a": 1}, checkpointed=False)
        (tmp_path / checkpoint.CKPT_DIR / f"1{checkpoint.UNREADABLE_SUFFIX}").mkdir(parents=True)
        (tmp_path / checkpoint.CKPT_DIR / "2.orbax-checkpoint-tmp-9").mkdir()
        assert checkpoint.saved_steps(tmp_path) == []
        workdir_guard.prepare_workdir(tmp_path, {"a": 2})
        workdir_guard.claim(tmp_path, {"a": 2})
        assert workdir_guard.read_run_config(tmp_path) == {"a": 2}

    def test_claim_keeps_what_was_resolved(self, tmp_path):
        _started(tmp_path, {"a": 1}, attention_impl={"implementation": "unfused"})
        workdir_guard.claim(tmp_path, {"a": 1, "total_steps": 3}, other=1)
        data = json.loads((tmp_path / workdir_guard.RUN_FILE).read_text())
        assert data == {
            "config": {"a": 1, "total_steps": 3},
            "resolved": {"attention_impl": {"implementation": "unfused"}, "other": 1},
        }

    def test_overwrite_deletes_run(self, tmp_path):
        _started(tmp_path, {"a": 1})
        (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1}) + "\n")
        workdir_guard.prepare_workdir(tmp_path, {"a": 2}, overwrite=True)
        assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "metrics.jsonl").exists()
        assert not (
            tmp_path / workdir_guard.RUN_FILE
        ).exists()  # the new run writes it once started


class TestDescribe:
    def test_tensorstore_error_is_its_reason_and_file(self):
        spec = '{"driver":"zarr","kvstore":{"path":"/r/checkpoints/2/state/"}}'
        err = ValueError(
            'OUT_OF_RANGE: Error opening "cast" driver: Error reading "step/.zarray" in OCDBT '
            'database at local file "/r/checkpoints/2/state/": Error reading Byte range [0, 1093) '
            'of local file "/r/checkpoints/2/state/d/472a": Requested byte range [0, 1093) is not '
            f"valid for value of size 546 [tensorstore_spec[1]='{spec}'] "
            f"[tensorstore_spec='{spec}']"
        )
        assert checkpoint_read.describe(err) == (
            "Requested byte range [0, 1093) is not valid for value of size 546 "
            "(file /r/checkpoints/2/state/d/472a)"
        )

    def test_other_errors_are_their_type_and_first_line(self):
        err = FileNotFoundError("no such file: meta/metadata\nmore")
        assert checkpoint_read.describe(err) == "FileNotFoundError: no such file: meta/metadata"
        assert checkpoint_read.describe(OSError("x" * 500), limit=10) == "OSError: " + "x" * 10
