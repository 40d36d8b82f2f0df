"""One-step off-policy rollouts in the trainer (`rollout.off_policy_lag`, docs/off_policy.md) on the
tiny random Llama: lag 0 is today's run, lag 1 samples step t+1 with the weights of step t-1 while
step t trains, a fault in either half stops both with a named error, and a resume trains every
step and consumes every prompt batch exactly once."""

import pathlib
import sys
import threading

import numpy as np
import pytest

from mmr_jax import rewards
from mmr_jax.config import checks, command_line, schema
from mmr_jax.infra import faults, metrics
from mmr_jax.rollout import embedded, prefetch
from mmr_jax.step import pipeline
from mmr_jax.training import checkpoint, trainer

from support import fake_server_venv, testing

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "configs"))
import grpo  # noqa: E402

B = 2  # the smoke configs' prompts per step


@rewards.register("test_target") if "test_target" not in rewards.REGISTRY else (lambda f: f)
def _target_reward(completions, answers, *, lengths=None):
    """The share of digits (as tests/training/trainer_test.py): varied values on a tiny random
    model."""
    del answers, lengths
    return np.array([sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions])


@pytest.fixture(autouse=True, scope="module")
def _xla_cache():
    with testing.persistent_xla_cache(min_compile_s=0.5):
        yield


