"""vLLM client and engine over real HTTP, against the in-process server with a fake backend and
against stub servers (500s, malformed replies, nothing listening). These prove the protocol and the
error handling, not vLLM itself; tests/serving/serve_test.py runs a real model, and the `gpu` test
at the end runs a real `vllm serve`."""

import contextlib
import dataclasses
import http.server
import json
import os
import pathlib
import socket
import sys
import threading
import time

import numpy as np
import pytest

from mmr_jax.rollout import base, vllm_client, vllm_engine
from mmr_jax.serving import batching, server

from support import fake_server_venv

REPO = pathlib.Path(__file__).resolve().parents[2]


class FakeBackend:
    """Completion k of sample i for prompt p: token (sum(p) + 7 * i + k) % 50 + 10."""

    model_name = "fake"
    max_model_len = 256
    vocab_size = 1000
    eos_token_ids = (2,)

    def __init__(self):
        self._adapters, self.rpc_calls, self.generate_models = {}, [], []
        self.requests = []  # (prompt ids, seed) of every generate call
        self.params = []  # the SamplingParams of every generate call

    def generate(self, prompt_ids, params, *, model, ignore_eos):
        self.generate_models.append(model)
        self.requests.append(([list(p) for p in prompt_ids], params.seed))
        self.params.append(params)
        stops = set(params.stop_token_ids) | (set() if ignore_eos else set(self.eos_token_ids))
        toks, lps, reasons = [], [], []
        for p in prompt_ids:
            rows = [[], [], []]
            for i in range(params.n):
                ids, reason = [], "length"
                for k in range(params.max_new_tokens):
                    ids.append((sum(p) + 7 * i + k) % 50 + 10)
                    if ids[-1] in stops:
                        reason = "stop"
                        break
                rows[0].append(ids)
                rows[1].append([-0.1 * (k + 1) for k in range(len(ids))])
                rows[2].append(reason)
            toks.append(rows[0]), lps.append(rows[1]), reasons.append(rows[2])
        return base.batch_from_lists(toks, lps, reasons)

    def exclusive(self):
        return contextlib.nullcontext()

    def start(self, prompt_ids, params, *, model, ignore_eos, n_slots):
        batch = self.generate(prompt_ids, params, model=model, ignore_eos=ignore_eos)
        return batching.Finished(batch)

    def encode(self, text, *, add_special_tokens=True):
        return [ord(c) % 50 for c in text]

    def decode(self, ids, *, skip_special_tokens=True):
        return " ".join(map(str, ids))

    def token_strings(self, ids):
        return [str(t) for t in ids]

    def adapters(self):
        return dict(self._adapters)

    def load_adapter(self, name, path):
        self._adapters[name] = path

    def unload_adapter(self, name):
        del self._adapters[name]

    def collective_rpc(self, method, args, kwargs):
        self.rpc_calls.append((method, args, kwargs))
        return {"ok": True}


@pytest.fixture
def fake():
    backend = FakeBackend()
    with server.OpenAIServer(backend, weights_dir="/") as srv:
        yield backend, srv


def _client(url, **kw):
    kw.setdefault("max_retries", 2)
    kw.setdefault("backoff_s", 0.01)
    kw.setdefault("timeout_s", 5.0)
    return vllm_client.VllmClient(url, **kw)


