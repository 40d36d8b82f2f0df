"""The official `openai` client against our server on a real (tiny, random) model: models,
completions and chat completions, streamed and not, with log-probs, usage and errors.

Independent references: the sampler called directly (greedy ids), the tokenizer's own chat template,
a teacher-forced transformers forward pass for the top log-probs, and the non-streamed reply for
the streamed one under the same seed."""

import numpy as np
import pytest
import requests

from mmr_jax.rollout import base, sampler
from mmr_jax.serving import embedded_backend, server

openai = pytest.importorskip("openai")

QUESTION = [
    {"role": "system", "content": "You are a careful solver."},
    {"role": "user", "content": "What is 12 + 35?"},
]


@pytest.fixture(scope="module")
def served(tiny_llama_dir):
    backend = embedded_backend.EmbeddedBackend.from_pretrained(tiny_llama_dir, model_name="tiny")
    with server.OpenAIServer(backend) as srv:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0)
        yield backend, srv, client


def _greedy_ids(backend, prompt, max_tokens):
    """The sampler's own greedy completion (ids, log-probs, finish reason) of `prompt`."""
    batch = sampler.sample(
        backend.engine.model,
        [prompt],
        base.SamplingParams(max_new_tokens=max_tokens, temperature=0.0),
        stop_token_ids=backend.eos_token_ids,
        pad_id=backend.engine.pad_id,
    )
    ids = batch.completion_ids(0, 0)
    return ids, batch.logprobs[0, 0, : len(ids)].tolist(), batch.finish_reasons[0][0]


def _stream(client_call, **kw):
    chunks = list(client_call(stream=True, **kw))
    assert chunks, "empty stream"
    return chunks


class TestModels:
    def test_list(self, served):
        _, _, client = served
        assert [m.id for m in client.models.list().data] == ["tiny"]


