"""The sampler's decode step without copies: caches updated in place, weights cast once.

Checked on the compiled program (XLA's optimised HLO text), so on CPU without a GPU: the decode
step writes the KV caches once, outside its layer loop, and nothing of a cache's size is copied,
concatenated or transposed; given compute-dtype sampling weights it casts no weight. And the
values: the read-only-cache attention equals the reference attention on the written cache; the
sampler's greedy tokens are those of the in-scan-write path (the CPU kernel's) and of the fp32
master weights cast at use.
"""

from __future__ import annotations

import re
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mmr_jax import models
from mmr_jax.kernels import decode_attention
from mmr_jax.models import attention, decoder, kv_cache
from mmr_jax.models import config as model_config
from mmr_jax.rollout import base, embedded, sampler, sampler_weights

jax.config.update("jax_numpy_rank_promotion", "raise")

# Sizes chosen so that no activation shares a dimension tuple with a cache or a weight.
CFG = model_config.ModelConfig(
    vocab_size=520, hidden_size=48, intermediate_size=96, num_layers=3, num_heads=4,
    num_kv_heads=2, head_dim=12,
)  # fmt: skip
PROMPTS, N, PROMPT_SLOTS, OWN_SLOTS = 2, 4, 24, 40


def _computations(hlo: str) -> dict[str, list[str]]:
    """Computation name -> its instruction lines, from `Compiled.as_text()`."""
    comps, name = {}, None
    for line in hlo.splitlines():
        head = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
        if head and not line.startswith(" "):
            name = head.group(1)
            comps[name] = []
        elif name is not None and line.startswith("  "):
            comps[name].append(line.strip())
    return comps


def _loop_computations(comps: dict[str, list[str]]) -> set[str]:
    """Every computation run inside a while loop (bodies and what they call, transitively)."""
    callee = r"(?:calls|body|condition|to_apply|branch_computations)=\{?%?([\w.\-]+)"
    edges = {name: set(re.findall(callee, " ".join(lines))) for name, lines in comps.items()}
    inside = {
        b for lines in comps.values() for b in re.findall(r"body=%?([\w.\-]+)", " ".join(lines))
    }
    todo = list(inside)
    while todo:
        for callee in edges.get(todo.pop(), ()):
            if callee not in inside:
                inside.add(callee)
                todo.append(callee)
    return inside


def _result_dims(line: str) -> tuple[str, str, str] | None:
    """(dtype, dims, opcode) of an instruction line `%x = f32[1,2]{...} op(...)`."""
    m = re.match(r"^(?:ROOT )?%[\w.\-]+ = (\w+)\[([\d,]*)\](?:\{[^}]*\})? ([\w\-]+)\(", line)
    return m.groups() if m else None


def _dims(shape) -> str:
    return ",".join(map(str, shape))


def _decode_step_hlo(model, weights=None) -> tuple[str, kv_cache.KVCache]:
    """The optimised HLO of one jitted decode step (the own cache donated, as in the sampler's
    loop), and the own cache it was compiled for."""
    graphdef = nnx.graphdef(model)
    state = nnx.state(model) if weights is None else weights
    prompt_cache = kv_cache.split(model.init_cache(PROMPTS, PROMPT_SLOTS))
    cache = kv_cache.split(model.init_cache(PROMPTS * N, OWN_SLOTS))

    def step(state, tokens, positions, prompt_cache, cache, pmask, index):
        m = nnx.merge(graphdef, state)
        return m.forward_cached_shared_prompt(
            tokens, positions, prompt_cache, cache, write_index=index, prompt_mask_BxP=pmask
        )

    rows = jnp.zeros((PROMPTS * N, 1), jnp.int32)
    pmask = jnp.ones((PROMPTS, PROMPT_SLOTS), bool)
    lowered = jax.jit(step, donate_argnums=(4,)).lower(
        state, rows, rows, prompt_cache, cache, pmask, jnp.int32(3)
    )
    return lowered.compile().as_text(), cache


def _cache_dims(cache) -> set[str]:
    """The stacked k and v shapes and one layer's."""
    return {_dims(a.shape) for a in (cache.k, cache.v)} | {
        _dims(a.shape[1:]) for a in (cache.k, cache.v)
    }


