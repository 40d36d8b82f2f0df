"""One-step off-policy rollouts in the trainer (`rollout.off_policy_lag`, docs/off_policy.md) on the
tiny random Llama: lag 0 is today's run, lag 1 samples step t+1 with the weights of step t-1 while
step t trains, a fault in either half stops both with a named error, and a resume trains every
step and consumes every prompt batch exactly once."""

import pathlib
import sys
import threading

import numpy as np
import pytest

from mmr_jax import checkpoint, config_types, faults, metrics, rewards, trainer
from mmr_jax.rollout import embedded, prefetch

from support import testing

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "configs"))
import grpo  # noqa: E402

B = 2  # the smoke configs' prompts per step


@rewards.register("test_target") if "test_target" not in rewards.REGISTRY else (lambda f: f)
def _target_reward(completions, answers, *, lengths=None):
    """The share of digits (as tests/trainer_test.py): varied values on a tiny random model."""
    del answers, lengths
    return np.array([sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions])


@pytest.fixture(autouse=True, scope="module")
def _xla_cache():
    with testing.persistent_xla_cache(min_compile_s=0.5):
        yield


def _config(ckpt, steps, lag=None, **overrides):
    c = testing.smoke_config(grpo, ckpt, steps=steps)
    if lag is None:
        del c.rollout.off_policy_lag  # the key absent: the dataclass default
    else:
        c.rollout.off_policy_lag = lag
    c = config_types.set_keys(c, {"checkpoint.keep": 10, **overrides})
    return config_types.from_config_dict(c)


def _rows(workdir):
    return metrics.read_jsonl(pathlib.Path(workdir) / metrics.METRICS_FILE)


def _metas(workdir):
    ck = checkpoint.Checkpointer(pathlib.Path(workdir) / checkpoint.CKPT_DIR, keep=None)
    try:
        return {s: ck.restore_meta(s) for s in ck.all_steps()}
    finally:
        ck.close()


def _consumed(data_state, num_items):
    """Prompts drawn since the start: whole epochs and the position in the current one."""
    return data_state["epoch"] * num_items + data_state["position"]


def _record_versions(monkeypatch):
    """The engine's weight version at each `generate` call, in call order."""
    seen, real = [], embedded.EmbeddedEngine.generate

    def generate(self, prompt_ids, params, **kw):
        seen.append(self.version)
        return real(self, prompt_ids, params, **kw)

    monkeypatch.setattr(embedded.EmbeddedEngine, "generate", generate)
    return seen


def _prefetch_threads():
    return [t for t in threading.enumerate() if t.name.startswith("rollout-prefetch")]


def test_config_validation():
    with pytest.raises(config_types.ConfigError, match="off_policy_lag=2"):
        config_types.from_config_dict(
            config_types.set_keys(grpo.get_config("smoke"), {"rollout.off_policy_lag": 2})
        )


def test_lag_zero_is_todays_run(tmp_path, tiny_llama_dir):
    runs = {}
    for name, lag in (("absent", None), ("zero", 0)):
        cfg = _config(tiny_llama_dir, 2, lag, **{"checkpoint.every": 0})
        assert cfg.rollout.off_policy_lag == 0
        trainer.train(cfg, tmp_path / name)
        runs[name] = _rows(tmp_path / name)
    timed = lambda k: k.startswith("time/") or k == "throughput/tokens_per_s"
    strip = lambda rows: [{k: v for k, v in r.items() if not timed(k)} for r in rows]
    assert [r["step"] for r in runs["zero"]] == [1, 2]
    assert strip(runs["absent"]) == strip(runs["zero"])  # every value exactly, bar the clocks
    assert "rollout/policy_lag" not in runs["zero"][0]  # the synchronous loop, unchanged