class TestVllmEngineGenerate:
    def test_batch_is_prompt_major_with_returned_ids_and_logprobs(self, fake):
        backend, srv = fake
        engine = vllm_engine.VllmEngine(_client(srv.url), model="fake", prompts_per_request=2)
        prompts = [[1, 2], [3], [4, 5, 6], [7], [30, 3]]
        params = base.SamplingParams(max_new_tokens=6, n=3, stop_token_ids=(15,), seed=3)
        batch = engine.generate(prompts, params)
        ref = backend.generate(prompts, params, model="fake", ignore_eos=False)
        np.testing.assert_array_equal(batch.tokens, ref.tokens)
        np.testing.assert_array_equal(batch.mask, ref.mask)
        np.testing.assert_allclose(batch.logprobs, ref.logprobs, rtol=1e-6)
        assert batch.finish_reasons == ref.finish_reasons
        assert "stop" in sum(batch.finish_reasons, []) and "length" in sum(batch.finish_reasons, [])

    def test_response_shape_is_vllms(self, fake):
        _, srv = fake
        body = _client(srv.url).completions(
            {
                "model": "fake",
                "prompt": "ab",
                "n": 2,
                "max_tokens": 3,
                "logprobs": 0,
                "return_token_ids": True,
                "stop_token_ids": [],
            }
        )
        assert body["object"] == "text_completion" and body["usage"]["completion_tokens"] == 6
        c = body["choices"][1]
        assert c["index"] == 1 and c["prompt_token_ids"] == [47, 48]
        assert len(c["token_ids"]) == 3 and c["finish_reason"] == "length"
        assert set(c["logprobs"]) == {"text_offset", "token_logprobs", "tokens", "top_logprobs"}

    def test_wrong_model_name_lists_served_models(self, fake):
        _, srv = fake
        with pytest.raises(vllm_client.ModelNotFoundError, match=r"'nope'.*\['fake'\]"):
            vllm_engine.VllmEngine(_client(srv.url), model="nope")
        engine = vllm_engine.VllmEngine(_client(srv.url), model="nope", check_model=False)
        with pytest.raises(vllm_client.ModelNotFoundError, match="served models"):
            engine.generate([[1]], base.SamplingParams(max_new_tokens=2))

    def test_unsupported_request_is_a_clear_400(self, fake):
        _, srv = fake
        with pytest.raises(vllm_client.ServerError, match="beam search is not supported") as e:
            _client(srv.url).completions({"model": "fake", "prompt": [1], "use_beam_search": True})
        assert e.value.status == 400

    @pytest.mark.parametrize(
        "extra,match",
        [
            ({"best_of": 3}, "best_of=3 is not supported"),
            ({"repetition_penalty": 1.1}, "repetition_penalty=1.1 is not supported"),
            ({"presence_penalty": 0.5}, "presence_penalty"),
            ({"min_p": 0.05}, "min_p"),
            ({"logit_bias": {"5": 2.0}}, "logit_bias"),
            ({"min_tokens": 4}, "min_tokens"),
            ({"seed": "7"}, "seed must be an integer"),
            ({"seed": 1.5}, "seed must be an integer"),
        ],
    )
    def test_ignored_controls_are_refused_not_dropped(self, fake, extra, match):
        backend, srv = fake
        body = {"model": "fake", "prompt": [1, 2], "max_tokens": 2, **extra}
        with pytest.raises(vllm_client.ServerError, match=match) as e:
            _client(srv.url).completions(body)
        assert e.value.status == 400 and backend.requests == []  # refused, not retried

    def test_neutral_values_of_those_controls_are_accepted(self, fake):
        backend, srv = fake
        neutral = {"best_of": 1, "repetition_penalty": 1.0, "min_p": 0.0, "logit_bias": {}}
        body = {"model": "fake", "prompt": [1, 2], "max_tokens": 2, "seed": 4, **neutral}
        reply = _client(srv.url).completions(body)
        assert len(reply["choices"]) == 1 and backend.requests == [([[1, 2]], 4)]

    def test_greedy_n_asks_one_completion_and_repeats_it(self, fake):
        # A real vLLM answers greedy n > 1 with HTTP 400 "n must be 1 when using greedy sampling".
        backend, srv = fake
        seen = []
        generate = backend.generate
        backend.generate = lambda p, params, **kw: (
            seen.append(params.n) or generate(p, params, **kw)
        )
        engine = vllm_engine.VllmEngine(_client(srv.url), model="fake")
        batch = engine.generate(
            [[1, 2], [3]], base.SamplingParams(max_new_tokens=4, n=3, temperature=0)
        )
        assert seen == [1] and batch.tokens.shape == (2, 3, 4)
        for b in range(2):
            assert all((batch.tokens[b, i] == batch.tokens[b, 0]).all() for i in range(3))
        engine.generate([[1, 2]], base.SamplingParams(max_new_tokens=4, n=3, temperature=0.7))
        assert seen == [1, 3]  # sampled calls still ask for n

    def test_seeded_call_sends_each_prompt_its_own_seed(self, fake):
        # vLLM seeds every prompt of a request alike: a repeated prompt would repeat its samples.
        backend, srv = fake
        engine = vllm_engine.VllmEngine(_client(srv.url), model="fake", prompts_per_request=4)
        prompts = [[1, 2], [1, 2], [3], [4, 5]]
        engine.generate(prompts, base.SamplingParams(max_new_tokens=2, n=2, seed=11))
        sent = sorted(backend.requests, key=lambda r: r[1])
        want = sorted(([p], vllm_engine.prompt_seed(11, b)) for b, p in enumerate(prompts))
        want = sorted(want, key=lambda r: r[1])
        assert sent == want and len({s for _, s in sent}) == len(prompts)
        assert vllm_engine.prompt_seed(12, 0) not in {s for _, s in sent}
        backend.requests.clear()
        engine.generate(prompts, base.SamplingParams(max_new_tokens=2, n=2))  # unseeded: batched
        assert backend.requests == [(prompts, None)]


