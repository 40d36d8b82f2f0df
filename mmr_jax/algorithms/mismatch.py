"""Rollout/trainer mismatch: its correction (importance weights) and its measurement.

Shape legend (docs/design.md): N rows (completions, B prompts x G) in the (micro)batch, T
completion tokens.

The engine that sampled (embedded sampler, vLLM) and the trainer compute the same policy's
log-probs with different kernels, so they differ in the low bits (fp32) or more (bf16, another
backend). With d_t = trainer_logp_t - engine_logp_t on the loss tokens of one sequence:

    level      log-ratio of token t           anchors
    token      d_t                             TRL token_*, verl rollout_is='token'
    sequence   sum_t d_t   (one per sequence)  TRL sequence_*, verl rollout_is='sequence'
    geometric  mean_t d_t  (one per sequence)  verl rollout_rs='geometric' (a rejection rule)

and r = exp(log-ratio). 'truncate' weights the policy-gradient term by min(r, cap) (truncated
importance sampling, TIS); 'mask' by r where low <= r <= cap and 0 elsewhere (the token, or the
whole sequence, is rejected). `TIS_MODES` names the six `level_kind` pairs.

What each is, against the anchors:
- token_truncate, sequence_truncate, token_mask, sequence_mask with low = 0: exactly TRL's
  `vllm_importance_sampling_mode` of the same name (TRL's default is sequence_mask, cap 3).
  A rejected token keeps its place in the loss's normaliser, as in TRL: the loss shrinks with
  the rejection rate.
- The '_mask' modes are not verl's rollout rejection sampling (`rollout_rs`): verl removes a
  rejected token from the response mask, hence from the normaliser, defaults the lower bound to
  1 / upper, and keeps the accepted tokens at weight 1 (its IS weights are a separate option).
  `low` = 1 / cap gives verl's bounds; the normaliser and the weight of the kept tokens differ.
- geometric_truncate: min(exp(mean_t d_t), cap) on every token of the sequence. No anchor ships
  it (verl's 'geometric' level is a rejection rule only); this project's length-normalised
  sequence TIS, as GSPO's ratio is to the sequence product.

Measurement: `mismatch_stats` keeps per-minibatch sufficient statistics (counts, sums, extrema,
and the ratio's mean and M2 = sum of squared deviations from it), which `combine_mismatch_stats`
merges exactly (Chan et al.'s parallel update for mean and M2) and `mismatch_metrics` finishes.
The spread is never E[r^2] - E[r]^2: that difference cancels catastrophically in fp32 when the
spread is small against the mean (issue 40: r ~ 0.007 +- 0.008 lost 2e-4 of the std).
"""

import math
from typing import Protocol

import chex
import jax
import jax.numpy as jnp

TIS_LEVELS = ("token", "sequence", "geometric")
TIS_MODES = tuple(f"{level}_{kind}" for level in TIS_LEVELS for kind in ("truncate", "mask"))

# How `combine_mismatch_stats` merges each statistic over minibatches; 'chan': jointly with
# num_tokens, ratio_log_mean and ratio_m2 (parallel mean / M2 update).
MISMATCH_REDUCERS = {
    "num_tokens": "sum",
    "abs_diff_sum": "sum",  # sum |trainer - engine|
    "abs_diff_max": "max",
    # The mean of r = exp(trainer - engine) is exp(shift + offset), kept in two parts so that
    # neither loses the low bits of the other: shift is the largest trainer - engine (exact),
    # offset = log mean exp(d - shift) <= 0; both 0 without tokens.
    "ratio_log_shift": "chan",
    "ratio_log_offset": "chan",
    "ratio_m2": "chan",  # sum (r - mean r)^2
    "ratio_min": "min",
    "ratio_max": "max",
    "capped": "sum",  # tokens whose TIS weight was truncated at the cap ('truncate' modes)
    "masked": "sum",  # tokens whose TIS weight was set to 0 ('mask' modes)
}


class TisSettings(Protocol):
    """What the correction reads of a run's loss section (`config.schema.LossConfig` is one),
    passed whole, as `losses.policy_loss` takes its settings."""

    tis_cap: float  # 0 = no correction; else the truncation C >= 1, or the mask's upper bound
    tis_mode: str  # one of TIS_MODES
    tis_mask_low: float  # the mask's lower bound in [0, 1) ('_mask' modes only; 0 = none)


def check_tis(settings: TisSettings) -> tuple[float, str, float]:
    """(cap, mode, low) of `settings`; raises ValueError unless they are a valid correction
    (module docstring)."""
    cap, mode, low = settings.tis_cap, settings.tis_mode, settings.tis_mask_low
    if mode not in TIS_MODES:
        raise ValueError(f"unknown TIS mode {mode!r}; known: {TIS_MODES}")
    if not (cap >= 1 and math.isfinite(cap)):  # also refuses NaN
        # A cap below 1 would scale down (or reject) tokens on which both agree (r = 1).
        raise ValueError(f"TIS cap must be finite and >= 1, got {cap}")
    if not 0 <= low < 1:
        raise ValueError(f"TIS lower bound must lie in [0, 1), got {low}")
    if low > 0 and mode.endswith("_truncate"):
        raise ValueError(f"a TIS lower bound ({low}) only applies to the '_mask' modes, not {mode}")
    return cap, mode, low


