"""The decode-step benchmark's linear-layer baselines (`benchmarks/linear_floor.py`): torch and JAX
compute the same matmuls."""

import jax.numpy as jnp
import numpy as np
import pytest

from mmr_jax import models
from mmr_jax.infra import bench_harness

from support import testing

floor = bench_harness.load("bench_decode_step").linear_floor  # the module the benchmark runs


@pytest.mark.parametrize("tied", [True, False])
def test_torch_and_jax_linear_chains_agree(tmp_path, tied):
    import torch  # here: collecting this module needs no torch

    path = testing.make_tiny_checkpoint(tmp_path, tokenizer=False, tie_word_embeddings=tied)
    model = models.from_pretrained(path)
    per_layer, head = floor.layer_weights(model)
    cfg = model.config
    assert len(per_layer) == cfg.num_layers
    # [in, out] per matmul: q, k, v, o, gate, up, down; the head maps hidden -> vocab.
    kv = cfg.num_kv_heads * cfg.head_dim
    assert [w.shape[1] for w in per_layer[0][:3]] == [cfg.num_heads * cfg.head_dim, kv, kv]
    assert head.shape == (cfg.hidden_size, cfg.vocab_size)
    if tied:
        np.testing.assert_array_equal(head.T, np.asarray(model.embed_tokens.embedding[...]))

    x = np.random.default_rng(0).standard_normal((5, cfg.hidden_size)).astype(np.float32)
    got_jax = np.asarray(floor.linear_chain_jax(per_layer, head, jnp.asarray(x)))
    per_layer_t, head_t = floor.to_torch(per_layer, head)
    with torch.no_grad():
        got_torch = floor.linear_chain_torch(per_layer_t, head_t, torch.from_numpy(x)).numpy()
    assert got_jax.shape == (5, cfg.vocab_size)
    np.testing.assert_allclose(got_jax, got_torch, rtol=1e-4, atol=1e-4)
    assert np.abs(got_jax).max() > 1e-3  # the chain is not degenerate

    # The weight-major chain (the sampler's CPU form) on [out, in] copies computes the same.
    from mmr_jax.models import layers

    per_layer_oi, head_oi = floor.transpose_weights(per_layer, head)
    assert per_layer_oi[0][0].shape == per_layer[0][0].shape[::-1]
    got_t = floor.linear_chain_jax(
        per_layer_oi, head_oi, jnp.asarray(x), matmul=layers.weight_major_matmul
    )
    np.testing.assert_allclose(np.asarray(got_t), got_jax, rtol=1e-5, atol=1e-5)
