"""Packed prefill of the embedded sampler: segment masks and prompt-cache parity."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mmr_jax.models import kv_cache
from mmr_jax.rollout import base, padding, prefill, sampler

jax.config.update("jax_numpy_rank_promotion", "raise")


class TestSegmentIds:
    @pytest.mark.parametrize("split", [False, True])
    @pytest.mark.parametrize("write_index", [0, 3])
    def test_packed_sequences_match_each_alone(self, llama, split, write_index):
        rng = np.random.default_rng(1)
        seqs = [rng.integers(4, 400, size=5), rng.integers(4, 400, size=7)]
        width = 14  # a, b, then 2 padding slots
        tokens = np.zeros((1, width), np.int32)
        positions = np.zeros((1, width), np.int32)
        segments = np.full((1, write_index + width + 2), -1, np.int32)
        start = 0
        for i, seq in enumerate(seqs):
            tokens[0, start : start + len(seq)] = seq
            positions[0, start : start + len(seq)] = np.arange(len(seq))
            segments[0, write_index + start : write_index + start + len(seq)] = i
            start += len(seq)
        cache = llama.init_cache(1, segments.shape[1])
        cache = kv_cache.split(cache) if split else cache
        logits, _ = llama.forward_cached(
            jnp.asarray(tokens),
            jnp.asarray(positions),
            cache,
            write_index=jnp.int32(write_index),
            kv_mask_NxS=jnp.asarray(segments >= 0),
            segment_ids_NxS=jnp.asarray(segments),
        )
        assert np.isfinite(np.asarray(logits)).all()
        start = 0
        for seq in seqs:
            n = len(seq)
            alone, _ = llama.forward_cached(
                jnp.asarray(seq[None], jnp.int32),
                jnp.arange(n, dtype=jnp.int32)[None],
                llama.init_cache(1, n),
                write_index=0,
                kv_mask_NxS=jnp.ones((1, n), bool),
            )
            np.testing.assert_allclose(logits[0, start : start + n], alone[0], atol=1e-5, rtol=1e-5)
            start += n


def _left_padded_prompt_cache(model, prompts, bp, p):
    """The reference: the prefill as `sampler.decode_program` ran it before packing, over
    [Bp, P - 1]."""
    tokens, mask = padding.left_pad(prompts, bp, p, 0)
    positions = np.maximum(np.cumsum(mask, axis=-1) - 1, 0).astype(np.int32)
    graphdef, state = nnx.split(model)

    @jax.jit
    def run(state, tokens, positions, mask):
        model = nnx.merge(graphdef, state)
        cache = kv_cache.split(model.init_cache(bp, p))
        _, cache = model.forward_cached(
            tokens[:, :-1], positions[:, :-1], cache, write_index=0, kv_mask_NxS=mask
        )
        return cache

    cache = run(state, jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(mask))
    mask[:, -1] = False  # slot P - 1 is the first decode input, not in the prompt cache
    return cache, mask


class TestPackedPrefill:
    @pytest.mark.parametrize("family", ["llama", "qwen2"])
    def test_prompt_cache_matches_left_padded_prefill(self, family, request):
        model = request.getfixturevalue(family)
        rng = np.random.default_rng(2)
        # P = length_bucket(24, 16) = 24: the first prompt fills all P slots (a whole packed row).
        lengths = [24, 1, 5, 13, 2, 19, 7]
        prompts = [rng.integers(4, 400, size=n).tolist() for n in lengths]
        # Ids past the vocabulary embed as NaN (jnp.take fills), and a NaN in a packed row is not
        # one in a left-padded row: that, not the packing, failed here with a 387-token tiny
        # tokenizer (trained without the data folder, before tests/support/tiny_bpe.json).
        config = json.loads(
            (request.getfixturevalue(f"tiny_{family}_dir") / "config.json").read_text()
        )
        assert max(map(max, prompts)) < config["vocab_size"], config["vocab_size"]
        bp, p = padding.bucket(len(prompts)), padding.length_bucket(max(lengths), 16)
        assert (bp, p) == (8, 24)
        packed = padding.pack_prefill(prompts, bp, p, pad_id=0)
        assert packed.tokens.shape == (4, 23)  # 23 | 18 + 4 + 1 | 12 + 6 -> 3 rows -> 4
        graphdef, state = nnx.split(model)
        got = prefill.prefill(
            graphdef,
            state,
            *(jnp.asarray(x) for x in (packed.tokens, packed.positions, packed.segment_ids)),
            jnp.asarray(packed.gather),
        )
        want, mask = _left_padded_prompt_cache(model, prompts, bp, p)
        assert mask.sum() == sum(n - 1 for n in lengths)
        for layer in range(len(want.k)):
            k_got, k_want = np.asarray(got.k[layer]), np.asarray(want.k[layer])
            v_got, v_want = np.asarray(got.v[layer]), np.asarray(want.v[layer])
            assert k_got.shape == k_want.shape and v_got.shape == v_want.shape
            b, s = np.nonzero(mask)
            np.testing.assert_allclose(k_got[b, :, :, s], k_want[b, :, :, s], atol=1e-5, rtol=1e-5)
            np.testing.assert_allclose(v_got[b, :, s, :], v_want[b, :, s, :], atol=1e-5, rtol=1e-5)

    def test_new_row_count_recompiles_only_the_prefill(self, llama):
        params = base.SamplingParams(max_new_tokens=4, temperature=0.0, n=2)
        one_row = [list(range(10, 30)), [1, 2, 3]]  # P = 24, W = 23: 19 + 2 tokens, one row
        two_rows = [list(range(10, 30)), list(range(40, 50))]  # 19 + 9: two rows
        sampler.sample(llama, one_row, params)
        decode, prefill = sampler.trace_count(), sampler.prefill_trace_count()
        batch = sampler.sample(llama, two_rows, params)
        assert sampler.trace_count() == decode
        assert sampler.prefill_trace_count() == prefill + 1
        sampler.sample(llama, [[5] * 24, [6] * 24], params)  # two rows again: no new trace
        assert sampler.prefill_trace_count() == prefill + 1
        assert batch.tokens.shape == (2, 2, 4)
