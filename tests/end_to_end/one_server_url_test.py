"""One vLLM server URL for several processes (issue 36, item 3).

Training: each process reloads its weights on its server after every update and resets the
server's prefix cache, so two processes sharing one server would reset it in the middle of each
other's requests. `rollout_url(..., syncs_weights=True)` refuses that before anything reaches the
server. Evaluation never reloads weights, so there one URL still serves every process.

The slow tests run real 2-process clusters against one real HTTP server (the project's
OpenAI-compatible server over a tiny model, tests/support/recording_server.py).
"""

from __future__ import annotations

import json
import pathlib
import sys

import pytest

from mmr_jax import distributed
from mmr_jax.infra import metrics
from mmr_jax.rollout import padding
from mmr_jax.serving import server

from support import multihost, multihost_runs, recording_server

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "configs"))
import grpo  # noqa: E402


class TestRolloutUrlWithWeightSync:
    def test_one_url_for_several_processes_is_refused(self):
        with pytest.raises(distributed.RolloutUrlError, match="one server per process") as e:
            distributed.rollout_url("http://h:8000", 2, 1, syncs_weights=True)
        # The message names the fix: a list of servers, or '' (each launches its own).
        assert "--config.rollout.url=http://a:8000,http://b:8000" in str(e.value)
        assert "'' (each process launches its own server)" in str(e.value)

    def test_one_url_for_one_process_and_empty_url_pass(self):
        assert distributed.rollout_url("http://h:8000", 1, 0, syncs_weights=True) == (
            "http://h:8000"
        )
        assert distributed.rollout_url("", 3, 2, syncs_weights=True) == ""

    def test_one_url_per_process_passes(self):
        urls = "http://a:8000,http://b:8000"
        got = [distributed.rollout_url(urls, 2, i, syncs_weights=True) for i in (0, 1)]
        assert got == ["http://a:8000", "http://b:8000"]

    @pytest.mark.parametrize(
        "urls", ["http://a:8000,http://a:8000", "http://a:8000/, http://a:8000"]
    )
    def test_a_server_listed_twice_is_refused(self, urls):
        with pytest.raises(distributed.RolloutUrlError, match="more than once"):
            distributed.rollout_url(urls, 2, 0, syncs_weights=True)

    def test_wrong_count_names_only_the_per_process_form(self):
        with pytest.raises(distributed.RolloutUrlError, match="lists 3 URLs") as e:
            distributed.rollout_url("a,b,c", 2, 0, syncs_weights=True)
        assert "every process uses it" not in str(e.value)

    def test_without_weight_sync_one_url_serves_every_process(self):
        # Evaluation: no reloads, so sharing one server is safe.
        got = [distributed.rollout_url("http://h:8000", 2, i) for i in (0, 1)]
        assert got == ["http://h:8000"] * 2


@pytest.mark.slow
def test_training_on_one_shared_server_stops_before_any_request(tmp_path, tiny_llama_dir):
    """2 processes, `rollout.url` = one real server: both stop with `RolloutUrlError` before
    the first step; the server received no completion request and no weight reload."""
    with recording_server.serve(tiny_llama_dir) as (backend, url):
        cfg = multihost_runs.config(
            grpo,
            tiny_llama_dir,
            steps=2,
            **{
                "rollout.engine": "vllm",
                "rollout.url": url,
                "rollout.model_name": recording_server.MODEL_NAME,
                "checkpoint.every": 0,
            },
        )
        work = tmp_path / "w"
        results = multihost_runs.run(cfg, work, processes=2, devices=1, timeout=300)
        requests, reloads = list(backend.requests), list(backend.reloads)
    for rc, out in results:
        assert rc == 2, out[-3000:]
        assert "ERROR: RolloutUrlError: rollout.url gives one server" in out, out[-3000:]
    assert requests == [] and reloads == []
    assert not (work / metrics.METRICS_FILE).exists()


def _evaluate(ckpt, data_dir, out_dir, url, *, processes) -> list[str]:
    """Outputs of scripts/evaluate.py (engine 'vllm' at `url`) on `processes` processes."""
    procs = multihost.evaluate(
        ckpt, data_dir, out_dir, "--config.engine=vllm", f"--config.url={url}",
        processes=processes,
    )  # fmt: skip
    return multihost.finished(procs)


@pytest.mark.slow
def test_evaluation_shares_one_server_without_reloads(tmp_path, tiny_llama_dir):
    """scripts/evaluate.py on 2 processes against one shared server: no process reloads weights
    there (so nothing resets its cache), and eval.json equals that of 1 process on the server:
    each prompt carries its own seed, so sharing the server changes nothing."""
    data_dir = multihost.eval_benchmark_dir(tmp_path / "data")
    # Served under the checkpoint's path: the name evaluate.py asks for.
    backend = recording_server.RecordingBackend.from_pretrained(
        tiny_llama_dir, model_name=str(tiny_llama_dir), buckets=padding.MinSizes(min_prompts=1)
    )
    with server.OpenAIServer(backend) as srv:
        _evaluate(tiny_llama_dir, data_dir, tmp_path / "one", srv.url, processes=1)
        asked_by_one = sorted(backend.requests)
        backend.clear()
        _evaluate(tiny_llama_dir, data_dir, tmp_path / "two", srv.url, processes=2)
        asked_by_two, reloads = sorted(backend.requests), list(backend.reloads)
    assert reloads == []
    assert asked_by_two == asked_by_one and len(asked_by_one) == 5  # one seeded request a prompt
    one, two = (json.loads((tmp_path / d / "eval.json").read_text()) for d in ("one", "two"))
    for key in ("records", "per_benchmark", "average"):
        assert two[key] == one[key], key
