"""The parts of vLLM's OpenAI API beyond OpenAI's own, and the HTTP rules vLLM's server keeps,
against our server on a tiny random model (in-process).

Independent references: a teacher-forced transformers forward pass (echo and prompt log-probs),
the tokenizer (text offsets, chat templates), the plain /v1/completions reply (routes that
answer the same request another way), and hand-worked values (usage, offsets of "💡💡")."""

import json
import socket
import struct
import time

import numpy as np
import pytest
import requests

from mmr_jax.serving import embedded_backend, server

openai = pytest.importorskip("openai")
torch = pytest.importorskip("torch")

CHAT = [{"role": "user", "content": "What is 12 + 35?"}]
PROMPT = "The answer to 12 + 35 is"


@pytest.fixture(scope="module")
def served(tiny_llama_dir):
    backend = embedded_backend.EmbeddedBackend.from_pretrained(tiny_llama_dir, model_name="tiny")
    with server.OpenAIServer(backend) as srv:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0)
        yield backend, srv, client


@pytest.fixture(scope="module")
def hf_logps(tiny_llama_dir):
    """ids -> log softmax of transformers' logits at each position [T, V] (no temperature)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)

    def logps(ids):
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0], -1).numpy()

    return logps


def _post(srv, path, body, **kw):
    return requests.post(f"{srv.url}{path}", json=body, timeout=300, **kw)


class TestEcho:
    def test_echo_logprobs_are_the_prompt_then_the_completion(self, served, hf_logps):
        """lm-eval's loglikelihood request (local-completions): echo, logprobs 1, max_tokens 1,
        temperature 0. The prompt's log-probs are transformers' (raw logits)."""
        backend, srv, _ = served
        body = dict(model="tiny", prompt=PROMPT, echo=True, logprobs=1, max_tokens=1)
        body.update(temperature=0, seed=1234, return_token_ids=True)
        r = _post(srv, "/v1/completions", body).json()
        c = r["choices"][0]
        prompt = backend.encode(PROMPT)
        assert c["prompt_token_ids"] == prompt and len(c["token_ids"]) == 1
        lp = c["logprobs"]
        assert len(lp["tokens"]) == len(prompt) + 1
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        ref = hf_logps(prompt)
        want = [ref[t, prompt[t + 1]] for t in range(len(prompt) - 1)]
        np.testing.assert_allclose(lp["token_logprobs"][1 : len(prompt)], want, atol=1e-4)
        for t in range(1, len(prompt)):  # the k = 1 alternative and the token itself
            top = lp["top_logprobs"][t]
            best = backend.token_strings([int(ref[t - 1].argmax())])[0]
            assert best in top and top[best] == pytest.approx(ref[t - 1].max(), abs=1e-4)
            assert len(top) <= 2
        completion = backend.decode(c["token_ids"])
        assert c["text"] == PROMPT + completion
        # vLLM's prompt_logprobs rides along (echo asks for it): first None, then by token id.
        assert c["prompt_logprobs"][0] is None
        first = c["prompt_logprobs"][1][str(prompt[1])]
        assert first["logprob"] == pytest.approx(want[0], abs=1e-4)
        assert first["rank"] == 1 + int((ref[0] > ref[0, prompt[1]]).sum())
        assert r["usage"]["prompt_tokens"] == len(prompt) and r["usage"]["completion_tokens"] == 1

    def test_echo_with_max_tokens_0_is_the_prompt_alone(self, served):
        backend, srv, _ = served
        body = dict(model="tiny", prompt=[PROMPT, "2 + 2 ="], echo=True, max_tokens=0)
        r = _post(srv, "/v1/completions", {**body, "logprobs": 0})
        assert r.status_code == 200, r.text
        texts = [c["text"] for c in r.json()["choices"]]
        assert texts == [PROMPT, "2 + 2 ="]
        assert r.json()["usage"]["completion_tokens"] == 0
        chunks = _sse(_post(srv, "/v1/completions", {**body, "stream": True}, stream=True))
        streamed = {0: "", 1: ""}
        for ch in chunks:
            for c in ch["choices"]:
                streamed[c["index"]] += c["text"]
        assert list(streamed.values()) == texts
        no_echo = _post(srv, "/v1/completions", {**body, "echo": False})
        assert no_echo.status_code == 400 and no_echo.json()["error"]["param"] == "max_tokens"

    def test_prompt_logprobs_in_chat_and_refused_when_streamed(self, served, hf_logps):
        backend, srv, _ = served
        body = dict(model="tiny", messages=CHAT, max_tokens=2, prompt_logprobs=2)
        r = _post(srv, "/v1/chat/completions", {**body, "return_token_ids": True}).json()
        prompt = backend.chat_prompt(CHAT)
        assert r["prompt_token_ids"] == prompt
        lps = r["prompt_logprobs"]
        ref = hf_logps(prompt)
        assert lps[0] is None and len(lps) == len(prompt)
        for t in range(1, len(prompt)):
            ranks = sorted(entry["rank"] for entry in lps[t].values())
            assert ranks[:2] == [1, 2] or ranks[0] == 1  # the two most likely, and the token
            entry = lps[t][str(prompt[t])]
            assert entry["logprob"] == pytest.approx(ref[t - 1, prompt[t]], abs=1e-4)
        r = _post(srv, "/v1/chat/completions", {**body, "stream": True})
        assert r.status_code == 400 and "stream" in r.json()["error"]["message"]


def _sse(resp) -> list[dict]:
    assert resp.status_code == 200, resp.text
    out = []
    for line in resp.iter_lines():
        if line.startswith(b"data: ") and line != b"data: [DONE]":
            out.append(json.loads(line[6:]))
    return out


class TestTextOffsets:
    def test_byte_level_tokens_count_characters_as_vllm(self, served):
        """A token's offset counts the characters complete before it (for SmolLM2's tokenizer,
        "💡💡" is three byte-level tokens per character: vLLM's offsets [0,0,0,1,1,1])."""
        backend, srv, _ = served
        ids = backend.encode("💡💡", add_special_tokens=False)
        assert len(ids) > 2  # byte-level pieces
        body = dict(model="tiny", prompt=ids, echo=True, max_tokens=0, logprobs=0)
        lp = _post(srv, "/v1/completions", body).json()["choices"][0]["logprobs"]
        complete = [len(backend.decode(ids[:i]).rstrip("\ufffd")) for i in range(len(ids))]
        assert lp["text_offset"] == complete
        assert "".join(lp["tokens"]) == "💡💡"

    def test_stream_and_non_stream_offsets_agree(self, served):
        backend, srv, _ = served
        body = dict(model="tiny", prompt=PROMPT, max_tokens=24, logprobs=1, seed=7, n=2)
        body.update(temperature=1.0, ignore_eos=True)
        whole = _post(srv, "/v1/completions", body).json()["choices"]
        chunks = _sse(_post(srv, "/v1/completions", {**body, "stream": True}, stream=True))
        for c in whole:
            offsets, tokens = [], []
            for ch in chunks:
                for s in ch["choices"]:
                    if s["index"] == c["index"] and s["logprobs"]:
                        offsets += s["logprobs"]["text_offset"]
                        tokens += s["logprobs"]["tokens"]
            assert offsets == c["logprobs"]["text_offset"] and tokens == c["logprobs"]["tokens"]
            # Each offset is the length of the token texts before it (hand-worked rule).
            assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]


