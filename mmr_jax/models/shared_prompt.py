"""Training-side shared-prompt forward: each prompt once per group, its completions attend to it.

The decode-side twin is `Decoder.forward_cached_shared_prompt` (the sampler's prompt cache). Here
the whole sequence is computed at once, for log-probs and their gradients:

  prompts [B, P] (left-padded) run causally over themselves, as the full-row forward does;
  completions [N, T] (right-padded), N = B * G (row r = b * G + i belongs to prompt b), attend
  under one softmax to their prompt's keys/values and to their own causal keys/values, at
  positions continuing from the prompt's length: one fused attention call
  (`attention_impl.dot_product`, backend `model.config.attention_impl`) over each row's keys
  [prompt ; own], where only the prompt's keys and values are repeated per row, inside attention
  (`completion_keys`); the prompt's activations go through the projections and MLP once.

So each row sees exactly the keys and values it sees as the full row [prompt, completion], and
the gradient that reaches the prompt is the sum over its G rows (the repeat's transpose sums
them): loss and gradients equal those of the n full rows, with the prompt's work done once
instead of n times.

LoRA dropout: a prompt's tokens draw one dropout mask for the group (the full-row forward draws
one per row), so with dropout > 0 the two paths are different (equally valid) samples.

Shape legend (docs/design.md): B prompts, G rows per prompt, N = B * G rows, P prompt tokens,
T completion tokens, E hidden width, H heads, K kv heads, R = H / K query heads per kv head, D head
dim.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp

from mmr_jax.models import attention, attention_impl, layers
from mmr_jax.models import decoder as decoder_lib

_MASK_VALUE = attention.MASK_VALUE  # finite: fully masked rows give a uniform softmax, not NaN


def attend_completions(
    q_NxTxHxD, pk_BxPxKxD, pv_BxPxKxD, k_NxTxKxD, v_NxTxKxD, pmask_BxP, own_NxTxT
):
    """Completion queries over [their prompt's keys, their own keys] under one fp32 softmax:
    the unfused form (score matrices concatenated), kept as the parity reference of the fused
    path (`completion_keys` + `attention_impl.dot_product`).

    Row r = b * G + i attends to prompt b's keys where `pmask_BxP[b]` holds and to its own key s
    where `own_NxTxT[r, t, s]` holds (causal and not padding). The prompt part is a product per
    prompt over its G rows' queries at once ([G*T*R, D] x [D, P]), so the prompt keys are read
    once per group and their gradient is the group's sum. Returns [N, T, H*D].
    """
    r, t, nh, d = q_NxTxHxD.shape  # locals: r rows (N), nh heads (H), n = G, g = R
    b, p, kh, _ = pk_BxPxKxD.shape
    n, g = r // b, nh // kh
    chex.assert_equal(r, b * n)
    q = q_NxTxHxD.reshape(b, n, t, kh, g, d)
    s_prompt = jnp.einsum("bntkgd,bpkd->bnkgtp", q, pk_BxPxKxD, preferred_element_type=jnp.float32)
    s_prompt = jnp.where(pmask_BxP[:, None, None, None, None, :], s_prompt * (d**-0.5), _MASK_VALUE)
    s_own = jnp.einsum(
        "rtkgd,rskd->rkgts",
        q.reshape(r, t, kh, g, d),
        k_NxTxKxD,
        preferred_element_type=jnp.float32,
    )
    s_own = jnp.where(own_NxTxT[:, None, None], s_own * (d**-0.5), _MASK_VALUE)
    scores = jnp.concatenate([s_prompt.reshape(r, kh, g, t, p), s_own], axis=-1)
    probs = jax.nn.softmax(scores, axis=-1).astype(v_NxTxKxD.dtype)  # [N, K, R, T, P + T]
    p_prompt = probs[..., :p].reshape(b, n, kh, g, t, p)
    o_prompt = jnp.einsum("bnkgtp,bpkd->bntkgd", p_prompt, pv_BxPxKxD.astype(v_NxTxKxD.dtype))
    o_own = jnp.einsum("rkgts,rskd->rtkgd", probs[..., p:], v_NxTxKxD)
    return (o_prompt.reshape(r, t, kh, g, d) + o_own).reshape(r, t, nh * d)


def completion_keys(pk_BxPxKxD, k_NxTxKxD):
    """Each row's keys (or values) [N, P + T, K, D]: its prompt's, then its own.

    Only keys and values are repeated per row (K*D numbers a token, against the N*(P+T)
    scores a token of the unfused form, whose prompt and own parts were concatenated).
    """
    b, r = pk_BxPxKxD.shape[0], k_NxTxKxD.shape[0]
    rows = jnp.repeat(pk_BxPxKxD.astype(k_NxTxKxD.dtype), r // b, axis=0)
    return jnp.concatenate([rows, k_NxTxKxD], axis=1)


def _block(block, xp, xc, rope_p, rope_c, masks, disable_lora, key, impl):
    """One decoder block over the prompts [B, P, E] and the completions [N, T, E]."""
    attn = block.self_attn
    # separate dropout draws for the two parts
    kp, kc = decoder_lib.split_key(key, 0), decoder_lib.split_key(key, 1)
    qp, k_p, v_p = attn.qkv(block.input_layernorm(xp), *rope_p, disable_lora=disable_lora, key=kp)
    qc, k_c, v_c = attn.qkv(block.input_layernorm(xc), *rope_c, disable_lora=disable_lora, key=kc)
    (mask_p, dense_p), (mask_c, dense_c) = masks
    # the prompts alone: the full-row attention
    op = attention_impl.dot_product(qp, k_p, v_p, mask_p, implementation=impl, dense=dense_p)
    packed = mask_c.extra_NxTxS is not None
    if attention_impl.resolve(impl, qc.dtype, qc.shape[-1], packed=packed) == "unfused":
        p = k_p.shape[1]
        pvalid = mask_c.kv_valid_NxS[:: qc.shape[0] // k_p.shape[0], :p]  # [B, P]
        oc = attend_completions(qc, k_p, v_p, k_c, v_c, pvalid, dense_c[:, :, p:])
    else:
        kc_all, vc_all = completion_keys(k_p, k_c), completion_keys(v_p, v_c)
        oc = attention_impl.dot_product(
            qc, kc_all, vc_all, mask_c, implementation=impl, dense=dense_c
        )
    xp = xp + attn.out(op, disable_lora=disable_lora, key=kp)
    xc = xc + attn.out(oc, disable_lora=disable_lora, key=kc)
    mlp, norm = block.mlp, block.post_attention_layernorm
    xp = xp + mlp(norm(xp), disable_lora=disable_lora, key=kp)
    xc = xc + mlp(norm(xc), disable_lora=disable_lora, key=kc)
    return xp, xc


def hidden(model, prompt_BxP, prompt_mask_BxP, tokens_NxT, mask_NxT, *, disable_lora=False):
    """Final-normed hidden states of the prompts [B, P, E] and completions [N, T, E].

    Args:
      model: a `decoder.Decoder` (its scanned layers, norms and RoPE; `model.config.remat`
        applies).
      prompt_BxP: prompt token ids, left-padded; `prompt_mask_BxP` 1/True on real tokens (each
        prompt has at least one).
      tokens_NxT: completion tokens fed as inputs, right-padded, rows grouped by prompt
        (N a multiple of B); `mask_NxT` 1/True on real tokens (a prefix of each row).
    """
    chex.assert_rank([tokens_NxT, mask_NxT], 2)
    chex.assert_equal_shape([tokens_NxT, mask_NxT])
    t = tokens_NxT.shape[1]
    offsets = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None], tokens_NxT.shape)
    return _hidden(
        model,
        prompt_BxP,
        prompt_mask_BxP,
        tokens_NxT,
        offsets,
        mask_NxT.astype(jnp.bool_),
        None,
        disable_lora=disable_lora,
    )


def packed_hidden(
    model, prompt_BxP, prompt_mask_BxP, tokens_BxL, segments_BxL, offsets_BxL, *, disable_lora=False
):
    """`hidden` of completions packed one row per prompt: [B, P, E] and [B, L, E].

    Row b holds its prompt's completions one after another (`batch_layout.pack_completions`):
    `segments_BxL` the completion each token belongs to (-1 on padding), `offsets_BxL` the
    token's index within its completion. A token attends to its prompt and to the earlier tokens
    of its own segment, at position prompt length + offset: exactly what it sees in its full row
    [prompt, completion], with no work on padding beyond the row's bucket.
    """
    chex.assert_rank([tokens_BxL, segments_BxL, offsets_BxL], 2)
    chex.assert_equal_shape([tokens_BxL, segments_BxL, offsets_BxL])
    seg = segments_BxL.astype(jnp.int32)
    same = seg[:, :, None] == seg[:, None, :]
    return _hidden(
        model,
        prompt_BxP,
        prompt_mask_BxP,
        tokens_BxL,
        offsets_BxL,
        seg >= 0,
        same,
        disable_lora=disable_lora,
    )


def _hidden(
    model,
    prompt_BxP,
    prompt_mask_BxP,
    tokens_NxT,
    offsets_NxT,
    valid_NxT,
    same_NxTxT,
    *,
    disable_lora,
):
    """The blocks over prompts [B, P] and completion rows [N, T] (N a multiple of B).

    Completion token (r, t) sits at position len(prompt of r) + `offsets_NxT[r, t]` and attends
    to its prompt and to its own row's keys s <= t where `valid_NxT[r, s]` (and
    `same_NxTxT[r, t, s]`, when given: packed completions' segments).
    """
    chex.assert_rank([prompt_BxP, prompt_mask_BxP], 2)
    chex.assert_equal_shape([prompt_BxP, prompt_mask_BxP])
    b, p = prompt_BxP.shape
    r = tokens_NxT.shape[0]
    if r % b:
        raise ValueError(f"{r} completion rows do not split into groups of {b} prompts")
    pmask = prompt_mask_BxP.astype(jnp.bool_)
    plen = pmask.sum(-1).astype(jnp.int32)  # [B]
    pos_p = jnp.maximum(jnp.cumsum(pmask, axis=-1) - 1, 0)
    pos_c = jnp.repeat(plen, r // b)[:, None] + offsets_NxT.astype(jnp.int32)
    impl = model.config.attention_impl
    mask_p = attention_impl.causal(pmask)
    mask_c = attention_impl.prompt_then_causal(
        jnp.repeat(pmask, r // b, axis=0), valid_NxT, same_NxTxT
    )
    # the dense masks once, outside the layer scan (splash takes none)
    masks = tuple((m, None if impl == "pallas_tpu" else m.dense()) for m in (mask_p, mask_c))
    rope_p = layers.rope_cos_sin(pos_p, model.inv_freq)
    rope_c = layers.rope_cos_sin(pos_c, model.inv_freq)
    key = model.dropout_key()

    def layer(block, carry, i, _):
        xp, xc = carry
        layer_key = decoder_lib.split_key(key, i)
        args = (rope_p, rope_c, masks, disable_lora, layer_key, impl)
        return _block(block, xp, xc, *args), None

    carry = (model.embed_tokens(prompt_BxP), model.embed_tokens(tokens_NxT))
    (xp, xc), _ = model.scan(layer, carry, remat=model.config.remat)
    return model.norm(xp), model.norm(xc)
