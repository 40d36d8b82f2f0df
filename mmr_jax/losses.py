"""Clipped policy-gradient objective with token aggregation modes and KL estimators.

Shape legend: B sequences (completions) in the (micro)batch, T completion tokens.

One per-token surrogate serves GRPO, Dr.GRPO and DAPO:

    ratio_t = exp(logp_t - old_logp_t)
    l_t = -min(ratio_t * A, clip(ratio_t, 1 - eps_low, 1 + eps_high) * A) + beta * KL_t

and the variants differ in how l_t is aggregated (see `AGGREGATIONS`). Every mode is a sum of
per-token or per-sequence terms divided by a normaliser, `loss = numerator / denominator`:

    'seq_mean_token_mean'      (GRPO)     sum_b [sum_t m l / sum_t m]  /  #sequences with a token
    'token_mean'               (DAPO)     sum_{b,t} m l                /  sum_{b,t} m
    'seq_mean_token_sum_norm'  (Dr.GRPO)  sum_{b,t} m l                /  (B * max_completion_len)

Exact gradient accumulation: compute the full batch's denominator once with `loss_denominator`
(same mask and mode) and pass it as `normaliser` to every microbatch call. Each microbatch loss is
then its numerator / global denominator, so the sum over microbatches of losses (and of gradients)
equals the full-batch loss (and gradient) exactly; DAPO's token mean uses the global token count.
Without `normaliser` the microbatch's own denominator is used (right for a single batch).

Rollout/trainer mismatch (end of the module): `mismatch_stats` measures how far the rollout
engine's log-probs of the sampled tokens are from the trainer's, and truncated importance sampling
(`tis_weights`, passed to `policy_loss`) reweights each token's policy-gradient term by
min(pi_trainer / pi_engine, cap) to correct for it.
"""

import chex
import jax
import jax.numpy as jnp

AGGREGATIONS = ("seq_mean_token_mean", "token_mean", "seq_mean_token_sum_norm")
KL_ESTIMATORS = ("k1", "k2", "k3")