class TestCheckpointEngine:
    def test_vllm_engine_of_a_served_checkpoint(self, fake, tmp_path):
        from mmr_jax.training import engines

        _, srv = fake
        engine = engines.checkpoint_engine("vllm", "fake", url=srv.url + "/v1")
        assert isinstance(engine, vllm_engine.VllmEngine) and engine.client.base_url == srv.url
        assert engine.generate([[1]], base.SamplingParams(max_new_tokens=3)).tokens.shape == (
            1,
            1,
            3,
        )
        with pytest.raises(ValueError, match="unknown engine 'sglang'"):
            engines.checkpoint_engine("sglang", "x")

    def test_hub_id_engine_sends_every_eos_as_stop_ids(
        self, fake, tiny_llama_dir, tmp_path, monkeypatch
    ):
        """A hub id whose generation config lists two EOS ids (2, the tokenizer's, and 13, which
        the fake backend's completion of [1] reaches third): both go in the request."""
        from mmr_jax.rollout import stops

        from support import testing

        testing.offline_hub(monkeypatch, tmp_path / "hub")
        testing.as_hub_snapshot(tiny_llama_dir, tmp_path / "hub", "org/tiny", eos_token_ids=[2, 13])
        backend, srv = fake
        client = vllm_client.VllmClient(srv.url, max_retries=0)
        engine = vllm_engine.VllmEngine(
            client, model="fake", eos_token_ids=stops.stop_token_ids("org/tiny")
        )
        batch = engine.generate([[1]], base.SamplingParams(max_new_tokens=6, temperature=0.0))
        assert backend.params[-1].stop_token_ids == (2, 13)
        assert batch.tokens[0, 0].tolist() == [11, 12, 13]
        assert batch.finish_reasons == [[base.FINISH_STOP]]