class TestStreamUsage:
    def test_continuous_usage_stats_on_every_chunk(self, served):
        _, srv, _ = served
        body = dict(model="tiny", prompt=[5, 6, 7], max_tokens=8, ignore_eos=True, stream=True)
        body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
        chunks = _sse(_post(srv, "/v1/completions", body, stream=True))
        counts = [ch["usage"]["completion_tokens"] for ch in chunks]
        assert all(ch["usage"]["prompt_tokens"] == 3 for ch in chunks)
        assert counts == sorted(counts) and counts[-1] == 8 and counts[0] == 1
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] == 11
        body["stream_options"] = {"include_usage": True}
        chunks = _sse(_post(srv, "/v1/completions", body, stream=True))
        assert all(ch["usage"] is None for ch in chunks[:-1])

    def test_force_include_usage_streams_usage_unasked(self, served):
        """vLLM's --enable-force-include-usage: every stream as if it asked for continuous
        usage; the chunks count up to the non-streamed reply's usage."""
        backend, _, _ = served
        body = dict(model="tiny", prompt=[5, 6, 7], max_tokens=6, ignore_eos=True)
        with server.OpenAIServer(backend, force_include_usage=True) as forced:
            whole = _post(forced, "/v1/completions", body).json()
            chunks = _sse(_post(forced, "/v1/completions", {**body, "stream": True}, stream=True))
        counts = [ch["usage"]["completion_tokens"] for ch in chunks]
        assert counts == sorted(counts) and counts[0] == 1
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]