def kl_divergence(logps: jax.Array, ref_logps: jax.Array, *, estimator: str = "k3") -> jax.Array:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi (Schulman, "Approximating KL").

    With d = ref_logp - logp: k1 = -d, k2 = d^2 / 2, k3 = exp(d) - d - 1 (unbiased, >= 0).

    Args:
      logps: [...] log-probs of the sampled tokens under the policy.
      ref_logps: [...] log-probs of the same tokens under the reference policy.
      estimator: 'k1', 'k2' or 'k3'.

    Returns:
      [...] per-token KL estimates.
    """
    chex.assert_equal_shape([logps, ref_logps])
    d = ref_logps - logps
    if estimator == "k1":
        return -d
    if estimator == "k2":
        return 0.5 * jnp.square(d)
    if estimator == "k3":
        # expm1(d) - d, not exp(d) - d - 1: near d = 0 the latter is rounding noise, negative
        # in bfloat16 (d = 0.01 gave -0.0039) and in float32; this one is >= 0 in any dtype.
        return jnp.expm1(d) - d
    raise ValueError(f"unknown KL estimator {estimator!r}; known: {KL_ESTIMATORS}")


def loss_denominator(
    mask_BxT: jax.Array, *, aggregation: str, max_completion_len: int | None = None
) -> jax.Array:
    """The normaliser of `policy_loss` for this mask and mode (module docstring), a float scalar.

    Call it on the full batch's mask and pass the result as `normaliser` to each microbatch.
    """
    chex.assert_rank(mask_BxT, 2)
    m = mask_BxT.astype(jnp.float32)
    if aggregation == "seq_mean_token_mean":
        return jnp.sum(jnp.any(mask_BxT, axis=-1)).astype(jnp.float32)
    if aggregation == "token_mean":
        return jnp.sum(m)
    if aggregation == "seq_mean_token_sum_norm":
        length = mask_BxT.shape[1] if max_completion_len is None else max_completion_len
        return jnp.asarray(mask_BxT.shape[0] * length, jnp.float32)
    raise ValueError(f"unknown aggregation {aggregation!r}; known: {AGGREGATIONS}")


def _numerator(loss_BxT: jax.Array, m_BxT: jax.Array, aggregation: str) -> jax.Array:
    """Sum of the per-token losses weighted as `aggregation` prescribes."""
    if aggregation == "seq_mean_token_mean":
        n_B = jnp.sum(m_BxT, axis=-1)
        per_seq_B = jnp.sum(loss_BxT * m_BxT, axis=-1) / jnp.maximum(n_B, 1.0)
        return jnp.sum(per_seq_B)
    return jnp.sum(loss_BxT * m_BxT)


def _masked_stats(x: jax.Array, valid: jax.Array, m: jax.Array, n: jax.Array) -> dict:
    return {
        "mean": jnp.sum(x * m) / n,
        "min": jnp.min(jnp.where(valid, x, jnp.inf)),
        "max": jnp.max(jnp.where(valid, x, -jnp.inf)),
    }


def policy_loss(
    logps_BxT: jax.Array,
    old_logps_BxT: jax.Array,
    advantages_B: jax.Array,
    mask_BxT: jax.Array,
    *,
    eps_low: float,
    eps_high: float,
    aggregation: str,
    ref_logps_BxT: jax.Array | None = None,
    beta: float = 0.0,
    kl_estimator: str = "k3",
    max_completion_len: int | None = None,
    normaliser: jax.Array | float | None = None,
    is_weights_BxT: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Clipped surrogate (PPO / GRPO / DAPO) with KL penalty, aggregated as `aggregation` says.

    The ratio is taken against `old_logps_BxT` (the policy that sampled, or the pre-update policy
    when iterations > 1). On the first pass pass `jax.lax.stop_gradient(logps_BxT)`: the ratio is
    then exactly 1 and the gradient is the plain policy gradient. Masked positions are replaced by
    0 before any arithmetic, so they carry no gradient and garbage there (even inf) cannot leak.

    Args:
      logps_BxT: [B, T] float log-probs of the completion tokens under the current policy.
      old_logps_BxT: [B, T] log-probs under the sampling (old) policy; no gradient flows into it.
      advantages_B: [B] per-sequence advantages.
      mask_BxT: [B, T] bool or {0, 1}, True = a completion token that counts.
      eps_low: lower clip range, ratio >= 1 - eps_low (GRPO/Dr.GRPO/DAPO 0.2).
      eps_high: upper clip range, ratio <= 1 + eps_high (GRPO/Dr.GRPO 0.2, DAPO 0.28).
      aggregation: one of AGGREGATIONS (module docstring).
      ref_logps_BxT: [B, T] reference-policy log-probs; required when beta > 0.
      beta: KL coefficient.
      kl_estimator: 'k1', 'k2' or 'k3'.
      max_completion_len: Dr.GRPO's constant length; defaults to T.
      normaliser: global denominator for exact gradient accumulation (module docstring).
      is_weights_BxT: [B, T] rollout/trainer importance weights (`tis_weights`), no gradient;
        they multiply the clipped policy-gradient term only, not the KL penalty (as verl's TIS,
        whose KL loss is a separate term). None = no correction (the loss is unchanged).

    Returns:
      (loss, metrics): scalar loss = numerator / (normaliser or denominator); metrics hold
      loss_numerator, loss_denominator, num_tokens, clip_frac_low, clip_frac_high (token means of
      where the clip binds), kl (token mean; 0 without reference) and ratio_mean/min/max.
    """
    chex.assert_rank([logps_BxT, advantages_B], [2, 1])
    b, t = logps_BxT.shape
    chex.assert_shape([old_logps_BxT, mask_BxT], (b, t))
    chex.assert_shape(advantages_B, (b,))
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {aggregation!r}; known: {AGGREGATIONS}")
    if beta != 0.0 and ref_logps_BxT is None:
        raise ValueError("beta > 0 needs ref_logps_BxT")
    valid = mask_BxT.astype(bool)
    m = valid.astype(logps_BxT.dtype)
    logps = jnp.where(valid, logps_BxT, 0.0)
    old = jnp.where(valid, jax.lax.stop_gradient(old_logps_BxT), 0.0)
    adv = advantages_B[:, None]

    ratio = jnp.exp(logps - old)
    clipped = jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high)
    loss_BxT = -jnp.minimum(ratio * adv, clipped * adv)
    if is_weights_BxT is not None:
        chex.assert_shape(is_weights_BxT, (b, t))
        loss_BxT = loss_BxT * jnp.where(valid, jax.lax.stop_gradient(is_weights_BxT), 0.0)
    kl = jnp.zeros_like(logps)
    if ref_logps_BxT is not None:
        chex.assert_shape(ref_logps_BxT, (b, t))
        ref = jnp.where(valid, jax.lax.stop_gradient(ref_logps_BxT), 0.0)
        kl = kl_divergence(logps, ref, estimator=kl_estimator)
        loss_BxT = loss_BxT + beta * kl

    num = _numerator(loss_BxT, m, aggregation)
    den = loss_denominator(valid, aggregation=aggregation, max_completion_len=max_completion_len)
    norm = den if normaliser is None else jnp.asarray(normaliser, jnp.float32)
    loss = num / jnp.maximum(norm, 1.0).astype(num.dtype)

    n_tok = jnp.maximum(jnp.sum(m), 1.0)
    # The clip binds (zero gradient) below 1 - eps_low only for A < 0, above 1 + eps_high for A > 0.
    low = (ratio < 1.0 - eps_low) & (adv < 0)
    high = (ratio > 1.0 + eps_high) & (adv > 0)
    stats = _masked_stats(jax.lax.stop_gradient(ratio), valid, m, n_tok)
    metrics = {
        "loss_numerator": num,
        "loss_denominator": den,
        "num_tokens": jnp.sum(m),
        "clip_frac_low": jnp.sum(low * m) / n_tok,
        "clip_frac_high": jnp.sum(high * m) / n_tok,
        "kl": jnp.sum(jax.lax.stop_gradient(kl) * m) / n_tok,
        "ratio_mean": stats["mean"],
        "ratio_min": stats["min"],
        "ratio_max": stats["max"],
    }
    return loss, metrics