class TestWeightSync:
    def test_full_weights_rpc_then_reset(self, fake, tmp_path):
        backend, srv = fake
        engine = vllm_engine.VllmEngine(_client(srv.url), model="fake", sync_dir=tmp_path)
        for v in (1, 2):
            (tmp_path / f"weights-v{v}").mkdir()
            engine.load_weights_dir(tmp_path / f"weights-v{v}", version=v)
        # vLLM's own reload: reload_weights(weights_path=...) on every worker.
        assert backend.rpc_calls == [
            ("reload_weights", [], {"weights_path": str((tmp_path / f"weights-v{v}").resolve())})
            for v in (1, 2)
        ]
        assert not (tmp_path / "weights-v1").exists() and (tmp_path / "weights-v2").exists()
        assert engine.version == 2

    def test_lora_new_name_per_version_old_unloaded(self, fake, tmp_path):
        backend, srv = fake
        engine = vllm_engine.VllmEngine(
            _client(srv.url), model="fake", sync_dir=tmp_path, lora=True
        )
        for v in (1, 2):
            (tmp_path / f"lora-v{v}").mkdir()
            engine.load_adapter_dir(tmp_path / f"lora-v{v}", version=v)
        assert backend.adapters() == {"policy-v2": str((tmp_path / "lora-v2").resolve())}
        assert engine.model == "policy-v2"
        engine.generate([[1, 2]], base.SamplingParams(max_new_tokens=2))
        assert backend.generate_models[-1] == "policy-v2"
        assert engine.client.models() == ["fake", "policy-v2"]

    @pytest.mark.parametrize("lora", [False, True])
    def test_sync_folder_that_vanished_is_named_and_nothing_is_sent(self, fake, tmp_path, lora):
        backend, srv = fake
        engine = vllm_engine.VllmEngine(
            _client(srv.url), model="fake", sync_dir=tmp_path, lora=lora
        )
        load = engine.load_adapter_dir if lora else engine.load_weights_dir
        with pytest.raises(vllm_engine.SyncFolderMissingError, match="gone does not exist"):
            load(tmp_path / "gone", version=1)
        assert backend.rpc_calls == [] and backend.adapters() == {} and engine.version is None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Stub(http.server.BaseHTTPRequestHandler):
    status, body, count = 500, b'{"error": {"message": "boom"}}', 0

    def do_POST(self):
        type(self).count += 1
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.send_response(self.status)
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    do_GET = do_POST

    def log_message(self, *args):
        pass


@pytest.fixture
def stub():
    handler = type("Handler", (_Stub,), {"count": 0})
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield handler, f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


class TestFailures:
    def test_server_down_is_a_clear_error_within_the_timeout(self):
        url = f"http://127.0.0.1:{_free_port()}"
        client = _client(url, max_retries=2, backoff_s=0.1)
        start = time.monotonic()
        with pytest.raises(vllm_client.ServerUnavailableError, match=url + ".*unreachable"):
            client.completions({"prompt": [1]})
        assert time.monotonic() - start < 3.0
        assert not client.health()

    def test_engine_waits_for_a_server_that_is_still_loading(self):
        # Nothing listens on the port until the timer starts the server (it binds on creation).
        port, started = _free_port(), []
        timer = threading.Timer(
            0.5, lambda: started.append(server.OpenAIServer(FakeBackend(), port=port).start())
        )
        timer.start()
        try:
            client = _client(f"http://127.0.0.1:{port}", max_retries=0)
            assert not client.health()
            engine = vllm_engine.VllmEngine(client, model="fake", wait_ready_s=20.0)
            batch = engine.generate([[1]], base.SamplingParams(max_new_tokens=2))
            assert batch.tokens.shape == (1, 1, 2)
        finally:
            timer.join()
            for srv in started:
                srv.shutdown()

    def test_engine_gives_up_waiting_with_a_clear_error(self):
        url = f"http://127.0.0.1:{_free_port()}"
        start = time.monotonic()
        with pytest.raises(vllm_client.ServerUnavailableError, match="not healthy after 1s"):
            vllm_engine.VllmEngine(_client(url, max_retries=0), model="fake", wait_ready_s=1.0)
        assert time.monotonic() - start < 5.0

    def test_http_500_is_retried_then_raises(self, stub):
        handler, url = stub
        with pytest.raises(vllm_client.ServerError, match=r"3 attempts.*HTTP 500: boom"):
            _client(url, max_retries=2).completions({"prompt": [1]})
        assert handler.count == 3

    @pytest.mark.parametrize(
        "body,match",
        [
            (b"not json", "non-JSON"),
            (b'{"choices": [{"index": 0, "text": "x", "finish_reason": "stop"}]}', "token_ids"),
            (b'{"choices": []}', "0 choices"),
            # Fewer completions than asked (1 prompt x n=2): refused whole, not padded.
            (
                b'{"choices": [{"index": 0, "token_ids": [4], "finish_reason": "length",'
                b' "logprobs": {"token_logprobs": [-0.5]}}]}',
                "1 choices for 1 prompts x n=2",
            ),
        ],
    )
    def test_malformed_reply(self, stub, body, match):
        handler, url = stub
        handler.status, handler.body = 200, body
        engine = vllm_engine.VllmEngine(_client(url), model="m", check_model=False)
        with pytest.raises(vllm_client.MalformedResponseError, match=match):
            engine.generate(
                [[1, 2]], base.SamplingParams(max_new_tokens=2, n=2 if "n=2" in match else 1)
            )
        assert handler.count == 1  # Not retried.


