"""Crash anywhere, resume to the same run: scripts/train.py SIGKILLed again and again on a tiny
model, each time resumed with the same command, ends where an uninterrupted run ends."""

import os
import pathlib
import shlex
import subprocess
import sys

import jax
import numpy as np
import pytest

from mmr_jax.config import checks
from mmr_jax.infra import faults, metrics
from mmr_jax.step import train_step
from mmr_jax.training import build, checkpoint, trainer, workdir_guard

from support import crash_harness, testing


# Compiled programs are shared by the runs of this module and the subprocesses it starts.
@pytest.fixture(autouse=True, scope="module")
def _xla_cache():
    """XLA's persistent cache for this module's tests and the processes they start."""
    with testing.persistent_xla_cache(min_compile_s=0):
        yield


def _restore(workdir):
    cfg = checks.from_config_dict(workdir_guard.read_run_config(workdir))
    policy = build.load_policy(cfg)
    optimizer, _ = train_step.make_optimizer(cfg.optim, total_updates=cfg.total_updates)
    state = train_step.init_state(policy.params, optimizer, seed=cfg.seed, loss=cfg.loss)
    ck = checkpoint.Checkpointer(pathlib.Path(workdir) / checkpoint.CKPT_DIR, keep=None)
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), checkpoint.state_tree(state)
    )
    out = ck.restore(abstract)
    ck.close()
    return out


def _chain(tmp_path, ckpt, algorithm, overrides, kills):
    """Runs the chain, then the same config uninterrupted in this process; returns outcomes."""
    run = tmp_path / "run"
    cmd = crash_harness.train_command(run, algorithm, {"model.path": ckpt, **overrides})
    outcomes = crash_harness.run_chain(cmd, kills, crash_harness.subprocess_env())
    crash_harness.register_digit_reward()
    cfg = checks.from_config_dict(workdir_guard.read_run_config(run))
    trainer.train(cfg, tmp_path / "ref")
    diffs = crash_harness.differences(tmp_path / "ref", run, _restore)
    assert diffs == [], "\n".join(diffs)
    leftovers = [p.name for p in run.rglob("*") if "tmp" in p.name or p.name.endswith(".partial")]
    assert leftovers == [], leftovers  # no half-written folder outlives the resume that follows
    return outcomes


def _resumed_from(outcome):
    return crash_harness._resumed(next(x for x in outcome.output.splitlines() if "| workdir" in x))


@pytest.mark.slow
class TestCrashAnywhere:
    def test_kill_in_each_phase(self, tmp_path, tiny_llama_dir):
        # rollout: killed before the update of step 2; train: the update of step 3 in flight;
        # checkpoint: the write of step 3 in flight; export: step 4's HF folder half written.
        hooks = ["rollout:2", "train:3", "checkpoint:3", "export:4"]
        outcomes = _chain(
            tmp_path,
            tiny_llama_dir,
            "grpo",
            {"total_steps": 5, "reweight.method": "mmr", "checkpoint.export_hf": True},
            [crash_harness.Kill(hook=h) for h in hooks],
        )
        assert [o.killed for o in outcomes] == [True] * 4 + [False]
        resumed = [_resumed_from(o) for o in outcomes]
        # Each resume starts from the last complete checkpoint: 1 after the rollout kill, 2 after
        # the train kill, 2 or 3 after the checkpoint kill (the write may beat the signal), and 4
        # after the export kill (the checkpoint is complete before the export starts).
        assert resumed[:3] == [0, 1, 2] and resumed[3] in (2, 3) and resumed[4] == 4, resumed
        assert "exporting step 4, not finished before the restart" in outcomes[4].output

    @pytest.mark.parametrize(
        "algorithm,overrides,seed",
        [
            (  # DAPO's extra generation rounds, LoRA, MMR; a checkpoint every 2 steps
                "dapo",
                {"lora.enabled": True, "reweight.method": "mmr", "checkpoint.every": 2},
                0,
            ),
            ("dr_grpo", {"checkpoint.export_hf": True}, 1),  # full fine-tune, HF export per step
        ],
    )
    def test_random_kills(self, tmp_path, tiny_llama_dir, algorithm, overrides, seed):
        # 3 kills a chain (5 before): each kill costs one more start of train.py (imports,
        # tracing: most of a run; its steps take 0.1 s). (after_step, fraction) of seed 0: (3,
        # .27), (2, .04), (0, .81); of seed 1: (1, .95), (2, .14), (3, .31): kills within a step
        # and kills after a resume's header (a resume past after_step), in both chains. Each
        # phase is killed in turn by test_kill_in_each_phase.
        total = 7
        kills = crash_harness.random_kills(np.random.default_rng(seed), 3, total)
        outcomes = _chain(
            tmp_path, tiny_llama_dir, algorithm, {"total_steps": total, **overrides}, kills
        )
        assert [o.killed for o in outcomes] == [True] * 3 + [False], [
            (o.kill, o.returncode, o.last_step_line) for o in outcomes
        ]