# Rollout/trainer mismatch. The engine that sampled (embedded sampler, vLLM) and the trainer compute
# the same policy's log-probs with different kernels, so they differ in the low bits (fp32) or more
# (bf16, another backend). Statistics are kept as sums / counts / extrema, which combine exactly
# over minibatches (`combine_mismatch_stats`) and are turned into means only at the end.
MISMATCH_REDUCERS = {
    "num_tokens": "sum",
    "abs_diff_sum": "sum",  # sum |trainer - engine|
    "abs_diff_max": "max",
    "ratio_dev_sum": "sum",  # sum (r - 1), r = exp(trainer - engine): r - 1 keeps fp32 precision
    "ratio_dev_sq_sum": "sum",  # sum (r - 1)^2
    "ratio_min": "min",
    "ratio_max": "max",
    "capped": "sum",  # tokens with r > tis_cap (only when a cap is set)
}


def tis_weights(
    old_logps_BxT: jax.Array, engine_logps_BxT: jax.Array, mask_BxT: jax.Array, *, cap: float
) -> jax.Array:
    """Truncated importance sampling weights w = min(exp(old - engine), cap), no gradient.

    Token-level, as verl (`tis_imp_ratio_cap`) and TRL (`vllm_importance_sampling_cap`) define it:
    `old` is the trainer's log-prob of the sampled token under the pre-update policy, `engine` the
    sampler's; only the upper side is capped (a small ratio cannot blow up the variance).

    Args:
      old_logps_BxT: [B, T] trainer log-probs of the sampled tokens (pre-update policy).
      engine_logps_BxT: [B, T] the rollout engine's log-probs of the same tokens.
      mask_BxT: [B, T] bool or {0, 1}, True = a completion token.
      cap: the truncation C >= 1 (below 1 it would scale down tokens where both agree).

    Returns:
      [B, T] float weights, 0 at masked positions.
    """
    chex.assert_equal_shape([old_logps_BxT, engine_logps_BxT, mask_BxT])
    if not cap >= 1:
        raise ValueError(f"TIS cap must be >= 1, got {cap}")
    valid = mask_BxT.astype(bool)
    d = jnp.where(valid, old_logps_BxT - engine_logps_BxT, 0.0)
    w = jnp.minimum(jnp.exp(d), cap)
    return jax.lax.stop_gradient(jnp.where(valid, w, 0.0))


