"""Attention of the decoder: grouped-query attention over the full sequence, over the split
decode cache, and over a prompt cache shared by the rows of a group (the sampler's decode step).

Scores, softmax and (in the decode forms) outputs are fp32. Shape legend (docs/design.md): N rows,
T new tokens, S key slots; shared prompts: B prompts of P slots, G rows each (N = B x G); H heads,
K kv heads, R = H / K, D head dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mmr_jax.kernels import decode_attention
from mmr_jax.models import kv_cache

MASK_VALUE = -1e30  # finite, so fully masked rows (left padding) give a uniform softmax, not NaN


def attend(q_NxTxHxD, k_NxSxKxD, v_NxSxKxD, mask_NxTxS):
    """Grouped-query attention; scores and softmax in fp32. Returns [N, T, H*D]."""
    n, t, h, d = q_NxTxHxD.shape
    kh = k_NxSxKxD.shape[2]
    q = q_NxTxHxD.reshape(n, t, kh, h // kh, d)
    s = jnp.einsum("ntkrd,nskd->nkrts", q, k_NxSxKxD, preferred_element_type=jnp.float32)
    s = jnp.where(mask_NxTxS[:, None, None], s * (d**-0.5), MASK_VALUE)
    p = jax.nn.softmax(s, axis=-1).astype(v_NxSxKxD.dtype)
    o = jnp.einsum("nkrts,nskd->ntkrd", p, v_NxSxKxD)
    return o.reshape(n, t, h * d)


def attend_split(q_NxTxHxD, k_NxKxDxS, v_NxKxSxD, mask_NxTxS):
    """`attend` against one layer of the split cache: keys [N, K, D, S], values [N, K, S, D].

    One query token (decode) is a batch of [R, D] x [D, S] matvecs, which XLA:CPU runs poorly as
    dots; written as multiply + reduce (over d for the scores, s contiguous; over s for the
    output, d contiguous) each fuses into a loop that streams its half of the cache once at
    memory speed (N = 128, S = 320 on SmolLM2, 2 cores: about 3.1 ms a layer, against 4.9 ms with
    keys as [N, K, S, D] and 4.0 ms as dots).
    """
    n, t, h, d = q_NxTxHxD.shape
    kh = k_NxKxDxS.shape[1]
    q = q_NxTxHxD.reshape(n, t, kh, h // kh, d)
    if t == 1:
        f32 = jnp.float32
        qq = q.reshape(n, kh, h // kh, d, 1).astype(f32)
        s = jnp.sum(qq * k_NxKxDxS[:, :, None].astype(f32), axis=3)[:, :, :, None]
        s = jnp.where(mask_NxTxS[:, None, None], s * (d**-0.5), MASK_VALUE)
        p = jax.nn.softmax(s, axis=-1).astype(v_NxKxSxD.dtype)[:, :, :, 0]
        o = jnp.sum(p[..., None].astype(f32) * v_NxKxSxD[:, :, None].astype(f32), axis=3)
        return o.astype(v_NxKxSxD.dtype).reshape(n, t, h * d)
    s = jnp.einsum("ntkrd,nkds->nkrts", q, k_NxKxDxS, preferred_element_type=jnp.float32)
    s = jnp.where(mask_NxTxS[:, None, None], s * (d**-0.5), MASK_VALUE)
    p = jax.nn.softmax(s, axis=-1).astype(v_NxKxSxD.dtype)
    o = jnp.einsum("nkrts,nksd->ntkrd", p, v_NxKxSxD)
    return o.reshape(n, t, h * d)


def attend_shared_prompt(q_NxTxHxD, pk_BxKxDxP, pv_BxKxPxD, k_NxKxDxS, v_NxKxSxD, pmask, mask_S):
    """Decode attention (T = 1) over prompt keys shared by groups of rows plus each row's own keys.

    Rows r = b * G + i (G = N // B) are the samples of prompt b: they attend to prompt b's cache
    (keys [B, K, D, P], values [B, K, P, D], where `pmask` [B, P] holds) and to their own split
    cache (keys [N, K, D, S], values [N, K, S, D], where `mask_S` [S] holds), under one softmax.
    Grouping a prompt's G rows makes the prompt part [G*R, D] x [D, P] products that read the
    shared keys once per prompt rather than once per row (SmolLM2, 8 prompts x 4 samples, P = 192:
    the prompt scores take a third of the time they take per row), and the prompt's cache is
    stored once, not G times. Scores (multiply + reduce over d, as in `attend_split`), softmax
    and outputs are fp32. Returns [N, T, H*D].
    """
    r, t, nh, d = q_NxTxHxD.shape  # locals: r rows (N), nh heads (H), n = G, g = R
    b, kh, _, p = pk_BxKxDxP.shape
    n, g = r // b, nh // kh
    f32 = jnp.float32
    q = q_NxTxHxD.reshape(b, n, kh, g, d).astype(f32)
    q_prompt = jnp.transpose(q, (0, 2, 1, 3, 4)).reshape(b, kh, n * g, d)
    s_prompt = jnp.sum(q_prompt[..., None] * pk_BxKxDxP[:, :, None].astype(f32), axis=3)
    s_prompt = jnp.where(pmask[:, None, None, :], s_prompt * (d**-0.5), MASK_VALUE)
    s_prompt = jnp.transpose(s_prompt.reshape(b, kh, n, g, p), (0, 2, 1, 3, 4)).reshape(r, kh, g, p)
    q_own = q.reshape(r, kh, g, d)
    s_own = jnp.sum(q_own[..., None] * k_NxKxDxS[:, :, None].astype(f32), axis=3)
    s_own = jnp.where(mask_S[None, None, None, :], s_own * (d**-0.5), MASK_VALUE)
    probs = jax.nn.softmax(jnp.concatenate([s_prompt, s_own], axis=-1), axis=-1)  # [N, K, R, P+S]
    p_prompt = jnp.transpose(probs[..., :p].reshape(b, n, kh, g, p), (0, 2, 1, 3, 4))
    o_prompt = jnp.einsum(
        "bkms,bksd->bkmd", p_prompt.reshape(b, kh, n * g, p), pv_BxKxPxD.astype(f32)
    )
    o_prompt = jnp.transpose(o_prompt.reshape(b, kh, n, g, d), (0, 2, 1, 3, 4))
    o_own = jnp.einsum("rkgs,rksd->rkgd", probs[..., p:], v_NxKxSxD.astype(f32))
    o = o_prompt.reshape(r, kh, g, d) + o_own
    return o.astype(v_NxKxSxD.dtype).reshape(r, t, nh * d)


def attend_shared_prompt_decode(q, pk, pv, k, v, pmask, write_index, layer):
    """`attend_shared_prompt` of layer `layer` (traced) for a decode step that has written own
    slots [0, write_index]; the caches are the stacked split ones ([L, ...]).

    On CPU, with fp32 caches, the C++ kernel (`mmr_jax.kernels.decode_attention`) computes it
    from the stacked buffers and the layer index (no per-layer copy), reading only the unmasked
    span of each prompt and the written own slots; XLA's static shapes make the pure-JAX version
    read and mask all P + S slots (SmolLM2, 8 prompts x 4 samples: the decode step's attention
    about halves). Other platforms and dtypes, or no C++ compiler: the pure-JAX version.
    """
    own_mask_S = jnp.arange(k.shape[-1], dtype=jnp.int32) <= write_index

    def pure_jax(q, pk, pv, k, v, pmask):
        per_layer = [kv_cache.layer(a, layer) for a in (pk, pv, k, v)]
        return attend_shared_prompt(q, *per_layer, pmask, own_mask_S)

    args = (q, pk, pv, k, v, pmask)
    if not all(a.dtype == jnp.float32 for a in args[:5]) or not decode_attention.usable():
        return pure_jax(*args)

    def kernel(*args):
        return decode_attention.attend_shared_prompt(*args, write_index + 1, layer)

    return jax.lax.platform_dependent(*args, cpu=kernel, default=pure_jax)


def attend_shared_prompt_step(q, k_new, v_new, pk, pv, k, v, pmask, mask_S):
    """`attend_shared_prompt` (T = 1) where each row's newest key/value is not in its cache yet.

    Shapes: q [N, 1, H, D]; prompt keys pk [B, K, D, P], values pv [B, K, P, D]; own keys k
    [N, K, D, S], values v [N, K, S, D]; k_new, v_new [N, 1, K, D]. Row r = b * G + i attends to
    prompt b's slots where `pmask` [B, P] holds, to its own slots where `mask_S` [S] holds, and
    to its new key/value under one softmax, taken in parts (one max, one sum; no concatenated
    score row). The caches are only read, so a decode step can read them in its layer scan and
    write every layer's new slot once after it (`Decoder.forward_cached_shared_prompt`). fp32
    scores and outputs. Returns [N, 1, H*D].
    """
    r, t, nh, d = q.shape  # locals: r rows (N), nh heads (H), n = G, g = R
    b, kh, _, p = pk.shape
    n, g = r // b, nh // kh
    f32, scale = jnp.float32, d**-0.5
    q = q.reshape(b, n, kh, g, d).astype(f32)
    q_prompt = jnp.transpose(q, (0, 2, 1, 3, 4)).reshape(b, kh, n * g, d)
    s_prompt = jnp.sum(q_prompt[..., None] * pk[:, :, None].astype(f32), axis=3)
    s_prompt = jnp.where(pmask[:, None, None, :], s_prompt * scale, MASK_VALUE)  # [B, K, G*R, P]
    q_own = q.reshape(r, kh, g, d)
    s_own = jnp.sum(q_own[..., None] * k[:, :, None].astype(f32), axis=3)
    s_own = jnp.where(mask_S[None, None, None, :], s_own * scale, MASK_VALUE)  # [N, K, R, S]
    k_new = k_new.reshape(r, kh, 1, d).astype(f32)  # [N, 1, K, D] -> [N, K, 1, D]
    s_new = jnp.sum(q_own * k_new, axis=-1, keepdims=True) * scale  # [N, K, R, 1]
    m_prompt = jnp.max(s_prompt, axis=-1).reshape(b, kh, n, g)
    m_prompt = jnp.transpose(m_prompt, (0, 2, 1, 3)).reshape(r, kh, g, 1)
    m = jnp.maximum(jnp.maximum(m_prompt, jnp.max(s_own, axis=-1, keepdims=True)), s_new)
    m_by_prompt = jnp.transpose(m.reshape(b, n, kh, g), (0, 2, 1, 3)).reshape(b, kh, n * g, 1)
    e_prompt = jnp.exp(s_prompt - m_by_prompt)
    e_own, e_new = jnp.exp(s_own - m), jnp.exp(s_new - m)
    o_prompt = jnp.einsum("bkms,bksd->bkmd", e_prompt, pv.astype(f32))
    o_prompt = jnp.transpose(o_prompt.reshape(b, kh, n, g, d), (0, 2, 1, 3, 4)).reshape(r, kh, g, d)
    z_prompt = jnp.sum(e_prompt, axis=-1).reshape(b, kh, n, g)
    z_prompt = jnp.transpose(z_prompt, (0, 2, 1, 3)).reshape(r, kh, g, 1)
    o_own = jnp.einsum("rkgs,rksd->rkgd", e_own, v.astype(f32))
    o_new = e_new * v_new.reshape(r, kh, 1, d).astype(f32)
    z = z_prompt + jnp.sum(e_own, axis=-1, keepdims=True) + e_new
    o = (o_prompt + o_own + o_new) / z
    return o.astype(v.dtype).reshape(r, t, nh * d)


def attend_shared_prompt_step_decode(q, k_new, v_new, pk, pv, k, v, pmask, write_index, layer):
    """`attend_shared_prompt_step` of layer `layer` (traced) of the stacked split caches
    ([L, ...], read only), for a decode step whose new token goes to own slot `write_index`:
    the own slots before it are valid."""
    own_mask_S = jnp.arange(k.shape[-1], dtype=jnp.int32) < write_index
    per_layer = [kv_cache.layer(a, layer) for a in (pk, pv, k, v)]
    return attend_shared_prompt_step(q, k_new, v_new, *per_layer, pmask, own_mask_S)
