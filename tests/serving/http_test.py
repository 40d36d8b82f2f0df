"""`scripts/serve.py` in its own process, through the official `openai` client and raw HTTP: the
limits (400 in milliseconds, nothing compiled), keep-alive connections after refused or unrouted
requests, bad Content-Length, the API key, the weight routes off by default, and streaming that
streams (chunks arrive while the reply is still being decoded).

One server for the module (a tiny random checkpoint, `--max_num_seqs=4`,
`--max_request_tokens=256`, `--api_key`, `--stream_chunk_steps=1`)."""

import http.client
import json
import pathlib
import subprocess
import sys
import time

import pytest

openai = pytest.importorskip("openai")

KEY = "sk-test-key"
SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "serve.py"


@pytest.fixture(scope="module")
def url(tiny_llama_dir):
    argv = [sys.executable, str(SCRIPT), f"--model={tiny_llama_dir}", "--port=0"]
    argv += ["--served_model_name=tiny", "--max_num_seqs=4", "--max_request_tokens=256"]
    argv += [f"--api_key={KEY}", "--stream_chunk_steps=1", "--max_body_bytes=65536"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = proc.stdout.readline()  # "serving 'tiny' at http://127.0.0.1:PORT"
        assert line.startswith("serving 'tiny' at http://"), line
        yield line.split()[-1]
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=300)


def _conn(url) -> http.client.HTTPConnection:
    host, port = url.removeprefix("http://").split(":")
    return http.client.HTTPConnection(host, int(port), timeout=300)


def _post(conn, path, body: bytes, headers=None):
    headers = {
        "Authorization": f"Bearer {KEY}",
        "Content-Type": "application/json",
        **(headers or {}),
    }
    conn.request("POST", path, body=body, headers=headers)
    resp = conn.getresponse()
    return resp.status, json.loads(resp.read() or b"null"), resp


class TestLimits:
    @pytest.mark.parametrize(
        "kw,match",
        [
            (dict(prompt=[[5, 6]] * 3, n=2), "at most 4"),  # 6 sequences > --max_num_seqs
            (dict(prompt=[5, 6], n=2, max_tokens=200), "allows 256"),  # 2 x 202 tokens
            (dict(prompt=[5, 6], max_tokens=10**6), "maximum context length"),
            (dict(prompt=[5, 10**7]), "out of vocabulary"),
            (dict(prompt=[5, 6], extra_body={"stop_token_ids": "12"}), "stop_token_ids"),
            (dict(prompt=[5, 6], temperature=2.5, top_p=0.0), "top_p"),
            (dict(prompt=[5, 6], extra_body={"guided_json": {}}), "guided_json"),
            (dict(prompt=[5, 6], extra_body={"use_beam_search": True}), "beam search"),
        ],
    )
    def test_refused_in_milliseconds(self, client, kw, match):
        kw = {"model": "tiny", "max_tokens": 4, **kw}
        start = time.perf_counter()
        with pytest.raises(openai.BadRequestError, match=match) as e:
            client.completions.create(**kw)
        assert time.perf_counter() - start < 2.0  # nothing compiled (a compile takes seconds)
        assert e.value.status_code == 400 and e.value.body["type"] == "invalid_request_error"

    def test_non_string_model_and_body_over_the_cap(self, url):
        conn = _conn(url)
        status, body, _ = _post(conn, "/v1/completions", json.dumps({"model": 3}).encode())
        assert status == 400 and "model must be a string" in body["error"]["message"]
        nan = b'{"model": "tiny", "prompt": [5], "temperature": NaN}'  # Python's json writes it
        status, body, _ = _post(conn, "/v1/completions", nan)
        assert status == 400 and "temperature must be a finite number" in body["error"]["message"]
        big = json.dumps({"model": "tiny", "prompt": "x" * 70000}).encode()
        status, body, resp = _post(conn, "/v1/completions", big)
        assert status == 400 and body["error"]["code"] == "request_too_large"
        assert resp.getheader("Connection") == "close"


