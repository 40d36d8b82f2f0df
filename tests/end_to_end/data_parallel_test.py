"""Data-parallel runs on two CPU devices (one per core) give the single-device results.

The MMR kernel with its groups sharded over the devices, the sampler with its prompts sharded
(`mesh=`), and the trainer's engine choice. Runs in a subprocess: the CPU device count must be set
before jax initialises.
"""

from __future__ import annotations

import textwrap

from support import testing

_SCRIPT = textwrap.dedent(
    """
    import sys
    import jax, numpy as np
    from mmr_jax.models import sharding

    assert sharding.use_cpu_cores_as_devices(2) == 2
    assert jax.device_count() == 2, jax.devices()
    import jax.numpy as jnp
    from mmr_jax.training import engines
    from mmr_jax.algorithms import mmr
    from mmr_jax import models
    from mmr_jax.rollout import base, sampler

    mesh = sharding.data_parallel_mesh()
    assert sharding.batch_size(mesh) == 2

    # MMR: 6 groups with ties and a zero embedding, split 3 + 3 over the devices.
    rng = np.random.default_rng(0)
    r = np.round(rng.random((6, 5)), 1).astype(np.float32)
    e = rng.normal(size=(6, 5, 8)).astype(np.float32)
    e[2, 1] = 0.0
    f = jax.jit(mmr.mmr_reweight)
    want = np.asarray(f(jnp.asarray(r), jnp.asarray(e)))
    out = f(*(jax.device_put(x, sharding.batch_sharding(mesh)) for x in (r, e)))
    assert sorted(s.data.shape for s in out.addressable_shards) == [(3, 5), (3, 5)]
    np.testing.assert_array_equal(np.asarray(out), want)

    # Sampler: 3 prompts of different lengths (padded to 4 rows of prompts, 2 per device).
    model = models.from_pretrained(sys.argv[1])
    prompts = [[5, 6, 7, 8, 9], [11, 12], [20, 21, 22, 23, 24, 25, 26, 27, 28]]
    seen = []
    generate = sampler.decode_program

    def spy(graphdef, state, kernels_t, tokens, *args, **kwargs):
        seen.append(tokens.sharding)
        return generate(graphdef, state, kernels_t, tokens, *args, **kwargs)

    sampler.decode_program = spy
    for temperature in (0.0, 0.8):
        params = base.SamplingParams(12, temperature=temperature, n=3, seed=7)
        one = sampler.sample(model, prompts, params)
        dp = sampler.sample(model, prompts, params, mesh=mesh)
        assert seen[-1].is_equivalent_to(sharding.batch_sharding(mesh), 2), seen[-1]
        assert not seen[-2].is_equivalent_to(sharding.batch_sharding(mesh), 2), seen[-2]
        np.testing.assert_array_equal(dp.tokens, one.tokens)
        np.testing.assert_array_equal(dp.mask, one.mask)
        np.testing.assert_allclose(dp.logprobs, one.logprobs, rtol=0, atol=1e-5)
        assert dp.finish_reasons == one.finish_reasons
        assert dp.tokens.shape[:2] == (3, 3)

    # The trainer samples data-parallel only on a pure data mesh (weights replicated already).
    class Cfg:
        class rollout:
            engine = "embedded"
        class batch:
            prompts, max_prompt_len, max_completion_len = 2, 16, 8
        class model:
            path, init = sys.argv[1], "pretrained"
        seed = 0

    class Policy:
        def model(self):
            return models.from_pretrained(sys.argv[1])

    class Tok:
        pad_token_id, eos_token_id = 0, 1

    engine = engines.make_engine(Cfg, Policy(), Tok, sys.argv[1], "/tmp", mesh)
    assert engine.mesh is mesh
    weight = engine.model.embed_tokens.embedding[...]
    assert weight.sharding.is_fully_replicated and len(weight.sharding.device_set) == 2
    got = engine.generate(prompts, base.SamplingParams(6, temperature=0.0, n=2))
    want = sampler.sample(models.from_pretrained(sys.argv[1]), prompts, base.SamplingParams(
        6, temperature=0.0, n=2), stop_token_ids=engine.stop_token_ids)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    fsdp = sharding.make_mesh(1, 2, 1)
    assert engines.make_engine(Cfg, Policy(), Tok, sys.argv[1], "/tmp", fsdp).mesh is None

    try:
        sharding.use_cpu_cores_as_devices(4)
    except RuntimeError:
        print("LATE_CALL_RAISES")
    print("DATA_PARALLEL_OK")
    """
)


def test_two_cpu_devices_match_one(tiny_llama_dir):
    proc = testing.run_in_fresh_jax(_SCRIPT, str(tiny_llama_dir))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "DATA_PARALLEL_OK" in proc.stdout
    assert "LATE_CALL_RAISES" in proc.stdout