def tis_log_ratio(
    old_logps_NxT: jax.Array, engine_logps_NxT: jax.Array, mask_NxT: jax.Array, *, level: str
) -> jax.Array:
    """[N, T] log of the importance ratio of each token at `level` (a sequence's on each of its
    tokens), 0 at masked positions; no gradient."""
    chex.assert_equal_shape([old_logps_NxT, engine_logps_NxT, mask_NxT])
    valid = mask_NxT.astype(bool)
    d = jax.lax.stop_gradient(jnp.where(valid, old_logps_NxT - engine_logps_NxT, 0.0))
    if level == "token":
        return d
    seq_N = jnp.sum(d, axis=-1)
    if level == "geometric":
        seq_N = seq_N / jnp.maximum(jnp.sum(valid, axis=-1), 1).astype(d.dtype)
    elif level != "sequence":
        raise ValueError(f"unknown TIS level {level!r}; known: {TIS_LEVELS}")
    return jnp.where(valid, seq_N[:, None], 0.0)


def _weights(log_ratio_NxT, valid_NxT, *, cap, mode, low):
    """(weights, capped, masked) [N, T] from log-ratios; exp never overflows (r > cap is
    decided on the log scale)."""
    kind = mode.rsplit("_", 1)[1]
    log_cap = math.log(cap)
    r = jnp.exp(jnp.minimum(log_ratio_NxT, log_cap))  # = min(r, cap)
    above = valid_NxT & (log_ratio_NxT > log_cap)
    if kind == "truncate":
        return jnp.where(valid_NxT, r, 0.0), above, jnp.zeros_like(above)
    below = valid_NxT & (log_ratio_NxT < (math.log(low) if low > 0 else -jnp.inf))
    out = above | below
    return jnp.where(valid_NxT & ~out, r, 0.0), jnp.zeros_like(out), out


def tis_weights(
    old_logps_NxT: jax.Array,
    engine_logps_NxT: jax.Array,
    mask_NxT: jax.Array,
    *,
    settings: TisSettings,
) -> jax.Array:
    """Importance weights correcting for the rollout/trainer mismatch, no gradient.

    'token_truncate' is verl's `tis_imp_ratio_cap` and TRL's 'token_truncate': w_t =
    min(exp(d_t), cap). (TRL's default is 'sequence_mask' with cap 3.) The other modes (module
    docstring) take the ratio per sequence (sum or mean of its d_t) and/or reject out-of-bounds
    ratios instead of truncating them; a rejected token's weight is 0 but it stays in the loss's
    normaliser (TRL's semantics, not verl's rejection sampling).

    Args:
      old_logps_NxT: [N, T] trainer log-probs of the sampled tokens (pre-update policy).
      engine_logps_NxT: [N, T] the rollout engine's log-probs of the same tokens.
      mask_NxT: [N, T] bool or {0, 1}, True = a completion token.
      settings: `tis_cap` (here >= 1), `tis_mode`, `tis_mask_low` (`TisSettings`).

    Returns:
      [N, T] float weights, 0 at masked positions and on rejected tokens / sequences.
    """
    cap, mode, low = check_tis(settings)
    lr = tis_log_ratio(old_logps_NxT, engine_logps_NxT, mask_NxT, level=mode.rsplit("_", 1)[0])
    return _weights(lr, mask_NxT.astype(bool), cap=cap, mode=mode, low=low)[0]


def _log_mean_exp(shift, offset, counts):
    """(top, log(sum c exp(shift + offset - top) / sum c)) over entries with count c > 0: the
    log of the count-weighted mean of exp(shift + offset) as an exact shift and an offset.

    Through expm1 when the terms lie near their maximum (ratios ~ 1 apart by 1e-7 keep their
    low bits), through exp when they are spread (each term keeps its relative precision).
    (0, 0) when no entry has a count.
    """
    has = counts > 0
    n = jnp.maximum(jnp.sum(counts), 1.0)
    top = jnp.max(jnp.where(has, shift, -jnp.inf))
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    z = jnp.where(has, (shift - top) + offset, 0.0)
    near = jnp.sum(counts * jnp.expm1(z)) / n  # mean exp(z) - 1: counts sum to n exactly
    far = jnp.sum(counts * jnp.exp(z)) / n
    return top, jnp.where(near > -0.5, jnp.log1p(near), jnp.log(jnp.maximum(far, 1e-38)))


def _deviation(shift, offset, mean_shift, mean_offset):
    """exp(shift + offset) - exp(mean_shift + mean_offset), accurate when the two are close."""
    return jnp.exp(mean_shift + mean_offset) * jnp.expm1(
        (shift - mean_shift) + offset - mean_offset
    )


