"""Chunked log-probs (`logprobs._chunked`): the same values and gradients as the whole [N, T, V]
logits at once, and a compiled gradient whose temporaries never hold those logits."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import parameterized
from flax import nnx

from mmr_jax.models import config as config_lib
from mmr_jax.models import decoder, logprobs

jax.config.update("jax_numpy_rank_promotion", "raise")

B, N_PER, P, T = 2, 2, 5, 21  # 20 predicted positions a row: chunks of 8 leave a tail of 4


def _model(vocab=97):
    cfg = config_lib.ModelConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
    )
    return decoder.Decoder(cfg, rngs=nnx.Rngs(0))


def _batch(vocab=97, t=T, n_per=N_PER):
    rng = np.random.default_rng(0)
    prompt = jnp.asarray(rng.integers(0, vocab, (B, P)), jnp.int32)
    pmask = jnp.asarray(np.arange(P)[None] >= np.array([2, 0])[:, None])
    tokens = jnp.asarray(rng.integers(0, vocab, (B * n_per, t)), jnp.int32)
    lengths = np.resize(np.array([t, 9, 3, t - 2]), B * n_per)
    mask = jnp.asarray(np.arange(t)[None] < lengths[:, None])
    return prompt, pmask, tokens, mask


def _loss(model, batch, chunk):
    lp, ent = logprobs.shared_prompt_logprobs(
        model, *batch, chunk_size=chunk, return_entropy=True, temperature=0.7
    )
    return lp.sum() + 0.1 * ent.sum(), (lp, ent)


class ChunkedTest(parameterized.TestCase):
    @parameterized.parameters(4, 8, 19)  # dividing the 20 positions, a tail of 4, a tail of 1
    def test_values_and_grads_equal_unchunked(self, chunk):
        model, batch = _model(), _batch()
        grad = nnx.jit(nnx.grad(_loss, has_aux=True), static_argnums=2)
        g_full, (lp_full, ent_full) = grad(model, batch, None)
        g_chunk, (lp_chunk, ent_chunk) = grad(model, batch, chunk)
        # fp32 throughout: the same sums, the LM head's per chunk (1e-6 of values ~1..10)
        np.testing.assert_allclose(lp_chunk, lp_full, atol=1e-5)
        np.testing.assert_allclose(ent_chunk, ent_full, atol=1e-5)
        self.assertTrue(np.all(np.asarray(lp_full)[~np.asarray(batch[3])] == 0))
        for a, b in zip(jax.tree.leaves(g_full), jax.tree.leaves(g_chunk), strict=True):
            np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4)

    def test_equals_log_softmax_of_the_full_rows(self):
        """Independent reference: log_softmax of the full rows [prompt, completion] logits."""
        model, (prompt, pmask, tokens, mask) = _model(), _batch()
        lp = logprobs.shared_prompt_logprobs(model, prompt, pmask, tokens, mask, chunk_size=8)
        rows = jnp.concatenate([jnp.repeat(prompt, N_PER, 0), tokens], axis=1)
        rmask = jnp.concatenate([jnp.repeat(pmask, N_PER, 0), mask], axis=1)
        logits = model(rows, attention_mask_NxT=rmask)[:, P - 1 : -1]
        ref = jnp.take_along_axis(jax.nn.log_softmax(logits, -1), tokens[..., None], -1)[..., 0]
        np.testing.assert_allclose(lp, jnp.where(mask, ref, 0.0), atol=1e-5)

    def test_compiled_temporaries_below_the_whole_logits(self):
        """The LM head and log-softmax over given hidden states [N, T, E]: the gradient's
        compiled temporaries stay below half of one fp32 [N, T, V] logits tensor when chunked,
        and exceed it whole (so the bound tests something)."""
        vocab, rows, t, chunk = 4096, 16, 256, 8
        model = _model(vocab)
        graphdef, state = nnx.split(model)
        h = jax.random.normal(jax.random.key(0), (rows, t, 32))
        targets = jax.random.randint(jax.random.key(1), (rows, t), 0, vocab)
        logits_bytes = rows * t * vocab * 4

        def temp_bytes(chunk):
            def loss(state, h):
                m = nnx.merge(graphdef, state)
                if chunk is None:
                    out = logprobs._scores(m.logits_from_hidden(h), targets, 0.7, True)
                else:
                    out = logprobs._chunked(m, h, targets, chunk, 0.7, True)
                return out[0].sum() + 0.1 * out[1].sum()

            compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(state, h).compile()
            return compiled.memory_analysis().temp_size_in_bytes

        whole, chunked = temp_bytes(None), temp_bytes(chunk)
        self.assertGreater(whole, logits_bytes)
        self.assertLess(chunked, logits_bytes // 2)