class _Scripted(http.server.BaseHTTPRequestHandler):
    """Answers request i with `replies[i]` (the last one from then on): (delay_s, status, body),
    or (delay_s, None, None) to drop the connection without a reply. Records (method, route)."""

    replies: list = []
    seen: list = []

    def serve(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        with _SEEN_LOCK:
            i = len(self.seen)
            self.seen.append((self.command, self.path))
        delay, status, body = self.replies[min(i, len(self.replies) - 1)]
        time.sleep(delay)
        if status is None:
            self.close_connection = True
            return
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except OSError:  # the client gave up on this reply
            pass

    do_GET = do_POST = serve

    def log_message(self, *args):
        pass


_SEEN_LOCK = threading.Lock()


@contextlib.contextmanager
def _scripted_server(replies, port=0):
    handler = type("Handler", (_Scripted,), {"replies": replies, "seen": []})
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", port), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield handler, f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


_MODELS = {"data": [{"id": "base"}, {"id": "policy-v1"}]}
_COMPLETION = {"choices": []}


class TestRetrySafety:
    """Only what is safe to repeat is sent again, against a real local HTTP server."""

    def test_completion_whose_reply_timed_out_is_not_sent_again(self):
        with _scripted_server([(1.0, 200, _COMPLETION)]) as (handler, url):
            client = _client(url, timeout_s=0.3, max_retries=3)
            with pytest.raises(vllm_client.ServerUnavailableError, match="not sent again"):
                client.completions({"prompt": [1]})
            time.sleep(0.5)  # a retry, had there been one, would have arrived by now
            assert handler.seen == [("POST", "/v1/completions")]

    def test_completion_dropped_after_sending_is_not_sent_again(self):
        with _scripted_server([(0.0, None, None)]) as (handler, url):
            with pytest.raises(vllm_client.ServerUnavailableError, match="not sent again"):
                _client(url, max_retries=3).completions({"prompt": [1]})
            assert handler.seen == [("POST", "/v1/completions")]

    def test_completion_refused_before_sending_is_retried(self):
        # Nothing listens until the timer starts the server: the first attempts are refused.
        port, started = _free_port(), threading.Event()

        def serve():
            with _scripted_server([(0.0, 200, _COMPLETION)], port=port) as (handler, _):
                started.set()
                while len(handler.seen) < 1:
                    time.sleep(0.01)

        timer = threading.Timer(0.3, serve)
        timer.start()
        try:
            client = _client(f"http://127.0.0.1:{port}", max_retries=5, backoff_s=0.1)
            assert client.completions({"prompt": [1]}) == _COMPLETION
            assert started.is_set()
        finally:
            timer.join()

    def test_idempotent_get_is_retried_after_a_read_timeout(self):
        with _scripted_server([(1.0, 200, _MODELS), (0.0, 200, _MODELS)]) as (handler, url):
            assert _client(url, timeout_s=0.3).models() == ["base", "policy-v1"]
            assert handler.seen == [("GET", "/v1/models")] * 2

    def test_adapter_load_whose_reply_was_lost_counts_as_loaded(self):
        replies = [
            (1.0, 200, b""),  # loads, but the reply comes after the client's timeout
            (
                0.0,
                400,
                {"error": {"message": "The lora adapter 'policy-v1' has already been loaded."}},
            ),
            (0.0, 200, _MODELS),
        ]
        with _scripted_server(replies) as (handler, url):
            _client(url, timeout_s=0.3).load_lora_adapter("policy-v1", "/sync/lora-v1")
            assert handler.seen == [("POST", "/v1/load_lora_adapter")] * 2 + [("GET", "/v1/models")]

    def test_adapter_load_refused_for_a_name_not_served_raises(self):
        replies = [(0.0, 400, {"error": {"message": "no adapter at /x"}}), (0.0, 200, _MODELS)]
        with _scripted_server(replies) as (_, url):
            with pytest.raises(vllm_client.ServerError, match="no adapter at /x"):
                _client(url).load_lora_adapter("policy-v2", "/x")

    def test_unloading_an_adapter_no_longer_served_succeeds(self):
        gone = {"error": {"message": "The lora adapter 'policy-v0' cannot be found."}}
        with _scripted_server([(0.0, 404, gone), (0.0, 200, _MODELS)]) as (handler, url):
            _client(url).unload_lora_adapter("policy-v0")
            assert handler.seen[-1] == ("GET", "/v1/models")
        with _scripted_server([(0.0, 404, gone), (0.0, 200, _MODELS)]) as (_, url):
            with pytest.raises(vllm_client.ServerError, match="cannot be found"):
                _client(url).unload_lora_adapter("policy-v1")  # listed: the 404 is real

    @pytest.mark.parametrize(
        "reply", [(0.3, 503, {"error": {"message": "busy"}}), (5.0, 200, _MODELS)]
    )
    def test_total_time_is_bounded_across_retries(self, reply):
        with _scripted_server([reply]) as (handler, url):
            client = _client(
                url, timeout_s=1.0, total_timeout_s=1.5, max_retries=50, backoff_s=0.05
            )
            start = time.monotonic()
            with pytest.raises(vllm_client.VllmError):
                client.models()
            assert time.monotonic() - start < 2.0
            assert 1 <= len(handler.seen) <= 5

    def test_timeouts_must_be_positive(self):
        with pytest.raises(ValueError, match="timeouts must be > 0"):
            vllm_client.VllmClient("http://127.0.0.1:1", total_timeout_s=0)


class TestLaunchCommand:
    def test_flags_for_cpu_cuda_and_lora(self):
        from mmr_jax.rollout import vllm_launch

        opts = vllm_launch.LaunchOptions(
            model="ckpt/m", port=8123, python="/v/bin/python", max_model_len=4096
        )
        argv, env = vllm_launch.command(opts)
        joined = " ".join(argv)
        assert argv[:3] == ["/v/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
        assert "--model ckpt/m" in joined and "--port 8123" in joined
        assert "--logprobs-mode processed_logprobs" in joined
        # CPU: seeded requests crash the engine under chunked prefill.
        assert "--no-enable-chunked-prefill" in argv and "--gpu-memory-utilization" not in argv
        assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["VLLM_CPU_KVCACHE_SPACE"] == "1"
        assert "--enable-lora" not in argv and "PYTHONPATH" not in env
        argv, env = vllm_launch.command(
            dataclasses.replace(opts, backend="cuda", gpu_memory_utilization=0.4, lora_rank=64)
        )
        assert "--gpu-memory-utilization 0.4" in " ".join(argv)
        assert "--no-enable-chunked-prefill" not in argv and "VLLM_CPU_KVCACHE_SPACE" not in env
        assert "--enable-lora" in argv and argv[argv.index("--max-lora-rank") + 1] == "64"
        assert env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
        with pytest.raises(ValueError, match="backend"):
            vllm_launch.command(dataclasses.replace(opts, backend="tpu"))

    def test_missing_server_venv_says_how_to_build_it(self, tmp_path):
        from mmr_jax.rollout import vllm_launch

        with pytest.raises(vllm_launch.ServerStartError, match="setup_vllm_env.sh"):
            vllm_launch.venv_python(tmp_path / "nope")

    def test_server_that_exits_at_start_is_a_named_error_with_its_log(self, tmp_path):
        # A "server" whose interpreter fails at once: no wait until the timeout.
        from mmr_jax.rollout import vllm_launch

        opts = vllm_launch.LaunchOptions(model="m", port=_free_port(), python=str(tmp_path / "py"))
        srv = vllm_launch.ServerProcess(opts, tmp_path / "log")
        (tmp_path / "py").write_text("#!/bin/sh\necho model failed to load >&2\nexit 3\n")
        (tmp_path / "py").chmod(0o755)
        start = time.monotonic()
        match = r"(?s)code 3.*model failed to load"
        with srv, pytest.raises(vllm_launch.ServerStartError, match=match):
            srv.wait_ready(timeout_s=60)
        assert time.monotonic() - start < 20

    @pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux")
    def test_server_dies_with_a_killed_launcher(self, tmp_path):
        # The "server" is `sleep` behind the real launch path (prelude, exec); the launcher is a
        # separate Python process that we SIGKILL: no atexit, no finally. The server must go too.
        import subprocess

        fake = tmp_path / "py"
        fake.write_text(f'#!/bin/sh\n[ "$1" = -c ] && exec {sys.executable} "$@"\nexec sleep 300\n')
        fake.chmod(0o755)
        code = (
            "import sys, time\n"
            "from mmr_jax.rollout import vllm_launch as v\n"
            f"o = v.LaunchOptions(model='m', port=1, python={str(fake)!r})\n"
            f"s = v.ServerProcess(o, {str(tmp_path / 'log')!r}).start()\n"
            "print(s.proc.pid, flush=True)\n"
            "time.sleep(300)\n"
        )
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        launcher = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, env=env)
        server_pid = int(launcher.stdout.readline())
        deadline = time.monotonic() + 20
        while _proc_cmd(server_pid) != "sleep" and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _proc_cmd(server_pid) == "sleep"  # the server runs
        launcher.kill()
        launcher.wait()
        while _alive(server_pid) and time.monotonic() < deadline + 10:
            time.sleep(0.1)
        assert not _alive(server_pid), "the server outlived its killed launcher"


def _proc_cmd(pid: int) -> str | None:
    try:
        return pathlib.Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return None


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for a reaper counts as dead)."""
    try:
        status = pathlib.Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "State:\tZ" not in status


def _has_vllm_gpu() -> bool:
    try:
        import torch

        from mmr_jax.rollout import vllm_launch

        vllm_launch.venv_python()
    except (ImportError, RuntimeError):
        return False
    return torch.cuda.is_available()


@contextlib.contextmanager
def _real_vllm(model_dir, tmp_path, **options):
    """A CUDA vLLM server of `model_dir` as "tiny" (fp32, eager, 30% of the GPU) from the server
    venv; yields its client."""
    from mmr_jax.rollout import vllm_launch

    opts = vllm_launch.LaunchOptions(
        model=str(model_dir),
        served_model_name="tiny",
        port=_free_port(),
        backend="cuda",
        python=str(vllm_launch.venv_python()),
        max_model_len=512,
        gpu_memory_utilization=0.3,
        dtype="float32",
        extra_args=("--enforce-eager",),
        **options,
    )
    with vllm_launch.ServerProcess(opts, tmp_path / "vllm.log") as srv:
        srv.wait_ready(timeout_s=600)
        yield _client(srv.url, timeout_s=120)


@pytest.mark.gpu
@pytest.mark.skipif(not _has_vllm_gpu(), reason="needs CUDA and the vLLM server venv")
def test_real_vllm_serve_matches_embedded_greedy(tiny_llama_dir, tmp_path):
    """Greedy tokens of a real `vllm serve` on the tiny checkpoint equal the JAX sampler's, before
    and after a full-weight sync through vLLM's reload_weights."""
    from mmr_jax import models
    from mmr_jax.rollout import sampler

    from support import testing

    with _real_vllm(tiny_llama_dir, tmp_path) as client:
        engine = vllm_engine.VllmEngine(client, model="tiny", sync_dir=tmp_path / "sync")
        prompts = [[5, 17, 33, 9, 100], [7, 8], list(range(40, 61))]
        params = base.SamplingParams(max_new_tokens=16, temperature=0.0)
        for path in (tiny_llama_dir, testing.make_tiny_checkpoint(tmp_path / "o", seed=1)):
            if path != tiny_llama_dir:
                engine.load_weights_dir(path, version=1)
            ref = sampler.sample(models.from_pretrained(path), prompts, params, stop_token_ids=(2,))
            np.testing.assert_array_equal(engine.generate(prompts, params).tokens, ref.tokens)


