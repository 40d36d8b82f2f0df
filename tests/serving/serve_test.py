"""The vLLM client and weight sync over real HTTP against the OpenAI-compatible server on a real
(tiny) model. This proves the protocol, the file formats (HF safetensors, PEFT adapters) and the
sampler behind the server; it does not run vLLM (see the gpu test in vllm_client_test.py)."""

import jax
import numpy as np
import pytest
import requests
from flax import nnx

from mmr_jax.rollout import base, sampler, vllm_client, vllm_engine
from mmr_jax.serving import embedded_backend, server

EOS = 2
PROMPTS = [[5, 17, 33, 9, 100], [7, 8], list(range(40, 61))]
GREEDY = base.SamplingParams(max_new_tokens=16, temperature=0.0, n=2)


@pytest.fixture(scope="module")
def served(tiny_llama_dir):
    backend = embedded_backend.EmbeddedBackend.from_pretrained(tiny_llama_dir, model_name="tiny")
    with server.OpenAIServer(backend, weights_dir="/") as srv:  # tmp_path varies per test
        yield backend, srv


@pytest.fixture
def engine(served, tmp_path):
    backend, srv = served
    client = vllm_client.VllmClient(srv.url, timeout_s=120, max_retries=1, backoff_s=0.01)
    return vllm_engine.VllmEngine(
        client, model="tiny", sync_dir=tmp_path / "sync", eos_token_ids=(EOS,), pad_id=3
    )


def _greedy(model, prompts=PROMPTS, params=GREEDY):
    return sampler.sample(model, prompts, params, stop_token_ids=(EOS,), pad_id=3)


def _assert_same(a: base.RolloutBatch, b: base.RolloutBatch):
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.mask, b.mask)
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
    assert a.finish_reasons == b.finish_reasons


def _randomise_lora(model, scale=0.3):
    for i, (path, var) in enumerate(nnx.to_flat_state(nnx.state(model, nnx.LoRAParam))):
        if path[-1] == "lora_b":
            var.set_value(scale * jax.random.normal(jax.random.key(i), var.get_value().shape))


class TestServe:
    def test_client_over_http_equals_the_sampler(self, served, engine, tiny_llama_dir):
        from mmr_jax import models

        _assert_same(
            engine.generate(PROMPTS, GREEDY), _greedy(models.from_pretrained(tiny_llama_dir))
        )

    def test_text_prompt_logprobs_and_models(self, served):
        backend, srv = served
        reply = requests.post(
            f"{srv.url}/v1/completions",
            json={
                "model": "tiny",
                "prompt": ["What is 2 + 2?", "Hello"],
                "n": 2,
                "max_tokens": 5,
                "temperature": 0.8,
                "seed": 4,
                "logprobs": 1,
                "return_token_ids": True,
            },
            timeout=60,
        ).json()
        assert [c["index"] for c in reply["choices"]] == [0, 1, 2, 3]
        c = reply["choices"][2]
        assert c["prompt_token_ids"] == backend.encode("Hello")
        assert len(c["logprobs"]["token_logprobs"]) == len(c["token_ids"]) <= 5
        assert all(x <= 0 for x in c["logprobs"]["token_logprobs"])
        assert isinstance(c["text"], str) and c["finish_reason"] in ("stop", "length")
        models = requests.get(f"{srv.url}/v1/models", timeout=10).json()["data"]
        assert models[0]["id"] == "tiny" and models[0]["max_model_len"] == 512
        assert requests.get(f"{srv.url}/health", timeout=10).status_code == 200

    def test_too_long_request_is_a_400(self, served):
        _, srv = served
        r = requests.post(
            f"{srv.url}/v1/completions",
            json={"model": "tiny", "prompt": [1] * 500, "max_tokens": 100},
            timeout=10,
        )
        assert r.status_code == 400 and "maximum context length" in r.json()["error"]["message"]


class TestFullWeightSync:
    def test_reload_from_a_safetensors_folder(self, engine, tiny_llama_dir, tmp_path):
        from mmr_jax import models

        from support import testing

        other = testing.make_tiny_checkpoint(tmp_path / "other", seed=1)
        try:
            engine.load_weights_dir(other, version=1)
            _assert_same(engine.generate(PROMPTS, GREEDY), _greedy(models.from_pretrained(other)))
        finally:
            engine.load_weights_dir(tiny_llama_dir, version=2)

    def test_sync_weights_exports_and_reloads(self, engine, tiny_llama_dir, tmp_path):
        from mmr_jax import models

        from support import testing

        policy = models.from_pretrained(testing.make_tiny_checkpoint(tmp_path / "p", seed=2))
        try:
            engine.sync_weights(policy, version=1)
            _assert_same(engine.generate(PROMPTS, GREEDY), _greedy(policy))
            assert (engine.sync_dir / "weights-v1").exists()
        finally:
            engine.load_weights_dir(tiny_llama_dir, version=2)