def _model(dtype=jnp.float32):
    return decoder.Decoder(CFG, dtype=dtype, rngs=nnx.Rngs(0))


class TestDecodeStepHlo:
    def test_pure_jax_step_writes_caches_once_outside_the_layer_loop(self):
        with mock.patch.object(decode_attention, "usable", lambda: False):
            hlo, cache = _decode_step_hlo(_model())
        comps = _computations(hlo)
        loop = _loop_computations(comps)
        assert loop, "no while loop (layer scan) found in the HLO"
        stacked = {_dims(cache.k.shape), _dims(cache.v.shape)}
        writes_in_loop, writes = [], []
        for name, lines in comps.items():
            for line in lines:
                got = _result_dims(line)
                if got and got[1] in stacked and got[2] == "dynamic-update-slice":
                    (writes_in_loop if name in loop else writes).append(line)
        assert not writes_in_loop, writes_in_loop
        assert len(writes) == 2, writes  # k and v, every layer's new slot at once

    @pytest.mark.parametrize("kernel", [False, True])
    def test_no_copy_concatenate_or_transpose_of_cache_size(self, kernel):
        if kernel and not decode_attention.available():
            pytest.skip("no C++ compiler for the CPU kernel")
        with mock.patch.object(decode_attention, "usable", lambda: kernel):
            hlo, cache = _decode_step_hlo(_model())
        sizes = _cache_dims(cache)
        bad = []
        for lines in _computations(hlo).values():
            for line in lines:
                got = _result_dims(line)
                if got and got[1] in sizes and got[2] in ("copy", "concatenate", "transpose"):
                    bad.append(line)
        assert not bad, bad

    def test_no_weight_cast_with_compute_dtype_weights(self):
        model = _model(jnp.bfloat16)
        weight_dims = {
            _dims(v.get_value().shape)
            for _, v in nnx.to_flat_state(nnx.state(model, nnx.Param))
            if v.get_value().ndim >= 2
        }
        weight_dims |= {_dims(s.split(",")[1:]) for s in weight_dims if s.count(",") == 2}

        def casts_to_bf16(hlo):
            found = []
            for line in hlo.splitlines():
                got = _result_dims(line.strip())
                if got and got[0] == "bf16" and got[1] in weight_dims and got[2] == "convert":
                    found.append(line)
            return found

        master, _ = _decode_step_hlo(model)  # fp32 master weights: cast at every step
        assert casts_to_bf16(master), "the check finds no cast even of fp32 master weights"
        weights = sampler_weights.sampling_weights(model)
        assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(weights))
        once, _ = _decode_step_hlo(model, weights)
        assert not casts_to_bf16(once), casts_to_bf16(once)


class TestStepAttention:
    @pytest.mark.parametrize("write_index", [0, 3, 5])
    def test_equals_reference_on_the_written_cache(self, write_index):
        rng = np.random.default_rng(write_index)
        b, n, kh, g, d, p, s = 2, 3, 2, 2, 8, 5, 6
        r = b * n
        f = lambda *shape: rng.standard_normal(shape).astype(np.float32)
        q, pk, pv, k, v = (
            f(r, 1, kh * g, d),
            f(b, kh, d, p),
            f(b, kh, p, d),
            f(r, kh, d, s),
            f(r, kh, s, d),
        )
        k_new, v_new = f(r, 1, kh, d), f(r, 1, kh, d)
        pmask = rng.random((b, p)) < 0.6
        pmask[:, 0] = True
        k_written, v_written = k.copy(), v.copy()
        k_written[:, :, :, write_index] = k_new[:, 0]
        v_written[:, :, write_index, :] = v_new[:, 0]
        slots = np.arange(s)
        want = attention.attend_shared_prompt(
            q, pk, pv, k_written, v_written, pmask, slots <= write_index
        )
        got = attention.attend_shared_prompt_step(
            q, k_new, v_new, pk, pv, k, v, pmask, slots < write_index
        )
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


