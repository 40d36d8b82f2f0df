"""Token sampling from logits: temperature, top-k then top-p filtering, inverse-CDF draws.

The sampler's decode loop draws with `sample_step`; `filter_top_k_top_p_sorted` is the
definition `filter_top_k_top_p` is tested against. Legend: N rows, V vocab, C filter candidates,
NB blocks of the CDF, BLOCK = `_CDF_BLOCK` tokens a block.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_FILTER_CANDIDATES = 256  # tokens the nucleus is looked for in before a full sort


def filter_top_k_top_p(logits_NxV: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Masks (to -inf) tokens outside the top-k, then outside the top-p nucleus of what is left.

    `top_k` 0 = off; `top_p` 1 = off. Ties at a threshold are kept. logits [N, V] -> [N, V].

    The same as `filter_top_k_top_p_sorted` (the definition), without sorting the vocabulary on
    every decode step (at N=128, V=49152 on CPU the sort took ~1.2 s, top_k(256) ~20 ms): the
    threshold is found among the `_FILTER_CANDIDATES` largest logits, with the normaliser over all
    V (or the top-k) taken directly, and the batch falls back to the full sort when some row's
    nucleus or top-k may reach beyond them.
    """
    v = logits_NxV.shape[-1]
    c = min(_FILTER_CANDIDATES, v)
    # XLA:CPU keeps TopK fast only when its result is reduced, not sliced (a slice of it turned
    # the whole filter into a ~1 s sort here): positions are picked with masks, not indexing.
    desc = jax.lax.top_k(logits_NxV, c)[0]  # [N, C], the C largest in descending order
    pos = jnp.arange(c)[None, :]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, v), v)
    in_k = pos < k
    # softmax over the top-k set: when k <= C it is inside desc; when top-k is off, all of V.
    top = jnp.max(logits_NxV, axis=-1, keepdims=True)
    norm = jnp.where(
        k <= c,
        jnp.sum(jnp.where(in_k, jnp.exp(desc - top), 0.0), axis=-1, keepdims=True),
        jnp.sum(jnp.exp(logits_NxV - top), axis=-1, keepdims=True),
    )
    probs = jnp.where(in_k, jnp.exp(desc - top) / norm, 0.0)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep = (in_k & (mass_before < top_p)) | (pos == 0)
    # Exact when the top-k lies within the candidates, or top-k is off and the nucleus ends
    # before the last candidate; otherwise the sort decides, for the whole batch (rare).
    # Per-row controls ([N, 1]) decide per row; scalar ones for the whole batch, as before.
    k_inside = (top_k > 0) & (top_k <= c)
    nucleus_reaches_end = (keep & (pos == c - 1)).any(axis=-1, keepdims=True)
    exact = jnp.all(k_inside | ((top_k == 0) & ~nucleus_reaches_end))
    threshold = jnp.min(jnp.where(keep, desc, jnp.inf), axis=-1, keepdims=True)
    fast = jnp.where(logits_NxV >= threshold, logits_NxV, -jnp.inf)
    if c == v:
        return fast
    return jax.lax.cond(
        exact, lambda: fast, lambda: filter_top_k_top_p_sorted(logits_NxV, top_k, top_p)
    )