class TestKeepAlive:
    def test_next_request_on_the_connection_after_404_and_400(self, url):
        conn = _conn(url)
        payload = json.dumps({"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2}).encode()
        for path, want in [
            ("/v1/nope", 404),  # unrouted: its body is read all the same
            ("/collective_rpc", 404),  # the weight routes are off without --weights_dir
            ("/v1/completions", 200),
        ]:
            status, body, _ = _post(conn, path, payload)
            assert status == want, body
        assert body["choices"][0]["text"] is not None

    @pytest.mark.parametrize("length", ["abc", "-5", "99999999999999999999"])
    def test_bad_content_length_is_a_400_and_closes(self, url, length):
        conn = _conn(url)
        conn.putrequest("POST", "/v1/completions")
        conn.putheader("Authorization", f"Bearer {KEY}")
        conn.putheader("Content-Length", length)
        # Headers only: body bytes the server never reads would make its close a TCP reset,
        # which may discard the 400 before we read it (so with vLLM's uvicorn too).
        conn.endheaders()
        resp = conn.getresponse()
        assert resp.status == 400 and resp.getheader("Connection") == "close"
        body = resp.read()
        if length.isdigit():  # a number over --max_body_bytes: ours, in OpenAI's shape
            assert json.loads(body)["error"]["code"] == "request_too_large"
        else:  # not a number: uvicorn's own 400, as vLLM's server (uvicorn too) answers it
            assert body == b"Invalid HTTP request received."

    def test_chunked_bodies_are_read_and_bounded(self, url):
        """A body sent in chunks (no Content-Length) is read as one, as vLLM's (uvicorn) reads
        it; chunks that add up to more than --max_body_bytes are a 400 that closes."""
        conn = _conn(url)
        headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
        payload = json.dumps({"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2}).encode()
        parts = iter([payload[:9], payload[9:]])
        conn.request("POST", "/v1/completions", body=parts, headers=headers, encode_chunked=True)
        resp = conn.getresponse()
        assert resp.status == 200 and json.loads(resp.read())["usage"]["prompt_tokens"] == 3
        big = iter([b"x" * 40000] * 2)
        conn.request("POST", "/v1/completions", body=big, headers=headers, encode_chunked=True)
        resp = conn.getresponse()
        assert resp.status == 400 and resp.getheader("Connection") == "close"
        assert json.loads(resp.read())["error"]["code"] == "request_too_large"


class TestApiKey:
    def test_key_required(self, url, client):
        wrong = openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            wrong.models.list()
        assert [m.id for m in client.models.list().data] == ["tiny"]
        conn = _conn(url)
        conn.request("GET", "/health")  # open, as vLLM's
        assert conn.getresponse().status == 200


class TestStreaming:
    def test_first_chunk_arrives_long_before_the_end(self, client):
        # 96 tokens decoded one step per chunk: the first piece comes after the prefill and two
        # steps; the last after 96 steps. (After a request of the same shape: nothing compiles.)
        kw = dict(model="tiny", prompt=[5, 6, 7], max_tokens=96, temperature=1.0, logprobs=0)
        kw["extra_body"] = {"ignore_eos": True}
        list(client.completions.create(stream=True, **kw))
        start = time.perf_counter()
        times = []
        for chunk in client.completions.create(stream=True, **kw):
            if chunk.choices and chunk.choices[0].logprobs:  # a token's chunk
                times.append(time.perf_counter() - start)
        total = time.perf_counter() - start
        assert len(times) == 96
        assert times[0] < 0.5 * total, (times[0], total)
        assert times[48] < total  # chunks spread over the decode, not sent at its end

    def test_stop_string_ends_the_stream(self, client):
        whole = client.completions.create(
            model="tiny",
            prompt=[5, 6, 7],
            max_tokens=40,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        text = whole.choices[0].text
        stop = text[len(text) // 2 : len(text) // 2 + 2]
        if not stop.strip():
            pytest.skip("no stop string in the greedy text")
        kw = dict(model="tiny", prompt=[5, 6, 7], max_tokens=40, temperature=0, stop=[stop])
        kw["extra_body"] = {"ignore_eos": True}
        chunks = list(client.completions.create(stream=True, **kw))
        streamed = "".join(c.choices[0].text for c in chunks if c.choices)
        cut = client.completions.create(**kw)
        assert streamed == cut.choices[0].text == text[: text.index(stop)]
        assert chunks[-1].choices[0].finish_reason == "stop"


class TestTokenControls:
    def test_allowed_ids_logit_bias_and_min_tokens_over_http(self, url):
        """vLLM's logit_bias, allowed_token_ids and min_tokens through the continuous batch
        (the per-token checks against a plain greedy loop: slot_scheduler_test)."""
        conn = _conn(url)
        body = {"model": "tiny", "prompt": [5, 6, 7], "return_token_ids": True, "seed": 1}
        allowed = {**body, "max_tokens": 12, "temperature": 1.0, "ignore_eos": True}
        allowed["allowed_token_ids"] = [9, 10, 11]
        status, reply, _ = _post(conn, "/v1/completions", json.dumps(allowed).encode())
        assert status == 200 and set(reply["choices"][0]["token_ids"]) <= {9, 10, 11}
        forced = {**body, "max_tokens": 4, "temperature": 0, "logit_bias": {"42": 100}}
        status, reply, _ = _post(conn, "/v1/completions", json.dumps(forced).encode())
        assert status == 200 and reply["choices"][0]["token_ids"][0] == 42
        bad = {**body, "max_tokens": 2, "logit_bias": {"99999999": 1.0, "x": 2.0}}
        status, reply, _ = _post(conn, "/v1/completions", json.dumps(bad).encode())
        assert status == 400 and "'x'" in reply["error"]["message"]
        bad = {**body, "max_tokens": 2, "min_tokens": 3}
        status, reply, _ = _post(conn, "/v1/completions", json.dumps(bad).encode())
        assert status == 400 and reply["error"]["param"] == "min_tokens"