# A stand-in for scripts/train.py's console: the header, then step 1, a slow step 2 (as one that
# compiles), then fast steps, each line as train.py prints it.
_STEPS = """
import sys, time
print("mmr_jax | workdir /x | new run", flush=True)
for step, pause in enumerate([0.0, 3.0, 0.3, 0.3, 0.3, 0.3], start=1):
    time.sleep(pause)
    print(f"  step {step}/6 | loss 0.1", flush=True)
"""


class TestKillTiming:
    def test_a_slow_timed_step_does_not_carry_the_kill_past_the_run(self):
        """The delay is a fraction of the step timed, 0.5 x 3 s after step 2 here, longer than
        the four 0.3 s steps left: the kill is aimed again from each later step, so the run is
        killed within a step, not after it ended."""
        kill = crash_harness.Kill(after_step=1, fraction=0.5)
        out = crash_harness.run_once([sys.executable, "-c", _STEPS], dict(os.environ), kill)
        assert out.killed, out.output
        assert 3 <= out.last_step_line < 6, out.output


class TestFaultHook:
    def test_parse(self):
        assert faults.parse("") is None and faults.parse("train:3") == ("train", 3)
        with pytest.raises(ValueError, match="MMR_JAX_KILL_AT"):
            faults.parse("training:3")


def _unshare_works() -> bool:
    try:
        return subprocess.run(["unshare", "-rm", "true"], capture_output=True).returncode == 0
    except FileNotFoundError:
        return False


@pytest.mark.slow
class TestWriteErrors:
    def test_full_disk_then_read_only(self, tmp_path, tiny_llama_dir):
        """A real full disk (a 4 MB tmpfs) and a real read-only remount of it, in a user and mount
        namespace (`unshare -rm`, no privileges needed); the workdir is copied out after each."""
        if not _unshare_works():
            pytest.skip("needs unprivileged user namespaces (unshare -rm) for a tmpfs")
        disk = tmp_path / "disk"
        disk.mkdir()
        run = disk / "run"
        cmd = crash_harness.train_command(
            run, "dr_grpo", {"model.path": tiny_llama_dir, "total_steps": 6, "checkpoint.keep": 6}
        )
        quoted = " ".join(shlex.quote(str(c)) for c in cmd)
        script = f"""
            mount -t tmpfs -o size=4m tmpfs {disk} || exit 90
            {quoted} > {tmp_path}/full.out 2>&1; echo $? > {tmp_path}/full.rc
            cp -a {run} {tmp_path}/after_full
            mount -o remount,ro {disk} || exit 91
            {quoted} > {tmp_path}/ro.out 2>&1; echo $? > {tmp_path}/ro.rc
            cp -a {run} {tmp_path}/after_ro
        """
        res = subprocess.run(
            ["unshare", "-rm", "sh", "-c", script],
            env=crash_harness.subprocess_env(),
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert res.returncode == 0, res.stderr
        full_out = (tmp_path / "full.out").read_text()
        assert (tmp_path / "full.rc").read_text().strip() == "1", full_out[-3000:]
        error = [line for line in full_out.splitlines() if line.startswith("ERROR: cannot write")]
        assert len(error) == 1 and str(run) in error[0], full_out[-3000:]
        assert "No space left on device" in error[0] and "re-run the same command" in error[0]
        # What was saved before the disk filled up is all there and restores.
        saved = tmp_path / "after_full"
        (tree, meta) = _restore(saved)
        assert (
            1 <= meta["step"] < 6
            and f"checkpoints {list(range(1, meta['step'] + 1))}" in (error[0])
        )
        steps = [r["step"] for r in metrics.read_jsonl(saved / metrics.METRICS_FILE)]
        assert steps[: meta["step"]] == list(range(1, meta["step"] + 1)), steps

        ro_out = (tmp_path / "ro.out").read_text()
        assert (tmp_path / "ro.rc").read_text().strip() == "1", ro_out[-3000:]
        error = [line for line in ro_out.splitlines() if line.startswith("ERROR: cannot write")]
        assert len(error) == 1 and str(run) in error[0] and "Read-only file system" in error[0]
        after = tmp_path / "after_ro"
        assert _restore(after)[1] == meta  # untouched by the refused run
        assert (after / metrics.METRICS_FILE).read_bytes() == (
            saved / metrics.METRICS_FILE
        ).read_bytes()
