"""The continuous batch's device programs: a KV cache of S slots, decoded one step at a time.

The cache holds one sequence per slot, left-aligned: k [L, S, K, D, C], v [L, S, K, C, D] (the
split form of `kv_cache`), slot s's token at position p in column p. Every program takes it
donated and returns it updated in place, so a request joins or leaves the batch without the
other slots being touched or copied:
  `decode_step`: one token for the first `rows` slots, each at its own position (a row's new
    key/value are scattered to its own column; attention reads its columns below that position,
    block by block up to the longest live row, not all C); per-row temperature, top-k, top-p,
    greedy and seed, so requests with different sampling controls share the step.
  `prefill`: the prompts of new requests packed into rows [N, W], each attending to itself,
    their keys/values scattered into their slots' columns.
  `prefill_more`: the next W tokens of one long prompt, at columns [start, start + W) of its
    slot, attending to the columns before them.
  `copy_slots`: a prefilled slot copied to others (a request's n samples share its prompt).
Every shape is static, so `SlotPrograms` compiles a small grid of them ahead of requests.

Randomness: row r of a request with seed s draws step t from fold_in(fold_in(key(s), r), t), as
`rollout.sampler` does, so a seeded completion does not depend on what else is decoding.

Legend: L layers, S slots, C columns per slot, N rows of a step, W prompt tokens per row, T tokens
a row writes (1 in a decode step, W in a prefill), H query heads, K kv heads, R = H / K query
heads per kv head, D head dim, V vocab. (Locals as in `models.attention`: r rows, nh heads, g = R.)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from mmr_jax.models import attention, kv_cache, layers
from mmr_jax.rollout import sampling

BLOCK = 64  # columns attention reads at a time: a row costs its length rounded up to this


def block_count(longest: int) -> int:
    """Blocks of `BLOCK` columns that cover positions [0, longest)."""
    return -(-int(longest) // BLOCK)


def _attend_rows(q, k_new, v_new, ck, cv, layer, pos_N, n_blocks):
    """One query per row against its own slot's columns [0, pos_r) and its new key/value.

    q [N, 1, H, D]; k_new, v_new [N, 1, K, D]; ck, cv the stacked split cache (read only);
    rows are the first N slots. Online softmax over `n_blocks` blocks of `BLOCK` columns (a
    traced count), in fp32. Returns [N, 1, H*D].
    """
    r, _, nh, d = q.shape
    kh = k_new.shape[2]
    g, f32 = nh // kh, jnp.float32
    q = q.reshape(r, kh, g, d).astype(f32) * (d**-0.5)
    s_new = jnp.sum(q * k_new.reshape(r, kh, 1, d).astype(f32), axis=-1, keepdims=True)
    o = jnp.broadcast_to(v_new.reshape(r, kh, 1, d).astype(f32), (r, kh, g, d))
    zero = jnp.zeros((), jnp.int32)

    def block(b, carry):
        m, z, o = carry
        start = b * BLOCK
        kb = jax.lax.dynamic_slice(ck, (layer, zero, zero, zero, start), (1, r, kh, d, BLOCK))[0]
        vb = jax.lax.dynamic_slice(cv, (layer, zero, zero, start, zero), (1, r, kh, BLOCK, d))[0]
        s = jnp.sum(q[..., None] * kb[:, :, None].astype(f32), axis=3)  # [N, K, R, BLOCK]
        valid = (start + jnp.arange(BLOCK))[None, :] < pos_N[:, None]
        s = jnp.where(valid[:, None, None], s, attention.MASK_VALUE)
        m_next = jnp.maximum(m, jnp.max(s, axis=-1, keepdims=True))
        e, scale = jnp.exp(s - m_next), jnp.exp(m - m_next)
        o = o * scale + jnp.einsum("rkgc,rkcd->rkgd", e, vb.astype(f32))
        return m_next, z * scale + jnp.sum(e, axis=-1, keepdims=True), o

    carry = (s_new, jnp.ones_like(s_new), o)
    _, z, o = jax.lax.fori_loop(0, n_blocks, block, carry)
    return (o / z).astype(v_new.dtype).reshape(r, 1, nh * d)


def _scatter_columns(cache: kv_cache.KVCache, k_LxNxTxKxD, v_LxNxTxKxD, slot_NxT, col_NxT):
    """New keys/values [L, N, T, K, D] written to (slot, column) of the split cache; a column
    past the cache (C) drops the write (padding, idle rows)."""
    k_val = jnp.transpose(k_LxNxTxKxD, (1, 2, 0, 3, 4)).astype(cache.k.dtype)  # [N, T, L, K, D]
    v_val = jnp.transpose(v_LxNxTxKxD, (1, 2, 0, 3, 4)).astype(cache.v.dtype)
    k = cache.k.at[:, slot_NxT, :, :, col_NxT].set(k_val, mode="drop")
    v = cache.v.at[:, slot_NxT, :, col_NxT, :].set(v_val, mode="drop")
    return cache.replace(k=k, v=v)


def sample_rows(logits_NxV, keys_N, temperature_N, top_k_N, top_p_N, *, use_filter, mode):
    """Next token [N] and its log-prob [N], each row with its own controls: temperature 0 is
    greedy (argmax, log softmax(logits) reported); else `sampling.sample_step`'s draw and
    log-prob `mode` (`sampling.LOGPROBS_MODES`), top-k / top-p applied only where a row sets
    them (`use_filter`: whether any row does)."""
    greedy = temperature_N <= 0.0
    scaled = logits_NxV / jnp.where(greedy, 1.0, temperature_N)[:, None]
    logp_all = jax.nn.log_softmax(scaled, axis=-1)
    drawn_from = scaled
    if use_filter:
        wants = (top_k_N > 0) | (top_p_N < 1.0)
        # Rows without a filter get top-k = the filter's candidates (exact there, no full sort)
        # and keep their unfiltered logits.
        k = jnp.where(wants, top_k_N, sampling._FILTER_CANDIDATES)[:, None]
        p = jnp.where(wants, top_p_N, 1.0)[:, None]
        filtered = sampling.filter_top_k_top_p(scaled, k, p)
        drawn_from = jnp.where(wants[:, None], filtered, scaled)
    tok = jnp.where(
        greedy, jnp.argmax(logits_NxV, axis=-1), sampling.categorical(keys_N, drawn_from)
    ).astype(jnp.int32)
    if mode == "processed_logprobs":
        logp_all = jnp.where(greedy[:, None], logp_all, jax.nn.log_softmax(drawn_from, axis=-1))
    elif mode == "raw_logprobs":
        logp_all = jax.nn.log_softmax(logits_NxV, axis=-1)
    return tok, jnp.take_along_axis(logp_all, tok[:, None], axis=-1)[:, 0]


@functools.partial(
    jax.jit,
    static_argnames=("graphdef", "use_filter", "logprobs_mode"),
    donate_argnames=("cache",),
)
def decode_step(
    graphdef,
    state,
    kernels_t,
    cache,
    rows,
    *,
    use_filter: bool,
    logprobs_mode: str,
):
    """One decode step of the first N slots (N = len(rows["cur"])).

    rows: cur [N] int32 (each row's input token), pos [N] int32 (its position: the column it is
    written to; C for an idle row, whose write is dropped), seed [N] uint32, row_id [N] int32,
    step [N] int32 (tokens generated so far), temperature, top_p [N] f32, top_k [N] int32,
    bias [N, V] f32 (added to the logits: `token_controls`), n_blocks () int32 (`block_count`
    of the longest pos + 1).
    Returns (cache, tokens [N] int32, log-probs [N] f32).
    """
    model = nnx.merge(graphdef, state)
    pos, r = rows["pos"], rows["cur"].shape[0]
    cos, sin = layers.rope_cos_sin(pos[:, None], model.inv_freq)

    def layer(block, x, i, kt):
        h = block.input_layernorm(x)
        q, k, v = block.self_attn.qkv(h, cos, sin, disable_lora=False, key=None, kernels_t=kt)
        o = _attend_rows(q, k, v, cache.k, cache.v, i, pos, rows["n_blocks"])
        x = x + block.self_attn.out(o, disable_lora=False, key=None, kernels_t=kt)
        x = x + block.mlp(block.post_attention_layernorm(x), disable_lora=False, kernels_t=kt)
        return x, (k, v)

    layer_kt = None if kernels_t is None else kernels_t["layers"]
    x, (k_new, v_new) = model.scan(layer, model.embed_tokens(rows["cur"][:, None]), layer_kt)
    head_t = None if kernels_t is None else kernels_t.get("lm_head")
    logits = model.decode_logits(model.norm(x), head_t)[:, 0]
    slot = jnp.arange(r, dtype=jnp.int32)[:, None]
    cache = _scatter_columns(cache, k_new, v_new, slot, pos[:, None])
    keys = jax.vmap(
        lambda s, i, t: jax.random.fold_in(jax.random.fold_in(jax.random.key(s), i), t)
    )(rows["seed"], rows["row_id"], rows["step"])
    tok, logp = sample_rows(
        logits + rows["bias"],  # `token_controls`, on the raw logits as vLLM's processors
        keys,
        rows["temperature"],
        rows["top_k"],
        rows["top_p"],
        use_filter=use_filter,
        mode=logprobs_mode,
    )
    if logprobs_mode == "raw_logprobs":  # before any processing, the bias too
        logp = jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), tok[:, None], -1)[:, 0]
    return cache, tok, logp


@functools.partial(jax.jit, static_argnames=("graphdef",), donate_argnames=("cache",))
def prefill(graphdef, state, cache, tokens_NxW, positions_NxW, segments_NxW, slots_NxW, cols_NxW):
    """Prompts packed into rows (`padding.pack_prompts`): each token attends to the tokens of
    its own segment (id >= 0) before it, and its key/value go to column `cols_NxW` of slot
    `slots_NxW` (a column C, past the cache: padding, nothing written)."""
    model = nnx.merge(graphdef, state)
    r, w = tokens_NxW.shape
    scratch = kv_cache.split(model.init_cache(r, w))
    _, scratch = model.forward_cached(
        tokens_NxW,
        positions_NxW,
        scratch,
        write_index=0,
        kv_mask_NxS=segments_NxW >= 0,
        segment_ids_NxS=segments_NxW,
    )
    k = jnp.transpose(scratch.k, (0, 1, 4, 2, 3))  # [L, N, W, K, D]
    v = jnp.transpose(scratch.v, (0, 1, 3, 2, 4))
    return _scatter_columns(cache, k, v, slots_NxW, cols_NxW)


@functools.partial(jax.jit, static_argnames=("graphdef",), donate_argnames=("cache",))
def prefill_more(graphdef, state, cache, tokens_1xW, start, length, slot):
    """Writes the keys/values of `length` more prompt tokens of slot `slot` at columns
    [start, start + length); they attend to the slot's columns before them and causally to
    each other. `start` is a multiple of W and C of W, so the chunk lies inside the slot."""
    model = nnx.merge(graphdef, state)
    w = tokens_1xW.shape[1]
    zero = jnp.zeros((), jnp.int32)
    row_k = jax.lax.dynamic_slice_in_dim(cache.k, slot, 1, axis=1)
    row_v = jax.lax.dynamic_slice_in_dim(cache.v, slot, 1, axis=1)
    row = kv_cache.KVCache(k=row_k, v=row_v, split=True)
    c = cache.v.shape[3]
    _, row = model.forward_cached(
        tokens_1xW,
        (start + jnp.arange(w, dtype=jnp.int32))[None],
        row,
        write_index=start,
        kv_mask_NxS=(jnp.arange(c) < start + length)[None],
    )
    k = jax.lax.dynamic_update_slice(cache.k, row.k, (zero, slot, zero, zero, zero))
    v = jax.lax.dynamic_update_slice(cache.v, row.v, (zero, slot, zero, zero, zero))
    return cache.replace(k=k, v=v)


@functools.partial(jax.jit, donate_argnames=("cache",))
def copy_slots(cache, src_S, dst_S):
    """Slot `src_S[i]` copied to slot `dst_S[i]` (dst = S: nothing)."""
    k = cache.k.at[:, dst_S].set(cache.k[:, src_S], mode="drop")
    v = cache.v.at[:, dst_S].set(cache.v[:, src_S], mode="drop")
    return cache.replace(k=k, v=v)