def mismatch_stats(
    trainer_logps_NxT: jax.Array,
    engine_logps_NxT: jax.Array,
    mask_NxT: jax.Array,
    *,
    settings: TisSettings | None = None,
) -> dict[str, jax.Array]:
    """Sufficient statistics of the trainer/engine log-prob mismatch on the masked tokens.

    Args:
      trainer_logps_NxT: [N, T] trainer log-probs of the sampled tokens.
      engine_logps_NxT: [N, T] the rollout engine's log-probs of the same tokens.
      mask_NxT: [N, T] bool or {0, 1}, True = a token that counts.
      settings: with `tis_cap` not 0, also count the tokens the correction truncates
        ('capped') or rejects ('masked'), as `tis_weights` does; None = no correction.

    Returns:
      float32 scalars keyed as `MISMATCH_REDUCERS` (no gradient); min / max are +inf / -inf
      without any token. Combine with `combine_mismatch_stats`, finish with `mismatch_metrics`.
    """
    chex.assert_equal_shape([trainer_logps_NxT, engine_logps_NxT, mask_NxT])
    valid = mask_NxT.astype(bool)
    m = valid.astype(jnp.float32)
    d = jax.lax.stop_gradient(
        jnp.where(valid, trainer_logps_NxT - engine_logps_NxT, 0.0).astype(jnp.float32)
    )
    ratio = jnp.exp(d)
    shift, offset = _log_mean_exp(d, 0.0, m)
    dev = jnp.where(valid, _deviation(d, 0.0, shift, offset), 0.0)  # r - mean r
    out = {
        "num_tokens": jnp.sum(m),
        "abs_diff_sum": jnp.sum(jnp.abs(d) * m),
        "abs_diff_max": jnp.max(jnp.where(valid, jnp.abs(d), -jnp.inf)),
        "ratio_log_shift": shift,
        "ratio_log_offset": offset,
        "ratio_m2": jnp.sum(jnp.square(dev)),
        "ratio_min": jnp.min(jnp.where(valid, ratio, jnp.inf)),
        "ratio_max": jnp.max(jnp.where(valid, ratio, -jnp.inf)),
    }
    if settings is not None and settings.tis_cap != 0:  # NaN or a cap < 0: an error, not "off"
        cap, mode, low = check_tis(settings)
        level = mode.rsplit("_", 1)[0]
        lr = tis_log_ratio(trainer_logps_NxT, engine_logps_NxT, mask_NxT, level=level)
        _, capped, masked = _weights(lr.astype(jnp.float32), valid, cap=cap, mode=mode, low=low)
        out["capped"] = jnp.sum(capped * m)
        out["masked"] = jnp.sum(masked * m)
    return out


def combine_mismatch_stats(stats_M: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """[M] stacked `mismatch_stats` of M disjoint minibatches -> the statistics of their union.

    Mean and M2 merge as Chan, Golub & LeVeque's parallel update: with n_i tokens, means mu_i and
    M2_i, mu = sum n_i mu_i / n and M2 = sum_i M2_i + sum_i n_i (mu_i - mu)^2.
    """
    reduce = {"sum": jnp.sum, "max": jnp.max, "min": jnp.min}
    out = {
        k: reduce[MISMATCH_REDUCERS[k]](v, axis=0)
        for k, v in stats_M.items()
        if MISMATCH_REDUCERS[k] != "chan"
    }
    if "ratio_m2" in stats_M:
        n_M = stats_M["num_tokens"]
        shift_M, offset_M = stats_M["ratio_log_shift"], stats_M["ratio_log_offset"]
        shift, offset = _log_mean_exp(shift_M, offset_M, n_M)
        dev_M = jnp.where(n_M > 0, _deviation(shift_M, offset_M, shift, offset), 0.0)
        out["ratio_log_shift"], out["ratio_log_offset"] = shift, offset
        out["ratio_m2"] = jnp.sum(stats_M["ratio_m2"]) + jnp.sum(n_M * jnp.square(dev_M))
    return out


def mismatch_metrics(stats: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """`mismatch_stats` (possibly combined) -> the logged metrics.

    mismatch/logp_abs_mean, mismatch/logp_abs_max: mean and max of |trainer - engine|;
    mismatch/ratio_mean, _std (population), _min, _max of r = exp(trainer - engine);
    tis/clipped_frac, tis/masked_frac: share of tokens whose weight the correction truncated /
    rejected (when the stats were taken with a cap).
    Without any token: 0 for the differences and shares, 1 for the ratio (no mismatch measured).
    """
    n = stats["num_tokens"]
    has = n > 0
    n1 = jnp.maximum(n, 1.0)
    out = {
        "mismatch/logp_abs_mean": stats["abs_diff_sum"] / n1,
        "mismatch/logp_abs_max": jnp.where(has, stats["abs_diff_max"], 0.0),
        "mismatch/ratio_mean": jnp.where(
            has, jnp.exp(stats["ratio_log_shift"] + stats["ratio_log_offset"]), 1.0
        ),
        "mismatch/ratio_std": jnp.sqrt(stats["ratio_m2"] / n1),
        "mismatch/ratio_min": jnp.where(has, stats["ratio_min"], 1.0),
        "mismatch/ratio_max": jnp.where(has, stats["ratio_max"], 1.0),
    }
    if "capped" in stats:
        out["tis/clipped_frac"] = stats["capped"] / n1
        out["tis/masked_frac"] = stats["masked"] / n1
    return out
