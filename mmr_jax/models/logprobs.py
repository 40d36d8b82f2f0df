"""Per-token log-probabilities (and entropies) of given sequences under the policy.

  logps[n, t] = log softmax(logits[n, t-1] / temperature)[tokens[n, t]],
  0 at t = 0 and where masked.

With `chunk_size`, the LM head and log-softmax run over the sequence in chunks under
`jax.checkpoint`, so only a [N, C, V] block of logits exists at a time, in the forward and the
backward pass.

Shape legend (docs/design.md): N rows, T tokens, E hidden width, V vocab, C chunk length; with
shared prompts, B prompts of P tokens, G = N / B rows each.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp

from mmr_jax.models import shared_prompt


def _scores(logits_NxCxV, targets_NxC, temperature, return_entropy):
    """(log-prob of the targets, entropy) [N, C] of softmax(logits / temperature), in fp32."""
    logp = jax.nn.log_softmax(logits_NxCxV.astype(jnp.float32) / temperature, axis=-1)
    picked = jnp.take_along_axis(logp, targets_NxC[..., None], axis=-1)[..., 0]
    if not return_entropy:
        return picked, jnp.zeros_like(picked)
    return picked, -jnp.sum(jnp.exp(logp) * logp, axis=-1)


def token_logprobs(
    model,
    tokens_NxT: jax.Array,
    attention_mask_NxT: jax.Array,
    *,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    return_entropy: bool = False,
    disable_lora: bool = False,
):
    """Log-probs [N, T] float32 of `tokens` under `model` (a `decoder.Decoder`) at `temperature`.

    Args:
      model: the decoder; `disable_lora=True` gives the base (reference) policy.
      tokens_NxT: int token ids (left or right padding).
      attention_mask_NxT: 1/True for real tokens.
      temperature: logits are divided by it before the softmax (as the sampler does).
      chunk_size: sequence chunk for the LM head; None computes all [N, T, V] logits at once.
      return_entropy: also return the per-token entropy [N, T] of the same distribution.

    Returns:
      logps [N, T] (0 at t = 0 and at masked positions), or (logps, entropy).
    """
    chex.assert_rank(tokens_NxT, 2)
    chex.assert_equal_shape([tokens_NxT, attention_mask_NxT])
    b, t = tokens_NxT.shape
    mask = attention_mask_NxT.astype(jnp.bool_)
    h = model.hidden(tokens_NxT, attention_mask_NxT=mask, disable_lora=disable_lora)[:, :-1]
    targets = tokens_NxT[:, 1:]
    n = t - 1
    if chunk_size is None or chunk_size >= n:
        logp, ent = _scores(model.logits_from_hidden(h), targets, temperature, return_entropy)
    else:
        logp, ent = _chunked(model, h, targets, chunk_size, temperature, return_entropy)
    valid = mask[:, 1:]
    zero = jnp.zeros((b, 1), jnp.float32)
    logp = jnp.concatenate([zero, jnp.where(valid, logp, 0.0)], axis=1)
    if not return_entropy:
        return logp
    return logp, jnp.concatenate([zero, jnp.where(valid, ent, 0.0)], axis=1)


def _chunked(model, h_NxTxE, targets_NxT, chunk, temperature, return_entropy):
    """_scores over sequence chunks with rematerialisation; returns two [N, T] arrays.

    Each chunk is a slice of `h` taken inside the loop (no padded or transposed copy of the
    hidden states); a last partial chunk runs on its own. `jax.checkpoint` on the chunk keeps
    only [N, T] results for the backward pass, which recomputes each chunk's logits.
    """
    n, t, _ = h_NxTxE.shape
    full = t // chunk

    @jax.checkpoint
    def one(hc, tc):
        return _scores(model.logits_from_hidden(hc), tc, temperature, return_entropy)

    def body(i):
        start = i * chunk
        hc = jax.lax.dynamic_slice_in_dim(h_NxTxE, start, chunk, axis=1)
        tc = jax.lax.dynamic_slice_in_dim(targets_NxT, start, chunk, axis=1)
        return one(hc, tc)

    # [chunks, N, C] each
    logp_by_chunk, ent_by_chunk = jax.lax.map(body, jnp.arange(full, dtype=jnp.int32))
    logp = jnp.moveaxis(logp_by_chunk, 0, 1).reshape(n, full * chunk)  # [N, T]: no vocab axis
    ent = jnp.moveaxis(ent_by_chunk, 0, 1).reshape(n, full * chunk)
    if full * chunk < t:
        tail = one(h_NxTxE[:, full * chunk :], targets_NxT[:, full * chunk :])
        logp = jnp.concatenate([logp, tail[0]], axis=1)
        ent = jnp.concatenate([ent, tail[1]], axis=1)
    return logp, ent


def shared_prompt_logprobs(
    model,
    prompt_BxP: jax.Array,
    prompt_mask_BxP: jax.Array,
    tokens_NxT: jax.Array,
    mask_NxT: jax.Array,
    *,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    return_entropy: bool = False,
    disable_lora: bool = False,
):
    """Log-probs [N, T] of each row's completion given its group's shared prompt.

    Equals `token_logprobs` on the rows [prompt, completion] restricted to the completion part,
    with each prompt computed once for its G = N / B rows (`shared_prompt.hidden`) and the LM head
    run only where a completion token is predicted: once per prompt at its last token (the
    first completion token's distribution, shared by the group) and at completion positions
    0..T-2. The last completion token is only a target, so it is not fed to the model.

    Args:
      prompt_BxP: prompt ids, left-padded; `prompt_mask_BxP` True on real tokens.
      tokens_NxT: completion ids, right-padded, row r = b * G + i of prompt b;
        `mask_NxT` True on real tokens (a prefix of the row).

    Returns:
      logps [N, T] (0 where masked), or (logps, entropy), float32.
    """
    chex.assert_equal_shape([tokens_NxT, mask_NxT])
    t = tokens_NxT.shape[1]
    mask = mask_NxT.astype(jnp.bool_)
    hp, hc = shared_prompt.hidden(
        model,
        prompt_BxP,
        prompt_mask_BxP,
        tokens_NxT[:, :-1],
        mask[:, :-1],
        disable_lora=disable_lora,
    )
    logp0, ent0 = _first_token(model, hp, tokens_NxT[:, 0], temperature)
    if t > 1:
        targets = tokens_NxT[:, 1:]
        if chunk_size is None or chunk_size >= t - 1:
            logits = model.logits_from_hidden(hc)
            logp, ent = _scores(logits, targets, temperature, return_entropy)
        else:
            logp, ent = _chunked(model, hc, targets, chunk_size, temperature, return_entropy)
        logp = jnp.concatenate([logp0, logp], axis=1)
        ent = jnp.concatenate([ent0, ent], axis=1)
    else:
        logp, ent = logp0, ent0
    logp = jnp.where(mask, logp, 0.0)
    if not return_entropy:
        return logp
    return logp, jnp.where(mask, ent, 0.0)


def _first_token(model, hidden_prompt_BxPxE, first_N, temperature):
    """(log-prob, entropy) [N, 1] of each row's first completion token: one distribution per
    prompt (its last hidden state), picked per row (rows grouped by prompt)."""
    b, r = hidden_prompt_BxPxE.shape[0], first_N.shape[0]
    logits = model.logits_from_hidden(hidden_prompt_BxPxE[:, -1:])[:, 0]
    first = jax.nn.log_softmax(logits.astype(jnp.float32) / temperature, axis=-1)  # [B, V]
    logp0 = jnp.take_along_axis(first, first_N.reshape(b, r // b), axis=-1).reshape(r, 1)
    ent0 = jnp.repeat(-jnp.sum(jnp.exp(first) * first, axis=-1), r // b)[:, None]
    return logp0, ent0


def packed_logprobs(
    model,
    prompt_BxP: jax.Array,
    prompt_mask_BxP: jax.Array,
    tokens_NxT: jax.Array,
    mask_NxT: jax.Array,
    packed,
    *,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    return_entropy: bool = False,
    disable_lora: bool = False,
):
    """`shared_prompt_logprobs` with each group's completions packed into one row.

    `packed` (a `batch_layout.PackedCompletions` of device arrays, row b for prompt b) holds the
    inputs [B, L] (every completion token that predicts a next one), their targets, segments and
    offsets, and `index` [N, T]: where in row r's packed row the input predicting token t
    (t >= 1) sits. The body and the LM head run over the B x L packed tokens, not N x T padded
    ones; log-probs are gathered back to [N, T] (0 where masked), so the loss code is unchanged.
    """
    chex.assert_equal_shape([tokens_NxT, mask_NxT])
    r, t = tokens_NxT.shape
    b = prompt_BxP.shape[0]
    mask = mask_NxT.astype(jnp.bool_)
    hp, hc = shared_prompt.packed_hidden(
        model,
        prompt_BxP,
        prompt_mask_BxP,
        packed.inputs,
        packed.segments,
        packed.offsets,
        disable_lora=disable_lora,
    )
    logp0, ent0 = _first_token(model, hp, tokens_NxT[:, 0], temperature)
    packed_len = packed.inputs.shape[1]
    if chunk_size is None or chunk_size >= packed_len:
        logits = model.logits_from_hidden(hc)
        logp_p, ent_p = _scores(logits, packed.targets, temperature, return_entropy)
    else:
        logp_p, ent_p = _chunked(model, hc, packed.targets, chunk_size, temperature, return_entropy)
    row = (jnp.arange(r) // (r // b))[:, None]  # the packed row of completion row r
    first = jnp.arange(t)[None] == 0
    logp = jnp.where(first, logp0, logp_p[row, packed.index])
    logp = jnp.where(mask, logp, 0.0)
    if not return_entropy:
        return logp
    ent = jnp.where(first, ent0, ent_p[row, packed.index])
    return logp, jnp.where(mask, ent, 0.0)