@pytest.mark.gpu
@pytest.mark.skipif(not _has_vllm_gpu(), reason="needs CUDA and the vLLM server venv")
def test_real_vllm_serve_lora_sync_matches_trainer_model(tiny_llama_dir, tmp_path):
    """A real `vllm serve --enable-lora`: after `sync_weights` of a trainer-side LoRA policy, its
    greedy tokens and their log-probs equal the JAX sampler's on that policy, for two versions
    (the second under a new adapter name, the first unloaded)."""
    import jax
    from flax import nnx

    from mmr_jax import models
    from mmr_jax.models import lora
    from mmr_jax.rollout import sampler

    with _real_vllm(tiny_llama_dir, tmp_path, lora_rank=8) as client:
        engine = vllm_engine.VllmEngine(client, model="tiny", sync_dir=tmp_path / "sync", lora=True)
        prompts = [[5, 17, 33, 9, 100], [7, 8], list(range(40, 61))]
        params = base.SamplingParams(max_new_tokens=16, temperature=0.0)
        policy = models.from_pretrained(tiny_llama_dir, lora=lora.LoraConfig(rank=4, alpha=8.0))
        for version in (1, 2):
            state = nnx.to_flat_state(nnx.state(policy, nnx.LoRAParam))
            for i, (path, var) in enumerate(state):
                if path[-1] == "lora_b":
                    key = jax.random.key(100 * version + i)
                    var.set_value(0.3 * jax.random.normal(key, var.get_value().shape))
            engine.sync_weights(policy, version=version)
            ref = sampler.sample(policy, prompts, params, stop_token_ids=(2,))
            got = engine.generate(prompts, params)
            np.testing.assert_array_equal(got.tokens, ref.tokens)
            # fp32 on both sides (torch keeps TF32 off for fp32 matmuls by default): the CPU
            # tests' tolerance (tests/rollout/vllm_server_test.py), not a looser one.
            np.testing.assert_allclose(got.logprobs, ref.logprobs, atol=1e-4)
            assert engine.client.models() == ["tiny", f"policy-v{version}"]