class TestRoutes:
    def test_version_ping_load_metrics(self, served):
        _, srv, client = served
        assert requests.get(f"{srv.url}/version", timeout=10).json()["version"]
        assert requests.get(f"{srv.url}/ping", timeout=10).status_code == 200
        assert requests.post(f"{srv.url}/ping", timeout=10).status_code == 200
        assert requests.get(f"{srv.url}/load", timeout=10).json() == {"server_load": 0}

        def generated():
            text = requests.get(f"{srv.url}/metrics", timeout=10).text
            line = next(
                x for x in text.splitlines() if x.startswith("vllm:generation_tokens_total")
            )
            return float(line.split()[-1])

        before = generated()
        reply = client.completions.create(model="tiny", prompt=[5, 6], max_tokens=5, n=2)
        assert generated() - before == reply.usage.completion_tokens

    def test_invocations_and_batched_chat_answer_as_their_routes(self, served):
        _, srv, _ = served
        body = dict(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0)
        plain = _post(srv, "/v1/completions", body).json()["choices"][0]["text"]
        assert _post(srv, "/invocations", body).json()["choices"][0]["text"] == plain
        chat = dict(model="tiny", max_tokens=6, temperature=0)
        other = [{"role": "user", "content": "Name a prime."}]
        alone = [
            _post(srv, "/v1/chat/completions", {**chat, "messages": m}).json()
            for m in (CHAT, other)
        ]
        assert (
            _post(srv, "/invocations", {**chat, "messages": CHAT}).json()["choices"]
            == (alone[0]["choices"])
        )
        batch = _post(srv, "/v1/chat/completions/batch", {**chat, "messages": [CHAT, other]})
        got = batch.json()
        assert [c["index"] for c in got["choices"]] == [0, 1]
        assert [c["message"] for c in got["choices"]] == [a["choices"][0]["message"] for a in alone]
        assert got["usage"]["completion_tokens"] == sum(
            a["usage"]["completion_tokens"] for a in alone
        )
        r = _post(srv, "/invocations", {"model": "tiny"})
        assert r.status_code == 400 and "suitable handler" in r.json()["error"]["message"]