class TestCompletions:
    def test_greedy_equals_the_sampler_and_usage_counts_tokens(self, served):
        backend, _, client = served
        prompt = "What is 2 + 3?"
        reply = client.completions.create(
            model="tiny", prompt=prompt, max_tokens=12, temperature=0, logprobs=0
        )
        ids, logps, reason = _greedy_ids(backend, backend.encode(prompt), 12)
        c = reply.choices[0]
        text_ids = ids[:-1] if reason == "stop" else ids
        assert c.text == backend.decode(text_ids) and c.finish_reason == reason
        np.testing.assert_allclose(c.logprobs.token_logprobs, logps, atol=1e-5)
        assert reply.usage.prompt_tokens == len(backend.encode(prompt))
        assert reply.usage.completion_tokens == len(ids) == len(c.logprobs.tokens)
        assert reply.usage.total_tokens == reply.usage.prompt_tokens + len(ids)

    def test_stream_equals_non_stream_under_a_seed(self, served):
        _, _, client = served
        kw = dict(
            model="tiny",
            prompt=["Solve for x:", "The quick brown"],
            n=2,
            max_tokens=10,
            temperature=1.0,
            seed=5,
            logprobs=2,
        )
        whole = client.completions.create(**kw)
        chunks = _stream(client.completions.create, stream_options={"include_usage": True}, **kw)
        assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
        assert all(ch.usage is None for ch in chunks[:-1])
        for c in whole.choices:
            mine = [ch.choices[0] for ch in chunks[:-1] if ch.choices[0].index == c.index]
            assert "".join(m.text for m in mine) == c.text
            assert mine[-1].finish_reason == c.finish_reason
            streamed = [m.logprobs for m in mine if m.logprobs is not None]
            assert sum((lp.tokens for lp in streamed), []) == c.logprobs.tokens
            assert sum((lp.token_logprobs for lp in streamed), []) == c.logprobs.token_logprobs
            assert [lp.top_logprobs[0] for lp in streamed] == c.logprobs.top_logprobs
        assert sum(len(c.logprobs.tokens) for c in whole.choices) == whole.usage.completion_tokens
        assert len({c.text for c in whole.choices}) > 1  # sampled, not four equal answers

    def test_stop_string_cuts_the_text(self, served):
        _, _, client = served
        kw = dict(model="tiny", prompt="The quick brown", max_tokens=24, temperature=0)
        full = client.completions.create(**kw).choices[0].text
        assert len(full) >= 6, full
        stop = full[len(full) // 2 : len(full) // 2 + 2]
        cut = client.completions.create(stop=[stop], **kw).choices[0]
        assert cut.text == full[: full.find(stop)] and cut.finish_reason == "stop"
        assert cut.model_extra["stop_reason"] == stop
        chunks = _stream(client.completions.create, stop=stop, **kw)
        assert "".join(ch.choices[0].text for ch in chunks) == cut.text
        kept = client.completions.create(
            stop=[stop], extra_body={"include_stop_str_in_output": True}, **kw
        )
        assert kept.choices[0].text == full[: full.find(stop) + len(stop)]


class TestChatCompletions:
    def test_prompt_is_the_chat_template_and_greedy_equals_the_sampler(self, served):
        backend, _, client = served
        reply = client.chat.completions.create(
            model="tiny", messages=QUESTION, max_tokens=10, temperature=0, logprobs=True,
            top_logprobs=3,
        )  # fmt: skip
        text = backend.tokenizer.apply_chat_template(
            QUESTION, tokenize=False, add_generation_prompt=True
        )
        assert text.endswith("<|im_start|>assistant\n")
        prompt = backend.tokenizer.encode(text, add_special_tokens=False)
        ids, logps, reason = _greedy_ids(backend, prompt, 10)
        c = reply.choices[0]
        assert c.message.role == "assistant" and c.finish_reason == reason
        assert c.message.content == backend.decode(ids[:-1] if reason == "stop" else ids)
        assert reply.usage.prompt_tokens == len(prompt)
        assert reply.usage.completion_tokens == len(ids) == len(c.logprobs.content)
        # A token's text is its own decode, but "" for a byte-level token that ends inside a
        # character, and the character for the one that completes it (as vLLM's): they join
        # to the reply's text, but for bytes that never complete a character (U+FFFD there).
        texts = [e.token for e in c.logprobs.content]
        joined = "".join(texts[: len(ids) - (reason == "stop")])
        assert joined == c.message.content.replace("\ufffd", "")
        for entry, lp, tid in zip(c.logprobs.content, logps, ids, strict=True):
            alone = backend.tokenizer.decode([tid])
            assert entry.token == alone or alone.endswith("\ufffd")
            assert entry.bytes == list(entry.token.encode("utf-8"))
            assert entry.logprob == pytest.approx(lp, abs=1e-5)
            tops = [t.logprob for t in entry.top_logprobs]
            assert len(tops) == 3 and tops == sorted(tops, reverse=True)
            # Greedy: the sampled token is the most likely one, by an independent forward pass.
            assert entry.top_logprobs[0].token == entry.token
            assert tops[0] == pytest.approx(lp, abs=1e-4)

    def test_top_logprobs_equal_transformers(self, served, tiny_llama_dir):
        """Chat equals /v1/completions on the templated prompt ids (same seed), and its k
        alternatives at each position equal transformers' on the same weights."""
        import torch
        import transformers

        backend, _, client = served
        kw = dict(model="tiny", max_tokens=6, temperature=0.7, seed=3)
        reply = client.chat.completions.create(
            messages=QUESTION, logprobs=True, top_logprobs=4, **kw
        )
        prompt = backend.chat_prompt(QUESTION)
        plain = client.completions.create(
            prompt=prompt, logprobs=0, extra_body={"return_token_ids": True}, **kw
        ).choices[0]
        ids = plain.model_extra["token_ids"]
        content = reply.choices[0].logprobs.content
        assert reply.choices[0].message.content == plain.text
        assert [e.token for e in content] == plain.logprobs.tokens
        hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1] / 0.7
        ref = torch.log_softmax(logits, -1).topk(4)
        for t, entry in enumerate(content):
            want = [backend.tokenizer.decode([i]) for i in ref.indices[t].tolist()]
            assert [x.token for x in entry.top_logprobs] == want
            got = [x.logprob for x in entry.top_logprobs]
            np.testing.assert_allclose(got, ref.values[t].numpy(), atol=1e-4)

    def test_stream_equals_non_stream_under_a_seed(self, served):
        _, _, client = served
        kw = dict(
            model="tiny", messages=QUESTION, n=2, max_tokens=8, temperature=1.0, seed=11,
            logprobs=True, top_logprobs=2,
        )  # fmt: skip
        whole = client.chat.completions.create(**kw)
        chunks = _stream(
            client.chat.completions.create, stream_options={"include_usage": True}, **kw
        )
        assert all(ch.object == "chat.completion.chunk" for ch in chunks)
        assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
        for c in whole.choices:
            mine = [ch.choices[0] for ch in chunks[:-1] if ch.choices[0].index == c.index]
            assert mine[0].delta.role == "assistant"
            assert "".join(m.delta.content or "" for m in mine) == c.message.content
            assert mine[-1].finish_reason == c.finish_reason
            streamed = sum((m.logprobs.content for m in mine if m.logprobs), [])
            assert streamed == c.logprobs.content
        assert whole.usage.completion_tokens == sum(len(c.logprobs.content) for c in whole.choices)

    def test_stream_without_usage_has_no_usage_chunk(self, served):
        _, _, client = served
        chunks = _stream(
            client.chat.completions.create, model="tiny", messages=QUESTION, max_tokens=3
        )
        assert all(ch.choices and ch.usage is None for ch in chunks)