def mismatch_stats(
    trainer_logps_BxT: jax.Array,
    engine_logps_BxT: jax.Array,
    mask_BxT: jax.Array,
    *,
    tis_cap: float = 0.0,
) -> dict[str, jax.Array]:
    """Sufficient statistics of the trainer/engine log-prob mismatch on the masked tokens.

    Args:
      trainer_logps_BxT: [B, T] trainer log-probs of the sampled tokens.
      engine_logps_BxT: [B, T] the rollout engine's log-probs of the same tokens.
      mask_BxT: [B, T] bool or {0, 1}, True = a token that counts.
      tis_cap: when > 0, also count the tokens whose ratio exceeds it ('capped').

    Returns:
      float32 scalars keyed as `MISMATCH_REDUCERS` (no gradient); min / max are +inf / -inf
      without any token. Combine with `combine_mismatch_stats`, finish with `mismatch_metrics`.
    """
    chex.assert_equal_shape([trainer_logps_BxT, engine_logps_BxT, mask_BxT])
    valid = mask_BxT.astype(bool)
    m = valid.astype(jnp.float32)
    d = jax.lax.stop_gradient(
        jnp.where(valid, trainer_logps_BxT - engine_logps_BxT, 0.0).astype(jnp.float32)
    )
    dev = jnp.expm1(d)  # r - 1
    ratio = 1.0 + dev
    out = {
        "num_tokens": jnp.sum(m),
        "abs_diff_sum": jnp.sum(jnp.abs(d) * m),
        "abs_diff_max": jnp.max(jnp.where(valid, jnp.abs(d), -jnp.inf)),
        "ratio_dev_sum": jnp.sum(dev * m),
        "ratio_dev_sq_sum": jnp.sum(jnp.square(dev) * m),
        "ratio_min": jnp.min(jnp.where(valid, ratio, jnp.inf)),
        "ratio_max": jnp.max(jnp.where(valid, ratio, -jnp.inf)),
    }
    if tis_cap > 0:
        out["capped"] = jnp.sum((jnp.exp(d) > tis_cap) * m)
    return out


def combine_mismatch_stats(stats_M: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """[M] stacked `mismatch_stats` of M disjoint minibatches -> the statistics of their union."""
    reduce = {"sum": jnp.sum, "max": jnp.max, "min": jnp.min}
    return {k: reduce[MISMATCH_REDUCERS[k]](v, axis=0) for k, v in stats_M.items()}


def mismatch_metrics(stats: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """`mismatch_stats` (possibly combined) -> the logged metrics.

    mismatch/logp_abs_mean, mismatch/logp_abs_max: mean and max of |trainer - engine|;
    mismatch/ratio_mean, _std (population), _min, _max of r = exp(trainer - engine);
    tis/clipped_frac: share of tokens with r > cap (when the stats were taken with a cap).
    Without any token: 0 for the differences, 1 for the ratio (no mismatch measured).
    """
    n = stats["num_tokens"]
    has = n > 0
    n1 = jnp.maximum(n, 1.0)
    mean_dev = stats["ratio_dev_sum"] / n1
    var = jnp.maximum(stats["ratio_dev_sq_sum"] / n1 - jnp.square(mean_dev), 0.0)
    out = {
        "mismatch/logp_abs_mean": stats["abs_diff_sum"] / n1,
        "mismatch/logp_abs_max": jnp.where(has, stats["abs_diff_max"], 0.0),
        "mismatch/ratio_mean": 1.0 + mean_dev,
        "mismatch/ratio_std": jnp.sqrt(var),
        "mismatch/ratio_min": jnp.where(has, stats["ratio_min"], 1.0),
        "mismatch/ratio_max": jnp.where(has, stats["ratio_max"], 1.0),
    }
    if "capped" in stats:
        out["tis/clipped_frac"] = stats["capped"] / n1
    return out