class TestWriteAllLayers:
    @pytest.mark.parametrize("split", [False, True])
    def test_every_layer_slot_written_rest_kept(self, split):
        rng = np.random.default_rng(0)
        cache = kv_cache.KVCache(
            k=jnp.asarray(rng.standard_normal((3, 2, 7, 2, 4)), jnp.float32),
            v=jnp.asarray(rng.standard_normal((3, 2, 7, 2, 4)), jnp.float32),
        )
        new_k = jnp.asarray(rng.standard_normal((3, 2, 1, 2, 4)), jnp.float32)
        new_v = jnp.asarray(rng.standard_normal((3, 2, 1, 2, 4)), jnp.float32)
        c = kv_cache.split(cache) if split else cache
        out = kv_cache.stack(kv_cache.write_all_layers(c, new_k, new_v, 4))
        want_k, want_v = np.array(cache.k), np.array(cache.v)
        want_k[:, :, 4:5], want_v[:, :, 4:5] = new_k, new_v
        np.testing.assert_array_equal(out.k, want_k)
        np.testing.assert_array_equal(out.v, want_v)


PROMPT_IDS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16, 17, 18]]


class TestSamplerValues:
    def test_greedy_tokens_same_as_in_scan_write_path(self, tiny_llama_dir):
        if not decode_attention.available():
            pytest.skip("no C++ compiler: the in-scan-write path (CPU kernel) is not built")
        model = models.from_pretrained(tiny_llama_dir)
        params = base.SamplingParams(12, temperature=0.0, n=2)
        with_kernel = sampler.sample(model, PROMPT_IDS, params)
        with mock.patch.object(decode_attention, "usable", lambda: False):
            read_only = sampler.sample(model, PROMPT_IDS, params)
        np.testing.assert_array_equal(read_only.tokens, with_kernel.tokens)
        np.testing.assert_allclose(read_only.logprobs, with_kernel.logprobs, rtol=1e-5, atol=1e-5)

    def test_bf16_weights_cast_once_give_the_same_samples(self, tiny_llama_dir):
        model = models.from_pretrained(tiny_llama_dir, dtype=jnp.bfloat16)
        params = base.SamplingParams(10, temperature=1.0, n=3, seed=7)
        cast_once = sampler.sample(model, PROMPT_IDS, params)
        cast_each_step = sampler.sample(model, PROMPT_IDS, params, weights=nnx.state(model))
        np.testing.assert_array_equal(cast_once.tokens, cast_each_step.tokens)
        np.testing.assert_array_equal(cast_once.logprobs, cast_each_step.logprobs)

    def test_engine_casts_once_per_weight_version(self, tiny_llama_dir):
        model = models.from_pretrained(tiny_llama_dir, dtype=jnp.bfloat16)
        engine = embedded.EmbeddedEngine(model)
        params = base.SamplingParams(4, temperature=0.0)
        engine.generate(PROMPT_IDS, params)
        first = engine._weights
        engine.generate(PROMPT_IDS, params)
        assert engine._weights is first  # no new copy between weight versions
        other = models.from_pretrained(tiny_llama_dir, dtype=jnp.bfloat16)
        nnx.update(other, jax.tree.map(lambda x: x * 2, nnx.state(other, nnx.Param)))
        engine.sync_weights(other, version=1)
        engine.generate(PROMPT_IDS, params)
        assert engine._weights is not first
        w = engine._weights["embed_tokens"]["embedding"].get_value()
        want = (other.embed_tokens.embedding[...]).astype(jnp.bfloat16)
        np.testing.assert_array_equal(np.asarray(w, np.float32), np.asarray(want, np.float32))
        # An update of the engine's model without sync_weights (the server's reload) is seen too.
        nnx.update(engine.model, jax.tree.map(lambda x: x * 0, nnx.state(other, nnx.Param)))
        engine.generate(PROMPT_IDS, params)
        w = engine._weights["embed_tokens"]["embedding"].get_value()
        assert not np.any(np.asarray(w, np.float32))