class TestErrors:
    def test_unknown_model_is_not_found(self, served):
        _, _, client = served
        with pytest.raises(openai.NotFoundError, match="`nope` does not exist") as e:
            client.chat.completions.create(model="nope", messages=QUESTION)
        assert e.value.status_code == 404 and e.value.code == "model_not_found"
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="nope", prompt="x", stream=True)

    def test_prompt_over_the_context_is_a_bad_request(self, served):
        _, _, client = served
        with pytest.raises(openai.BadRequestError, match="maximum context length is 512") as e:
            client.completions.create(model="tiny", prompt=[5] * 500, max_tokens=20)
        assert e.value.code == "context_length_exceeded"
        long = [{"role": "user", "content": "What is 12 + 35? " * 200}]
        with pytest.raises(openai.BadRequestError, match="maximum context length") as e:
            client.chat.completions.create(model="tiny", messages=long, stream=True)
        assert e.value.param == "messages"

    @pytest.mark.parametrize(
        "kw,match",
        [
            (dict(top_logprobs=3), "top_logprobs requires logprobs"),
            (dict(temperature=-0.5), "temperature must be >= 0"),
            (dict(tools=[{"type": "function", "function": {"name": "f"}}]), "tools"),
            (dict(n=0), "n must be >= 1"),
        ],
    )
    def test_bad_parameters_are_bad_requests(self, served, kw, match):
        _, _, client = served
        with pytest.raises(openai.BadRequestError, match=match):
            client.chat.completions.create(model="tiny", messages=QUESTION, max_tokens=2, **kw)

    def test_malformed_json_and_unknown_route(self, served):
        _, srv, _ = served
        r = requests.post(f"{srv.url}/v1/chat/completions", data=b"{not json", timeout=10)
        assert r.status_code == 400
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
        assert "could not parse the JSON body" in r.json()["error"]["message"]
        r = requests.post(f"{srv.url}/v1/embeddings", json={}, timeout=10)
        assert r.status_code == 404 and r.json()["error"]["type"] == "invalid_request_error"


class TestServing:
    def test_waiting_requests_are_batched_together(self, served):
        import concurrent.futures

        _, srv, client = served
        before = len(srv.batcher.batches)

        def ask(i):
            kw = dict(model="tiny", prompt=[5, 6, 7 + i], max_tokens=8, temperature=0.7)
            return client.completions.create(**kw).choices[0].text

        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            list(pool.map(ask, range(6)))
        batches = srv.batcher.batches[before:]
        assert sum(batches) == 6 and max(batches) > 1, batches  # later ones waited together

    def test_weight_routes_off_by_default_and_inside_their_folder(self, served, tmp_path):
        backend, srv, _ = served
        r = requests.post(f"{srv.url}/v1/load_lora_adapter", json={"lora_name": "a"}, timeout=10)
        assert r.status_code == 404
        allowed, secret = tmp_path / "allowed", tmp_path / "secret"
        (allowed / "broken").mkdir(parents=True)
        secret.mkdir()
        (secret / "adapter_config.json").write_text("{}")
        with server.OpenAIServer(backend, weights_dir=allowed) as on:

            def load(path):
                body = {"lora_name": "x", "lora_path": str(path)}
                r = requests.post(f"{on.url}/v1/load_lora_adapter", json=body, timeout=10)
                return r.status_code, r.json()["error"]["message"].replace(str(path), "P")

            outside = [load(secret), load(tmp_path / "missing"), load(allowed / ".." / "secret")]
            assert outside[0][0] == 400 and "must lie inside" in outside[0][1]
            assert outside == [outside[0]] * 3  # the same answer whether the path exists or not
            inside = [load(allowed / "broken"), load(allowed / "missing")]
            assert (
                inside == [(400, "could not load a LoRA adapter from 'P' (see the server log)")] * 2
            )
            body = {"method": "reload_weights", "kwargs": {"weights_path": str(secret)}}
            r = requests.post(f"{on.url}/collective_rpc", json=body, timeout=10)
            assert r.status_code == 400 and "must lie inside" in r.json()["error"]["message"]