class TestLoraSync:
    def test_peft_adapter_matches_transformers_peft(self, engine, tiny_llama_dir, tmp_path):
        """An adapter written by the `peft` library: the server's greedy output equals peft's."""
        peft = pytest.importorskip("peft")
        import torch
        import transformers

        hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        pm = peft.get_peft_model(
            hf, peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0)
        )
        torch.manual_seed(0)
        with torch.no_grad():
            for name, p in pm.named_parameters():
                if "lora_B" in name:
                    p.normal_(0.0, 0.3)
        pm.save_pretrained(tmp_path / "adapter")
        engine.lora = True
        engine.load_adapter_dir(tmp_path / "adapter", version=1)
        batch = engine.generate(PROMPTS, base.SamplingParams(max_new_tokens=12, temperature=0.0))
        with torch.no_grad():
            for b, prompt in enumerate(PROMPTS):
                out = pm.generate(
                    torch.tensor([prompt]),
                    max_new_tokens=12,
                    do_sample=False,
                    eos_token_id=EOS,
                    pad_token_id=3,
                )
                assert batch.completion_ids(b, 0) == out[0, len(prompt) :].tolist()
        engine.load_adapter_dir(tmp_path / "adapter", version=2)  # New name, old one unloaded.
        assert engine.client.models() == ["tiny", "policy-v2"]
        engine.client.unload_lora_adapter("policy-v2")

    def test_sync_weights_lora_equals_trainer_model(self, engine, tiny_llama_dir):
        from mmr_jax import models
        from mmr_jax.models import lora

        policy = models.from_pretrained(tiny_llama_dir, lora=lora.LoraConfig(rank=4, alpha=8.0))
        _randomise_lora(policy)
        engine.lora = True
        engine.sync_weights(policy, version=1)
        _assert_same(engine.generate(PROMPTS, GREEDY), _greedy(policy))
        engine.client.unload_lora_adapter(engine.model)


class TestServeScript:
    def test_script_serves_then_reloads_weights(self, tiny_llama_dir, tmp_path):
        """`scripts/serve.py` itself, in its own process: greedy output over HTTP equals the
        sampler's, before and after a full-weight sync to another checkpoint; then SIGTERM (what
        `kill`, systemd and container runtimes send) stops it with exit status 0, as Ctrl-C
        does, not 143. (One server start for both: a start of the script is most of the cost.)"""
        import pathlib
        import subprocess
        import sys

        from mmr_jax import models

        from support import testing

        script = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "serve.py"
        argv = [sys.executable, str(script), f"--model={tiny_llama_dir}", "--port=0"]
        argv += ["--served_model_name=tiny", f"--weights_dir={tmp_path}"]
        err = (tmp_path / "stderr.txt").open("w")
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, text=True)
        try:
            line = proc.stdout.readline()  # "serving 'tiny' at http://127.0.0.1:PORT"
            assert line.startswith("serving 'tiny' at http://"), line
            client = vllm_client.VllmClient(line.split()[-1], timeout_s=120, max_retries=1)
            client.wait_until_ready(timeout_s=60, poll_s=0.2)
            engine = vllm_engine.VllmEngine(
                client, model="tiny", sync_dir=tmp_path / "sync", eos_token_ids=(EOS,), pad_id=3
            )
            _assert_same(
                engine.generate(PROMPTS, GREEDY), _greedy(models.from_pretrained(tiny_llama_dir))
            )
            other = testing.make_tiny_checkpoint(tmp_path / "other", seed=7)
            engine.load_weights_dir(other, version=1)
            _assert_same(engine.generate(PROMPTS, GREEDY), _greedy(models.from_pretrained(other)))
            _check_openai_chat(line.split()[-1])
            proc.terminate()
            assert proc.wait(timeout=120) == 0, (tmp_path / "stderr.txt").read_text()[-3000:]
        finally:
            proc.kill()
            proc.wait(timeout=30)
            err.close()


def _check_openai_chat(url):
    """The official `openai` client against the script: chat streamed equals chat not streamed."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    kw = dict(model="tiny", messages=messages, max_tokens=8, temperature=0)
    whole = client.chat.completions.create(**kw)
    chunks = list(
        client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw)
    )
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == whole.choices[0].message.content and chunks[-1].usage == whole.usage
    assert whole.usage.completion_tokens in range(1, 9)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="nope", messages=messages)