def _greedy_decode_logits(model, prompt_ids, n, steps):
    """Greedy decode through `forward_cached_shared_prompt` as the sampler lays it out (prompts
    left-padded, the prompt cache shared by each prompt's n rows, slot P - 1 the first input);
    -> (logits [steps, N, V] of each step, tokens [N, steps])."""
    b, p = len(prompt_ids), max(map(len, prompt_ids)) + 1
    tokens = np.zeros((b, p), np.int32)
    mask = np.zeros((b, p), bool)
    for i, ids in enumerate(prompt_ids):
        tokens[i, p - len(ids) :], mask[i, p - len(ids) :] = ids, True
    positions = np.maximum(np.cumsum(mask, -1) - 1, 0).astype(np.int32)
    prompt_cache = kv_cache.split(model.init_cache(b, p))
    _, prompt_cache = model.forward_cached(
        tokens[:, :-1], positions[:, :-1], prompt_cache, write_index=0, kv_mask_NxS=mask
    )
    pmask = mask.copy()
    pmask[:, -1] = False
    cache = kv_cache.split(model.init_cache(b * n, steps))
    cur = np.repeat(tokens[:, -1], n)
    lengths = np.repeat(mask.sum(-1), n)
    step = jax.jit(
        lambda cur, pos, cache, t: model.forward_cached_shared_prompt(
            cur, pos, prompt_cache, cache, write_index=t, prompt_mask_BxP=pmask
        ),
        donate_argnums=2,
    )
    all_logits, out = [], []
    for t in range(steps):
        logits, cache = step(cur[:, None], (lengths - 1 + t)[:, None], cache, jnp.int32(t))
        all_logits.append(np.asarray(logits[:, 0]))
        cur = np.asarray(jnp.argmax(logits[:, 0], -1)).astype(np.int32)
        out.append(cur)
    return np.stack(all_logits), np.stack(out, 1)


def _check_against_full_forward(model, rtol, atol):
    prompt_ids, n, steps = [[5, 6, 7, 8, 9], [10, 11, 12]], 2, 6
    logits, toks = _greedy_decode_logits(model, prompt_ids, n, steps)
    for r in range(len(prompt_ids) * n):
        seq = np.asarray([*prompt_ids[r // n], *toks[r]], np.int32)[None]
        full = np.asarray(model(jnp.asarray(seq)))[0]  # [T, V]
        want = full[len(prompt_ids[r // n]) - 1 : -1]  # the logits that chose each new token
        np.testing.assert_allclose(logits[:, r], want, rtol=rtol, atol=atol)


class TestDecodeMatchesFullForward:
    @pytest.mark.parametrize("kernel", [False, True])
    def test_cpu(self, tiny_llama_dir, kernel):
        if kernel and not decode_attention.available():
            pytest.skip("no C++ compiler for the CPU kernel")
        model = models.from_pretrained(tiny_llama_dir)
        with mock.patch.object(decode_attention, "usable", lambda: kernel):
            _check_against_full_forward(model, rtol=1e-4, atol=1e-5)


def _on_gpu() -> bool:
    return jax.default_backend() == "gpu"


@pytest.mark.gpu
class TestOnGpu:
    """The same checks compiled for the GPU (run where one is lent; skipped elsewhere)."""

    def test_decode_matches_full_forward_fp32(self, tiny_llama_dir):
        if not _on_gpu():
            pytest.skip("JAX's default backend is not a GPU")
        model = models.from_pretrained(tiny_llama_dir)
        with jax.default_matmul_precision("highest"):
            _check_against_full_forward(model, rtol=1e-4, atol=1e-5)

    def test_bf16_step_has_no_cache_copy_and_no_weight_cast(self):
        if not _on_gpu():
            pytest.skip("JAX's default backend is not a GPU")
        model = _model(jnp.bfloat16)
        hlo, cache = _decode_step_hlo(model, sampler_weights.sampling_weights(model))
        comps = _computations(hlo)
        loop = _loop_computations(comps)
        sizes, stacked = _cache_dims(cache), {_dims(cache.k.shape), _dims(cache.v.shape)}
        weights = {
            _dims(v.get_value().shape)
            for _, v in nnx.to_flat_state(nnx.state(model, nnx.Param))
            if v.get_value().ndim >= 2
        }
        bad = []
        for name, lines in comps.items():
            for line in lines:
                got = _result_dims(line)
                if not got:
                    continue
                dtype, dims, op = got
                if dims in sizes and op in ("copy", "concatenate", "transpose", "convert"):
                    bad.append(line)  # nothing of a cache's size is moved or cast
                if dims in stacked and op == "dynamic-update-slice" and name in loop:
                    bad.append(line)  # and nothing of it is written inside the layer loop
                if dims in weights and op == "convert":
                    bad.append(line)  # the weights come in the compute dtype already
        assert not bad, bad