def _config(ckpt, steps, lag=None, **overrides):
    c = testing.smoke_config(grpo, ckpt, steps=steps)
    c = command_line.set_keys(c, {"checkpoint.keep": 10, **overrides})
    if lag is None:  # the key absent, as a run stored before it existed: configs/base.py's default
        stored = checks.plain(c)
        del stored["rollout"]["off_policy_lag"]
        return checks.from_config_dict(command_line.stored_config(stored))
    c.rollout.off_policy_lag = lag
    return checks.from_config_dict(c)


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
    with pytest.raises(schema.ConfigError, match="off_policy_lag=2"):
        checks.from_config_dict(
            command_line.set_keys(grpo.get_config("smoke"), {"rollout.off_policy_lag": 2})
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
    from mmr_jax.infra import bench_harness

    bench = bench_harness.load("off_policy")
    cmd = bench.command("configs/cpu_smollm2.py", 3, "/tmp/w", ["a.b=1"], 1, "0,1")
    assert cmd[:3] == ["taskset", "-c", "0,1"] and cmd[4].endswith("scripts/train.py")
    assert "--config.rollout.off_policy_lag=1" in cmd and "--config.a.b=1" in cmd
    assert "--config.total_steps=3" in cmd
    assert bench.command("c.py", 3, "/tmp/w", [], 0, "")[0] == sys.executable


# ---- the vLLM engine: a server process the trainer launches --------------------------------------
# The server is scripts/serve.py behind a stand-in server venv (support/fake_server_venv.py): a
# real HTTP server in its own process, launched and stopped as the trainer launches vLLM.


def _vllm_config(ckpt, steps, venv, **overrides):
    """A lag-1 run whose trainer launches its own server (rollout.url empty) from `venv`; one
    retry of a refused request, so a dead server ends the rollout within about a second."""
    return _config(
        ckpt,
        steps,
        1,
        **{
            "rollout.engine": "vllm",
            "rollout.url": "",
            "rollout.server_venv": str(venv),
            "rollout.ready_timeout_s": 120.0,
            "rollout.max_retries": 1,
            "loss.tis_cap": 2.0,
            **overrides,
        },
    )


def _record_servers(monkeypatch):
    """The `vllm_launch.ServerProcess` of every engine `engines.make_engine` makes, with its pid."""
    from mmr_jax.training import engines

    servers, real = [], engines.make_engine

    def make_engine(*args, **kwargs):
        engine = real(*args, **kwargs)
        servers.append((engine.server, engine.server.proc.pid, engine.server.url))
        return engine

    monkeypatch.setattr(engines, "make_engine", make_engine)
    return servers


def _record_vllm_calls(monkeypatch):
    """[(kind, version, start, end)] of every `VllmEngine.generate` and `sync_weights` call:
    the engine's weight version at a generate, the version a sync installs."""
    import time

    from mmr_jax.rollout import vllm_engine

    calls = []
    real_generate, real_sync = vllm_engine.VllmEngine.generate, vllm_engine.VllmEngine.sync_weights

    def generate(self, *args, **kwargs):
        version, t0 = self.version, time.monotonic()
        try:
            return real_generate(self, *args, **kwargs)
        finally:
            calls.append(("generate", version, t0, time.monotonic()))

    def sync_weights(self, model, *, version):
        t0 = time.monotonic()
        try:
            return real_sync(self, model, version=version)
        finally:
            calls.append(("sync", version, t0, time.monotonic()))

    monkeypatch.setattr(vllm_engine.VllmEngine, "generate", generate)
    monkeypatch.setattr(vllm_engine.VllmEngine, "sync_weights", sync_weights)
    return calls


def _assert_sync_never_overlaps_sampling(calls):
    spans = sorted((t0, t1, kind) for kind, _, t0, t1 in calls)
    for (_, end, kind), (start, _, nxt) in zip(spans, spans[1:], strict=False):
        assert end <= start or kind == nxt == "generate", (kind, nxt, end, start)


def _gone(pid: int) -> bool:
    import os

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _stopped(server, pid, url) -> bool:
    from mmr_jax.rollout import vllm_client

    return not server.alive() and _gone(pid) and not vllm_client.VllmClient(url).health()


@pytest.mark.slow
def test_vllm_server_killed_mid_run_stops_the_trainer_then_resume_trains_each_step_once(
    tmp_path, tiny_llama_dir, monkeypatch
):
    import os
    import signal
    import time

    from mmr_jax.rollout import vllm_client

    venv, work = fake_server_venv.make(tmp_path), tmp_path / "run"
    servers = _record_servers(monkeypatch)
    real_collect, killed = pipeline.collect, []

    def collect(cfg, prompts, engine, tokenizer, encoder, step, timings):
        # Step 3's rollout, in the background while step 2 trains: the server dies first.
        if step == 3 and threading.current_thread().name.startswith("rollout-prefetch"):
            os.killpg(engine.server.proc.pid, signal.SIGKILL)
            killed.append(time.monotonic())
        return real_collect(cfg, prompts, engine, tokenizer, encoder, step, timings)

    monkeypatch.setattr(pipeline, "collect", collect)
    with pytest.raises(prefetch.PrefetchError, match="rollout of step 3") as e:
        trainer.train(_vllm_config(tiny_llama_dir, 5, venv), work)
    assert killed and time.monotonic() - killed[0] < 60  # a named error, no hang
    assert isinstance(e.value.__cause__, vllm_client.ServerUnavailableError)
    assert servers[0][2] in str(e.value.__cause__)  # it names the server
    assert _stopped(*servers[0])  # the launched server is cleaned up (its whole group)
    assert not _prefetch_threads()
    assert sorted(_metas(work)) == [1]  # step 2 trained, but not checkpointed
    assert [r["step"] for r in _rows(work)] == [1]

    monkeypatch.setattr(pipeline, "collect", real_collect)
    calls = _record_vllm_calls(monkeypatch)
    trainer.train(_vllm_config(tiny_llama_dir, 5, venv), work)
    # The restored weights (version 1) synced at the start; steps 2-5 sampled with versions
    # [1, 1, 2, 3] (step 2 in the foreground, then one behind); no sync while a rollout ran.
    assert [v for k, v, *_ in calls if k == "generate"] == [1, 1, 2, 3]
    assert [v for k, v, *_ in calls if k == "sync"] == [1, 2, 3, 4, 5]
    _assert_sync_never_overlaps_sampling(calls)
    assert len(servers) == 2 and _stopped(*servers[1])  # a new server, stopped at the end
    rows = _rows(work)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]  # each step once: none twice, none lost
    assert [r["rollout/policy_lag"] for r in rows] == [0.0, 0.0, 1.0, 1.0, 1.0]
    metas = _metas(work)
    n = metas[1]["data"]["num_items"]
    assert {s: _consumed(m["data"], n) for s, m in metas.items()} == {s: s * B for s in range(1, 6)}
    # The server sampled with the lagged weights: the lagged steps see an update's mismatch.
    gap = [r["mismatch/logp_abs_mean"] for r in rows]
    assert max(gap[:2]) < 1e-4 and min(gap[2:]) > 10 * max(*gap[:2], 1e-6), gap
    assert not _prefetch_threads()