def test_lag_one_samples_with_the_weights_of_step_t_minus_1(tmp_path, tiny_llama_dir, monkeypatch):
    versions = _record_versions(monkeypatch)
    cfg = _config(tiny_llama_dir, 3, 1, **{"checkpoint.every": 0, "loss.tis_cap": 2.0})
    trainer.train(cfg, tmp_path / "run")
    rows = _rows(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2, 3]
    # Step 1: sampled before any update (nothing prefetched). Step 2 was sampled while step 1
    # trained, with the initial weights; step 3 while step 2 trained, with step 1's.
    assert versions == [0, 0, 1]  # a synchronous run: [0, 1, 2]
    assert [r["rollout/policy_lag"] for r in rows] == [0.0, 1.0, 1.0]
    # The sampler's log-probs are the old policy's: step 1 matches the trainer to fp32 rounding,
    # the lagged steps differ by an update (lr 1e-3), and the TIS metrics see the gap.
    gap = [r["mismatch/logp_abs_mean"] for r in rows]
    assert gap[0] < 1e-4 and min(gap[1:]) > 10 * max(gap[0], 1e-6), gap
    assert all("tis/clipped_frac" in r for r in rows)
    assert all(r["time/rollout_wait"] >= 0 for r in rows)
    assert not _prefetch_threads()


def test_background_rollout_error_stops_the_run(tmp_path, tiny_llama_dir, monkeypatch):
    # Step 3's rollout runs in the background while step 2 trains; it raises there.
    monkeypatch.setattr(faults, "_RAISE", ("rollout", 3))
    cfg = _config(tiny_llama_dir, 4, 1)
    with pytest.raises(prefetch.PrefetchError, match="rollout of step 3") as e:
        trainer.train(cfg, tmp_path / "run")
    assert isinstance(e.value.__cause__, faults.InjectedFault)
    assert not _prefetch_threads()
    # Step 2's update finished but the error came before its checkpoint: a resume redoes it.
    assert max(_metas(tmp_path / "run")) == 1


def test_train_error_then_resume_trains_each_step_once(tmp_path, tiny_llama_dir, monkeypatch):
    work = tmp_path / "run"
    monkeypatch.setattr(faults, "_RAISE", ("train", 3))  # step 4's rollout is in flight then
    with pytest.raises(faults.InjectedFault):
        trainer.train(_config(tiny_llama_dir, 5, 1), work)
    assert not _prefetch_threads()  # the background half stopped with the main one
    first = _metas(work)
    assert sorted(first) == [1, 2]
    # Step 3's prompts were drawn (by the rollout prefetched while step 2 trained) before the
    # checkpoint of step 2; it records the position before them.
    n = first[2]["data"]["num_items"]
    assert {s: _consumed(m["data"], n) for s, m in first.items()} == {1: B, 2: 2 * B}

    monkeypatch.setattr(faults, "_RAISE", None)
    versions = _record_versions(monkeypatch)
    trainer.train(_config(tiny_llama_dir, 5, 1), work)
    rows = _rows(work)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]  # each step once: none twice, none lost
    # The first step after the restore samples again, with the restored weights (lag 0).
    assert [r["rollout/policy_lag"] for r in rows] == [0.0, 1.0, 0.0, 1.0, 1.0]
    assert versions == [2, 2, 3]  # steps 3, 4, 5; nothing sampled beyond the last step
    metas = _metas(work)
    assert sorted(metas) == [1, 2, 3, 4, 5]
    assert {s: _consumed(m["data"], n) for s, m in metas.items()} == {s: s * B for s in range(1, 6)}
    assert all(np.isfinite(r["loss"]) for r in rows)


def test_benchmark_pins_each_mode_and_sets_its_lag():
    from mmr_jax import bench_harness

    bench = bench_harness.load("off_policy")
    cmd = bench.command("configs/cpu_smollm2.py", 3, "/tmp/w", ["a.b=1"], 1, "0,1")
    assert cmd[:3] == ["taskset", "-c", "0,1"] and cmd[4].endswith("scripts/train.py")
    assert "--config.rollout.off_policy_lag=1" in cmd and "--config.a.b=1" in cmd
    assert "--config.total_steps=3" in cmd
    assert bench.command("c.py", 3, "/tmp/w", [], 0, "")[0] == sys.executable
