"""Embedded JAX sampler: parity with transformers, log-probs, seeds, stops, compile counts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mmr_jax.rollout import base, decode_loop, embedded, padding, sampler, sampler_weights, sampling

jax.config.update("jax_numpy_rank_promotion", "raise")

EOS = 2
PROMPTS = [[5, 17, 33, 9, 100], [7, 8], list(range(40, 61))]


def _hf_greedy(path, prompts, max_new, eos=EOS):
    import torch
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    outs = []
    with torch.no_grad():
        for prompt in prompts:
            out = hf.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=max_new,
                do_sample=False,
                eos_token_id=eos,
                pad_token_id=3,
            )
            outs.append(out[0, len(prompt) :].tolist())
    return outs


class TestSample:
    @pytest.mark.parametrize("family", ["llama", "qwen2"])
    def test_greedy_matches_transformers_generate(self, family, request):
        path = request.getfixturevalue(f"tiny_{family}_dir")
        model = request.getfixturevalue(family)
        params = base.SamplingParams(max_new_tokens=16, temperature=0.0, n=2)
        batch = sampler.sample(model, PROMPTS, params, stop_token_ids=(EOS,))
        for b, ref in enumerate(_hf_greedy(path, PROMPTS, 16)):
            assert batch.completion_ids(b, 0) == ref
            assert batch.completion_ids(b, 1) == ref

    @pytest.mark.parametrize("top_p,top_k", [(1.0, 0), (0.8, 20)])
    def test_logprobs_are_the_models_at_temperature(self, llama, top_p, top_k):
        from mmr_jax.models import logprobs

        temp = 0.7
        params = base.SamplingParams(
            max_new_tokens=16, temperature=temp, top_p=top_p, top_k=top_k, n=2, seed=1
        )
        batch = sampler.sample(llama, PROMPTS, params)
        assert batch.mask.all()  # no stop ids: every completion has the full length
        for b, prompt in enumerate(PROMPTS):
            seqs = np.stack([np.concatenate([prompt, batch.tokens[b, i]]) for i in range(2)])
            ref = logprobs.token_logprobs(
                llama, jnp.asarray(seqs), jnp.ones(seqs.shape, bool), temperature=temp
            )
            np.testing.assert_allclose(
                batch.logprobs[b], np.asarray(ref)[:, len(prompt) :], atol=2e-5, rtol=1e-5
            )

    def test_weight_major_decode_equals_plain(self, llama, monkeypatch):
        # On CPU the decode loop runs its matmuls weight-major (a transposed copy of the kernels);
        # accelerators keep x @ W. Same samples either way, log-probs equal up to rounding.
        state = jax.tree.leaves(llama)[0]
        assert sampler_weights.weight_major([state])  # these tests run on CPU
        params = base.SamplingParams(max_new_tokens=16, temperature=0.8, n=3, seed=4)
        fast = sampler.sample(llama, PROMPTS, params)
        monkeypatch.setattr(sampler_weights, "weight_major", lambda state: False)
        plain = sampler.sample(llama, PROMPTS, params)
        np.testing.assert_array_equal(fast.tokens, plain.tokens)
        np.testing.assert_allclose(fast.logprobs, plain.logprobs, atol=1e-5, rtol=1e-5)

    def test_seed_reproduces_and_ignores_padding(self, llama):
        params = base.SamplingParams(max_new_tokens=12, temperature=1.0, n=2, seed=7)
        a = sampler.sample(llama, PROMPTS, params)
        b = sampler.sample(llama, PROMPTS, params)
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_array_equal(a.logprobs, b.logprobs)
        alone = sampler.sample(llama, PROMPTS[:1], params)  # Other batch and length buckets.
        np.testing.assert_array_equal(alone.tokens[0], a.tokens[0])
        other = sampler.sample(
            llama, PROMPTS, base.SamplingParams(max_new_tokens=12, temperature=1.0, n=2, seed=8)
        )
        assert not np.array_equal(other.tokens, a.tokens)
        assert not np.array_equal(a.tokens[:, 0], a.tokens[:, 1])  # n samples differ

    def test_stop_token_and_max_tokens(self, llama):
        greedy = base.SamplingParams(max_new_tokens=10, temperature=0.0, n=2)
        free = sampler.sample(llama, PROMPTS, greedy).completion_ids(0, 0)
        stop = free[3]
        first = free.index(stop)
        params = base.SamplingParams(
            max_new_tokens=10, temperature=0.0, n=2, stop_token_ids=(stop,)
        )
        batch = sampler.sample(llama, PROMPTS, params, pad_id=3)
        assert batch.completion_ids(0, 1) == free[: first + 1]  # stop token kept
        assert batch.finish_reasons[0] == ["stop", "stop"]
        assert (batch.tokens[0, :, first + 1 :] == 3).all() and batch.lengths[0, 0] == first + 1
        short = sampler.sample(
            llama, PROMPTS, base.SamplingParams(max_new_tokens=5, temperature=0, n=2)
        )
        assert short.tokens.shape == (3, 2, 5) and short.mask.all()
        assert short.finish_reasons == [["length"] * 2] * 3

    def test_loop_exits_when_every_row_is_done(self, llama):
        # 32 new-token slots compiled; the loop must stop at max_new_tokens, and at step 1 when
        # every row's first token is a stop id.
        buckets = padding.MinSizes(min_new_tokens=32)
        greedy = base.SamplingParams(max_new_tokens=5, temperature=0.0, n=2)
        stats = decode_loop.LoopStats()
        free = sampler.sample(llama, PROMPTS, greedy, buckets=buckets, stats=stats)
        assert stats.decode_steps == 5
        firsts = tuple(sorted({int(x) for x in free.tokens[:, :, 0].ravel()}))
        params = base.SamplingParams(max_new_tokens=20, temperature=0.0, n=2, stop_token_ids=firsts)
        batch = sampler.sample(llama, PROMPTS, params, buckets=buckets, stats=stats)
        assert stats.decode_steps == 1
        assert batch.tokens.shape == (3, 2, 1) and batch.finish_reasons == [["stop"] * 2] * 3

    @pytest.mark.parametrize("greedy", [False, True])
    def test_compaction_gives_the_same_completions(self, llama, greedy):
        # Stop ids that end rows at different steps, so the loop compacts: rows still decoding
        # go on alone in a smaller loop and must produce what they would have in the full one.
        # Greedy rows of one prompt are equal, so that case takes 8 prompts x 4.
        prompts = [p[i:] + [i] for i in range(3) for p in PROMPTS][:8] if greedy else PROMPTS
        params = base.SamplingParams(
            max_new_tokens=24, temperature=0.0 if greedy else 1.0, n=4 if greedy else 8, seed=3
        )
        free = sampler.sample(llama, prompts, params, compact=False)
        if greedy:  # prompt j's (2j + 2)-th token: endings spread over the loop
            stops = tuple({int(free.tokens[j, 0, 1 + 2 * j]) for j in range(8)})
        else:  # the commonest tokens
            ids, counts = np.unique(free.tokens[:, :, 1:].ravel(), return_counts=True)
            stops = tuple(int(x) for x in ids[np.argsort(-counts)[:16]])
        stats = decode_loop.LoopStats()
        ref = sampler.sample(
            llama, prompts, params, stop_token_ids=stops, compact=False, stats=stats
        )
        assert stats.loop_rows == (32,)  # 4 prompts (3 padded to 4) x 8, or 8 x 4
        out = sampler.sample(llama, prompts, params, stop_token_ids=stops, stats=stats)
        loops = stats.loop_rows
        assert len(loops) > 1 and loops[0] == 32
        assert loops == (32, 16, 8, 4)[: len(loops)]  # halving, none below 4 rows
        lengths = ref.lengths
        assert lengths.min() < lengths.max()  # rows ended at different steps
        np.testing.assert_array_equal(out.tokens, ref.tokens)
        np.testing.assert_array_equal(out.mask, ref.mask)
        assert out.finish_reasons == ref.finish_reasons
        np.testing.assert_allclose(out.logprobs, ref.logprobs, atol=1e-5, rtol=1e-5)
        assert stats.decode_steps == lengths.max()
        traces = sampler.trace_count()  # each loop shape compiles once
        again = decode_loop.LoopStats()
        sampler.sample(llama, prompts, params, stop_token_ids=stops, stats=again)
        assert sampler.trace_count() == traces and again.loop_rows == loops

    def test_chunks_and_n_slots_give_the_same_completions(self, llama):
        # The host runs the loop 3 steps at a time (with compaction between chunks), and n = 3
        # is compiled as 4 rows per prompt: the tokens are those of one whole call.
        params = base.SamplingParams(max_new_tokens=20, temperature=1.0, n=3, seed=5)
        ref = sampler.sample(llama, PROMPTS, params, stop_token_ids=(EOS, 7, 11))
        for slots in (3, 4):
            call = sampler.start(llama, PROMPTS, params, stop_token_ids=(EOS, 7, 11), n_slots=slots)
            chunks = 0
            while not call.finished:
                call.advance(3)
                chunks += 1
                lengths, toks, _, _ = call.progress()
                assert (lengths <= min(3 * chunks, 20)).all()
            out = call.batch()
            assert chunks > 1
            np.testing.assert_array_equal(out.tokens, ref.tokens)
            np.testing.assert_allclose(out.logprobs, ref.logprobs, atol=1e-5, rtol=1e-5)
            assert out.finish_reasons == ref.finish_reasons
        traces = sampler.trace_count()
        call = sampler.start(llama, PROMPTS, params, n_slots=4)
        call.advance(2)
        call.cancel(range(9))  # every row ends at the next chunk
        call.advance(5)
        assert call.finished and call.stats.decode_steps == 2
        assert sampler.trace_count() == traces  # chunk sizes are traced: nothing recompiles

    def test_compiles_once_per_bucket(self, llama):
        params = base.SamplingParams(max_new_tokens=10, temperature=0.9, n=2)
        sampler.sample(llama, PROMPTS, params)
        before = sampler.trace_count()
        long = PROMPTS[2]  # 21 tokens: every call below pads to 4 prompts x 24 slots, 16 new.
        for prompts, temp, new, seed in [
            ([long, [1, 2, 3], [4], [5, 6]], 0.5, 12, 1),
            ([long[:17], [9] * 11, [4, 5]], 1.3, 16, 2),
            (PROMPTS[::-1], 0.7, 3, 3),
            ([[8] * 24, [1], [2], [3]], 1.0, 1, None),
        ]:
            sampler.sample(
                llama,
                prompts,
                base.SamplingParams(max_new_tokens=new, temperature=temp, n=2, seed=seed),
            )
        assert sampler.trace_count() == before


class TestBuckets:
    def test_length_buckets(self):
        got = [padding.length_bucket(x, 16) for x in (1, 16, 17, 24, 25, 137, 193, 3584)]
        assert got == [16, 16, 24, 24, 32, 192, 256, 4096]
        assert [padding.bucket(x) for x in (1, 3, 4, 5)] == [1, 4, 4, 8]


class TestFilter:
    def test_top_k_then_top_p(self):
        logits = jnp.log(jnp.array([[0.05, 0.4, 0.1, 0.3, 0.15], [0.2] * 5]))
        out = sampling.filter_top_k_top_p(logits, jnp.int32(3), jnp.float32(0.6))
        # Row 0: top-3 = {0.4, 0.3, 0.15}, renormalised 0.47, 0.35, 0.18 -> nucleus 0.6 keeps two.
        assert np.isfinite(np.asarray(out[0])).tolist() == [False, True, False, True, False]
        assert np.isfinite(np.asarray(out[1])).all()  # ties at the top-k threshold are kept

    @pytest.mark.parametrize("vocab", [300, 2000])
    def test_equals_the_sorted_definition(self, vocab, monkeypatch):
        # Peaked and flat rows, ties, top-k inside / beyond the candidates, nucleus inside / beyond
        # them (the flat rows at p = 0.99 need more than the candidates: the sorted fallback).
        monkeypatch.setattr(sampling, "_FILTER_CANDIDATES", 64)
        rng = np.random.default_rng(0)
        peaked = rng.normal(scale=6.0, size=(6, vocab))
        flat = rng.normal(scale=0.3, size=(6, vocab))
        ties = np.round(rng.normal(scale=2.0, size=(4, vocab)))  # many equal logits
        logits = jnp.asarray(np.concatenate([peaked, flat, ties]), jnp.float32)
        fast = jax.jit(sampling.filter_top_k_top_p)
        slow = jax.jit(sampling.filter_top_k_top_p_sorted)
        fell_back = 0
        for k in (0, 1, 5, 64, 65, 500):
            for p in (0.3, 0.9, 0.99, 1.0):
                args = (logits, jnp.int32(k), jnp.float32(p))
                want = np.isfinite(np.asarray(slow(*args)))
                np.testing.assert_array_equal(np.isfinite(np.asarray(fast(*args))), want)
                fell_back += want.sum(-1).max() >= 64
        assert fell_back > 0  # the fallback branch was exercised, not only the fast one

    def test_off_keeps_everything(self):
        logits = jax.random.normal(jax.random.key(0), (2, 50))
        out = sampling.filter_top_k_top_p(logits, jnp.int32(0), jnp.float32(1.0))
        np.testing.assert_array_equal(out, logits)


class TestLogprobsMode:
    """`sample_step`'s reported log-prob per `logprobs_mode`, against the distribution worked
    out by hand on a 5-token vocabulary: p = [0.05, 0.4, 0.1, 0.3, 0.15], temperature 0.5,
    top-k 3 then top-p 0.6 (the filter keeps tokens 1 and 3)."""

    P = np.array([0.05, 0.4, 0.1, 0.3, 0.15])

    def _step(self, mode, *, greedy=False):
        logits = jnp.asarray(np.log(self.P)[None].repeat(64, 0), jnp.float32)
        keys = jax.vmap(lambda i: jax.random.fold_in(jax.random.key(0), i))(jnp.arange(64))
        tok, logp = sampling.sample_step(
            logits,
            keys,
            jnp.float32(0.5),
            jnp.int32(3),
            jnp.float32(0.6),
            greedy=greedy,
            use_filter=not greedy,
            logprobs_mode=mode,
        )
        return np.asarray(tok), np.asarray(logp)

    def test_each_mode_against_the_hand_computed_distribution(self):
        scaled = self.P**2 / (self.P**2).sum()  # softmax(log p / 0.5)
        kept = np.zeros(5)
        kept[[1, 3]] = scaled[[1, 3]] / scaled[[1, 3]].sum()  # 0.64, 0.36 after top-k/top-p
        want = {
            "scaled_logprobs": np.log(scaled),
            "processed_logprobs": np.log(np.where(kept > 0, kept, 1.0)),
            "raw_logprobs": np.log(self.P),
        }
        for mode, table in want.items():
            tok, logp = self._step(mode)
            assert set(tok.tolist()) == {1, 3}  # samples only from the filtered distribution
            np.testing.assert_allclose(logp, table[tok], rtol=1e-5, err_msg=mode)
        np.testing.assert_allclose(np.exp(want["processed_logprobs"][[1, 3]]), [16 / 25, 9 / 25])

    def test_greedy_reports_the_untempered_distribution_in_every_mode(self):
        for mode in sampling.LOGPROBS_MODES:
            tok, logp = self._step(mode, greedy=True)
            assert (tok == 1).all()
            np.testing.assert_allclose(logp, np.log(0.4), rtol=1e-5)

    def test_unknown_mode_is_refused(self):
        with pytest.raises(ValueError, match="logprobs_mode"):
            self._step("processed_logits")


class TestCategorical:
    """`sampling.categorical` (inverse-CDF in blocks) draws from softmax(logits)."""

    @staticmethod
    def _draw(logits_V, n, seed=0):
        keys = jax.vmap(lambda i: jax.random.fold_in(jax.random.key(seed), i))(jnp.arange(n))
        logits = jnp.broadcast_to(jnp.asarray(logits_V, jnp.float32), (n, len(logits_V)))
        return np.asarray(jax.jit(sampling.categorical)(keys, logits))

    def test_frequencies_match_softmax(self):
        # 300 tokens: three CDF blocks, the last one partial.
        logits = np.random.default_rng(0).normal(scale=2.0, size=300)
        p = np.exp(logits - logits.max())
        p /= p.sum()
        n = 40_000
        freq = np.bincount(self._draw(logits, n), minlength=300) / n
        # Each count is binomial(n, p_i): 5 standard deviations, plus one count for tiny p_i.
        bound = 5 * np.sqrt(p * (1 - p) / n) + 1 / n
        assert np.all(np.abs(freq - p) <= bound), np.max(np.abs(freq - p) / bound)

    def test_never_draws_minus_inf(self):
        # Finite logits at block edges (0, 127, 128, 299) and one that holds nearly all the mass.
        logits = np.full(300, -np.inf, np.float32)
        logits[[0, 127, 128, 200, 299]] = [0.0, -30.0, 1.0, 25.0, -0.5]
        tokens = self._draw(logits, 20_000, seed=1)
        assert set(np.unique(tokens)) <= {0, 127, 128, 200, 299}
        assert np.mean(tokens == 200) > 0.999
        one = np.full(300, -np.inf, np.float32)
        one[255] = 3.0
        np.testing.assert_array_equal(self._draw(one, 500, seed=2), 255)

    def test_seeded(self):
        logits = np.random.default_rng(1).normal(size=1000)
        np.testing.assert_array_equal(self._draw(logits, 64, 3), self._draw(logits, 64, 3))
        assert (self._draw(logits, 64, 3) != self._draw(logits, 64, 4)).any()


class TestEmbeddedEngine:
    def test_generate_and_sync_weights(self, tiny_llama_dir, tmp_path):
        from mmr_jax import models

        from support import testing

        engine = embedded.EmbeddedEngine.from_pretrained(tiny_llama_dir)
        assert engine.stop_token_ids == (EOS,)
        params = base.SamplingParams(max_new_tokens=8, temperature=0.0, n=2)
        before = engine.generate(PROMPTS, params)
        other_dir = testing.make_tiny_checkpoint(tmp_path / "other", family="llama", seed=1)
        other = models.from_pretrained(other_dir)
        engine.sync_weights(other, version=1)
        after = engine.generate(PROMPTS, params)
        ref = sampler.sample(other, PROMPTS, params, stop_token_ids=(EOS,))
        np.testing.assert_array_equal(after.tokens, ref.tokens)
        assert not np.array_equal(before.tokens, after.tokens)
        assert engine.version == 1

    def test_sync_merges_lora_into_a_plain_model(self, tiny_llama_dir):
        from flax import nnx

        from mmr_jax import models
        from mmr_jax.models import lora

        plain = models.from_pretrained(tiny_llama_dir)
        adapted = models.from_pretrained(tiny_llama_dir, lora=lora.LoraConfig(rank=4, alpha=8.0))
        for path, var in nnx.to_flat_state(nnx.state(adapted, nnx.LoRAParam)):
            if path[-1] == "lora_b":
                var.set_value(0.2 * jax.random.normal(jax.random.key(len(path)), var.shape))
        engine = embedded.EmbeddedEngine(plain, stop_token_ids=(EOS,))
        engine.sync_weights(adapted, version=3)
        params = base.SamplingParams(max_new_tokens=8, temperature=0.0, n=2)
        ref = sampler.sample(adapted, PROMPTS, params, stop_token_ids=(EOS,))
        np.testing.assert_array_equal(engine.generate(PROMPTS, params).tokens, ref.tokens)