class TestPromptControls:
    def test_truncate_prompt_tokens_keeps_the_last_k(self, served):
        _, srv, _ = served
        body = dict(model="tiny", max_tokens=5, temperature=0, return_token_ids=True)
        ids = list(range(5, 25))
        cut = _post(srv, "/v1/completions", {**body, "prompt": ids, "truncate_prompt_tokens": 7})
        direct = _post(srv, "/v1/completions", {**body, "prompt": ids[-7:]})
        assert cut.json()["choices"][0]["prompt_token_ids"] == ids[-7:]
        assert cut.json()["usage"]["prompt_tokens"] == 7
        assert cut.json()["choices"][0]["token_ids"] == direct.json()["choices"][0]["token_ids"]
        right = {**body, "prompt": ids, "truncate_prompt_tokens": 7, "truncation_side": "right"}
        assert (
            _post(srv, "/v1/completions", right).json()["choices"][0]["prompt_token_ids"]
            == (ids[:7])
        )
        big = _post(
            srv, "/v1/completions", {**body, "prompt": ids, "truncate_prompt_tokens": 10**6}
        )
        assert big.status_code == 400 and "max_model_len" in big.json()["error"]["message"]

    def test_continue_final_message_and_chat_token_ids(self, served):
        backend, srv, _ = served
        messages = [*CHAT, {"role": "assistant", "content": "The answer is"}]
        body = dict(model="tiny", messages=messages, max_tokens=3, temperature=0)
        body.update(continue_final_message=True, add_generation_prompt=False)
        r = _post(srv, "/v1/chat/completions", {**body, "return_token_ids": True}).json()
        text = backend.tokenizer.apply_chat_template(
            messages, tokenize=False, continue_final_message=True
        )
        assert r["prompt_token_ids"] == backend.encode(text, add_special_tokens=False)
        assert text.endswith("The answer is")
        ids = r["choices"][0]["token_ids"]
        assert backend.decode(ids).startswith(r["choices"][0]["message"]["content"])
        as_ids = _post(
            srv,
            "/v1/chat/completions",
            {**body, "logprobs": True, "return_tokens_as_token_ids": True},
        ).json()
        tokens = [e["token"] for e in as_ids["choices"][0]["logprobs"]["content"]]
        assert tokens == [f"token_id:{t}" for t in ids]
        both = _post(srv, "/v1/chat/completions", {**body, "add_generation_prompt": True})
        assert both.status_code == 400

    def test_streamed_token_ids_equal_the_reply(self, served):
        """return_token_ids streamed, as vLLM's: each chunk's token ids, joined, are the
        reply's; the prompt's ids come once per choice (completions: in the choice; chat:
        beside the choices, in the first chunk only)."""
        _, srv, _ = served
        body = dict(model="tiny", max_tokens=7, temperature=0, return_token_ids=True)
        for route, extra in [("/v1/completions", {"prompt": PROMPT, "n": 2, "seed": 3,
                                                  "temperature": 1.0}),
                             ("/v1/chat/completions", {"messages": CHAT})]:  # fmt: skip
            whole = _post(srv, route, {**body, **extra}).json()
            r = _post(srv, route, {**body, **extra, "stream": True}, stream=True)
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line[6:7] == b"{"]
            for c in whole["choices"]:
                mine = [k for k in chunks if k["choices"][0]["index"] == c["index"]]
                got = [t for k in mine for t in k["choices"][0].get("token_ids") or []]
                assert got == c["token_ids"], route
                if route == "/v1/completions":
                    prompts = [k["choices"][0].get("prompt_token_ids") for k in mine]
                    assert prompts == [c["prompt_token_ids"]] + [None] * (len(mine) - 1)
            if route == "/v1/chat/completions":
                prompts = [k.get("prompt_token_ids") for k in chunks]
                assert prompts == [whole["prompt_token_ids"]] + [None] * (len(chunks) - 1)

    def test_kv_transfer_prompt_token_ids_are_the_prompt(self, served):
        """vLLM's decode-side reuse: the ids a prefill stage tokenized are the prompt, verbatim,
        whatever the messages; streamed or not; refused by the batched chat, as vLLM's."""
        _, srv, _ = served
        body = dict(model="tiny", max_tokens=6, temperature=0, return_token_ids=True)
        first = _post(srv, "/v1/chat/completions", {**body, "messages": CHAT}).json()
        ids = first["prompt_token_ids"]
        reuse = {**body, "messages": [{"role": "user", "content": "unrelated"}]}
        reuse["kv_transfer_params"] = {"prompt_token_ids": ids}
        again = _post(srv, "/v1/chat/completions", reuse).json()
        assert again["prompt_token_ids"] == ids
        assert again["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]
        assert again["choices"][0]["message"] == first["choices"][0]["message"]
        streamed = _post(srv, "/v1/chat/completions", {**reuse, "stream": True}, stream=True)
        chunks = [json.loads(line[6:]) for line in streamed.iter_lines() if line[6:7] == b"{"]
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
        assert text == first["choices"][0]["message"]["content"]
        for bad, word in [({"prompt_token_ids": [10**7]}, "out of vocabulary"),
                          ({"do_remote_prefill": True}, "only prompt_token_ids")]:  # fmt: skip
            r = _post(srv, "/v1/chat/completions", {**reuse, "kv_transfer_params": bad})
            assert r.status_code == 400 and word in r.json()["error"]["message"]
        batch = {**reuse, "messages": [CHAT, CHAT]}
        r = _post(srv, "/v1/chat/completions/batch", batch)
        assert r.json()["error"]["param"] == "kv_transfer_params.prompt_token_ids"


class TestTokenControls:
    def test_refused_without_the_continuous_batch(self, served):
        _, srv, _ = served  # no slot engine here: the batch-at-a-time batcher cannot apply them
        body = {"model": "tiny", "prompt": [5], "max_tokens": 2, "logit_bias": {"5": 1.0}}
        r = _post(srv, "/v1/completions", body)
        assert r.status_code == 400 and "continuous batch" in r.json()["error"]["message"]


class TestHTTPRules:
    def test_refused_bodies_and_methods(self, served):
        _, srv, _ = served
        body = json.dumps({"model": "tiny", "prompt": "x", "max_tokens": 1})
        for ctype in ("text/plain", "application/x-www-form-urlencoded"):
            r = requests.post(
                f"{srv.url}/v1/completions", data=body, headers={"Content-Type": ctype}, timeout=10
            )
            assert r.status_code == 400 and "application/json" in r.json()["error"]["message"]
        r = requests.get(f"{srv.url}/v1/completions", timeout=10)
        assert r.status_code == 405 and r.headers["Allow"] == "POST"
        r = _post(srv, "/v1/completions", {"model": "tiny", "prompt": "x \ud83d y"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
        for seed, status in [(2**63, 400), (2**64 - 1, 400), (2**63 - 1, 200), (-(2**63), 200)]:
            r = _post(srv, "/v1/completions", {"model": "tiny", "prompt": [5], "seed": seed})
            assert r.status_code == status, (seed, r.text)

    def test_a_reset_keep_alive_connection_prints_no_traceback(self, served, capfd):
        _, srv, _ = served
        host, port = srv.url.removeprefix("http://").split(":")
        for requests_sent in (1, 50):  # waiting for the next request; writing replies
            sock = socket.create_connection((host, int(port)))
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n" * requests_sent)
            assert sock.recv(4096).startswith(b"HTTP/1.1 200")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.close()  # an RST, not a FIN
            time.sleep(0.5)
        assert requests.get(f"{srv.url}/health", timeout=10).status_code == 200
        err = capfd.readouterr().err
        assert "Traceback" not in err and "ConnectionResetError" not in err