def filter_top_k_top_p_sorted(
    logits_NxV: jax.Array, top_k: jax.Array, top_p: jax.Array
) -> jax.Array:
    """`filter_top_k_top_p` by a full sort of each row: the definition, and its fallback."""
    v = logits_NxV.shape[-1]
    desc = -jnp.sort(-logits_NxV, axis=-1)
    k = jnp.where(top_k > 0, jnp.minimum(top_k, v), v)
    in_k = jnp.arange(v)[None, :] < k
    desc = jnp.where(in_k, desc, -jnp.inf)
    probs = jax.nn.softmax(desc, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep = in_k & (mass_before < top_p)
    keep = keep.at[:, 0].set(True)
    threshold = jnp.min(jnp.where(keep, desc, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(logits_NxV >= threshold, logits_NxV, -jnp.inf)


_CDF_BLOCK = 128


def categorical(keys_N: jax.Array, logits_NxV: jax.Array) -> jax.Array:
    """One token per row from softmax(logits) by inverse-CDF sampling: [N] keys, [N, V] -> [N].

    `jax.random.categorical` draws V Gumbel variates per row; at N=128, V=49152 on CPU that is
    a large part of a SmolLM2 decode step (about 140 of 520 ms). This draws one uniform per row
    (as torch's multinomial does) and finds where it falls in the CDF in two levels, the sums of
    blocks of 128 tokens and then the cumulative sum inside the chosen block, so no cumsum over the
    whole vocabulary is needed either. Tokens with logit -inf are never drawn: the chosen index
    always has p > 0 (see the clamps below), whatever the rounding.
    """
    n, v = logits_NxV.shape
    nb = -(-v // _CDF_BLOCK)
    logits = jnp.pad(logits_NxV, ((0, 0), (0, nb * _CDF_BLOCK - v)), constant_values=-jnp.inf)
    top = jnp.max(logits, axis=-1, keepdims=True)
    p_NxNBxBLOCK = jnp.exp(logits - top).reshape(n, nb, _CDF_BLOCK)
    block_cdf = jnp.cumsum(jnp.sum(p_NxNBxBLOCK, axis=-1), axis=-1)  # [N, NB]
    # u in (0, 1], so the target is > 0 and <= the last CDF value: some block reaches it.
    u = 1.0 - jax.vmap(jax.random.uniform)(keys_N)
    target = u * block_cdf[:, -1]
    b = jnp.minimum(jnp.sum(block_cdf < target[:, None], axis=-1), nb - 1)
    before = jnp.where(b > 0, jnp.take_along_axis(block_cdf, (b - 1)[:, None], -1)[:, 0], 0.0)
    # block_cdf rose at b (it passed the target there), so block b holds some p > 0.
    p_NxBLOCK = jnp.take_along_axis(p_NxNBxBLOCK, b[:, None, None], axis=1)[:, 0]
    inner = jnp.sum(jnp.cumsum(p_NxBLOCK, axis=-1) < (target - before)[:, None], axis=-1)
    # The first index whose running sum reaches the rest of the target has p > 0; rounding can
    # carry the count past the block's last token with p > 0, so clamp to that one.
    last_nonzero = jnp.max(jnp.where(p_NxBLOCK > 0, jnp.arange(_CDF_BLOCK), -1), axis=-1)
    return (b * _CDF_BLOCK + jnp.minimum(inner, last_nonzero)).astype(jnp.int32)


# What the reported log-prob of a sampled token is the log-probability under (`sample_step`).
# scaled_logprobs: log softmax(logits / temperature), before top-k/top-p (the trainer's quantity);
# processed_logprobs: after temperature and top-k/top-p, renormalised over the kept tokens
# (vLLM's `--logprobs-mode processed_logprobs`); raw_logprobs: log softmax(logits), before
# temperature (vLLM's `raw_logprobs`). Greedy steps report log softmax(logits) in every mode.
LOGPROBS_MODES = ("scaled_logprobs", "processed_logprobs", "raw_logprobs")


def sample_step(
    logits_NxV,
    keys_N,
    temperature,
    top_k,
    top_p,
    *,
    greedy,
    use_filter,
    logprobs_mode: str = "scaled_logprobs",
):
    """Next token [N] and its log-prob [N] under the distribution `logprobs_mode` names
    (`LOGPROBS_MODES`; default log softmax(logits / temperature), before top-k/top-p)."""
    if logprobs_mode not in LOGPROBS_MODES:
        raise ValueError(f"logprobs_mode must be one of {LOGPROBS_MODES}, got {logprobs_mode!r}")
    if greedy:
        tok = jnp.argmax(logits_NxV, axis=-1).astype(jnp.int32)
        logp_all = jax.nn.log_softmax(logits_NxV, axis=-1)
    else:
        scaled = logits_NxV / temperature
        logp_all = jax.nn.log_softmax(scaled, axis=-1)
        if use_filter:
            scaled = filter_top_k_top_p(scaled, top_k, top_p)
        tok = categorical(keys_N, scaled)
        if logprobs_mode == "processed_logprobs":
            logp_all = jax.nn.log_softmax(scaled, axis=-1)
        elif logprobs_mode == "raw_logprobs":
            logp_all = jax.nn.log_softmax(logits_NxV, axis=-1)
    logp = jnp.take_along_axis(logp_all, tok[:, None], axis=-1)[:, 0]
    return tok, logp