@pytest.mark.slow
def test_trainer_engine_launches_its_server_and_close_stops_it(tiny_llama_dir, tmp_path):
    """rollout.url='' : engines.make_engine starts the server from the server venv, waits for it,
    generates through it; engine.close() stops the whole process group (port free again)."""
    import types

    from mmr_jax.config import checks
    from mmr_jax.rollout import vllm_launch
    from mmr_jax.training import engines

    venv = fake_server_venv.make(tmp_path)
    sys.path.insert(0, str(REPO / "configs"))
    try:
        import base as config_base
    finally:
        sys.path.remove(str(REPO / "configs"))
    c = config_base.get_config()
    c.model.path = str(tiny_llama_dir)
    c.rollout.engine, c.rollout.url, c.rollout.server_venv = "vllm", "", str(venv)
    c.rollout.ready_timeout_s = 120.0
    c.batch.max_prompt_len, c.batch.max_completion_len = 32, 16
    cfg = checks.from_config_dict(c)
    policy = types.SimpleNamespace(lora=False)
    tokenizer = types.SimpleNamespace(pad_token_id=3, eos_token_id=2)
    engine = engines.make_engine(cfg, policy, tokenizer, tiny_llama_dir, tmp_path / "run")
    try:
        assert isinstance(engine.server, vllm_launch.ServerProcess) and engine.server.alive()
        batch = engine.generate([[5, 6, 7]], base.SamplingParams(max_new_tokens=4, temperature=0))
        assert batch.tokens.shape == (1, 1, 4) and engine.client.health()
        server, url, pid = engine.server, engine.server.url, engine.server.proc.pid
    finally:
        engine.close()
    assert not server.alive() and not _alive(pid)
    assert not vllm_client.VllmClient(url, max_retries=0).health()