@pytest.mark.slow
def test_vllm_trainer_error_stops_the_launched_server_and_the_prefetch(
    tmp_path, tiny_llama_dir, monkeypatch
):
    # With LoRA: the weights reach the server as adapters (a new name per version).
    servers, calls = _record_servers(monkeypatch), _record_vllm_calls(monkeypatch)
    real_collect, in_flight = pipeline.collect, []

    def collect(cfg, prompts, engine, tokenizer, encoder, step, timings):
        in_flight.append(step)  # the rollouts begun (foreground and background)
        return real_collect(cfg, prompts, engine, tokenizer, encoder, step, timings)

    monkeypatch.setattr(pipeline, "collect", collect)
    monkeypatch.setattr(faults, "_RAISE", ("train", 3))  # MMR_JAX_RAISE_AT=train:3
    venv = fake_server_venv.make(tmp_path)
    with pytest.raises(faults.InjectedFault, match="train:3"):
        cfg = _vllm_config(tiny_llama_dir, 5, venv, **{"lora.enabled": True, "lora.rank": 4})
        trainer.train(cfg, tmp_path / "run")
    assert in_flight == [1, 2, 3, 4]  # step 4's rollout had begun when step 3's update raised
    # Steps 1-3 sampled with versions [0, 0, 1]; the syncs of versions 0-2 came between them.
    assert [v for k, v, *_ in calls if k == "generate"][:3] == [0, 0, 1]
    assert [v for k, v, *_ in calls if k == "sync"] == [0, 1, 2]
    _assert_sync_never_overlaps_sampling(calls)
    assert _stopped(*servers[0])
    assert not _prefetch_threads()
    assert sorted(_metas(tmp_path / "run")) == [1, 2]


@pytest.mark.slow
def test_benchmark_vllm_mode_runs_both_modes_beside_one_pinned_server(tmp_path, tiny_llama_dir):
    """`benchmarks/off_policy.py --engine=vllm` in one call: it launches the server (here
    scripts/serve.py through the stand-in venv) pinned apart, runs the trainer synchronous and
    one-step off-policy against it, reports both, and stops the server."""
    import json
    import os

    from mmr_jax.infra import bench_harness
    from mmr_jax.rollout import vllm_client

    bench = bench_harness.load("off_policy")
    cpus = sorted(os.sched_getaffinity(0))
    server_cpus, trainer_cpus = (str(cpus[0]), str(cpus[-1])) if len(cpus) > 1 else ("", "")
    out = tmp_path / "offp.json"
    sets = [
        f"model.path={tiny_llama_dir}",
        f"rollout.server_venv={fake_server_venv.make(tmp_path)}",
        "batch.max_prompt_len=32",
        "batch.max_completion_len=16",
        "data.system_prompt=",
    ]
    bench.main(
        ["--engine=vllm", "--config=configs/grpo.py:smoke", "--steps=2", f"--json={out}"]
        + [f"--server_cpus={server_cpus}", f"--cpus={trainer_cpus}", "--timeout_s=600"]
        + [f"--set={s}" for s in sets]
    )
    result = json.loads(out.read_text())
    rows = {r["mode"]: r for r in result["rows"]}
    assert list(rows) == ["sync", "off_policy"] and len(result["server_ready_s"]) == 1
    for r in rows.values():
        assert r["exit"] == 0 and r["steps"] == 2 and "error" not in r
        assert r["server_alive"] and r["server_rss_gib"] > 0 and r["time/step"] > 0
    assert rows["sync"]["policy_lag"] == [0.0, 0.0]  # the synchronous loop writes no lag
    assert rows["off_policy"]["policy_lag"] == [0.0, 1.0]
    assert "time/rollout_wait" in rows["off_policy"]
    speedup = rows["sync"]["time/step"] / rows["off_policy"]["time/step"]
    assert rows["off_policy"]["speedup"] == speedup
    (url,) = result["server_urls"]
    assert not vllm_client.VllmClient(url, max_retries=0).health()  # stopped at the end
