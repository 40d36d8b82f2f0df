"""Clipped policy-gradient objective with token aggregation modes and KL estimators.

Shape legend (docs/design.md): N rows (completions, B prompts x G) in the (micro)batch, T
completion tokens.

One per-token surrogate serves GRPO, Dr.GRPO and DAPO:

    ratio_t = exp(logp_t - old_logp_t)
    l_t = -min(ratio_t * A, clip(ratio_t, 1 - eps_low, 1 + eps_high) * A) + beta * KL_t

and the variants differ in how l_t is aggregated (see `AGGREGATIONS`). Every mode is a sum of
per-token or per-sequence terms divided by a normaliser, `loss = numerator / denominator`:

    'seq_mean_token_mean'      (GRPO)     sum_n [sum_t m l / sum_t m]  /  #sequences with a token
    'token_mean'               (DAPO)     sum_{n,t} m l                /  sum_{n,t} m
    'seq_mean_token_sum_norm'  (Dr.GRPO)  sum_{n,t} m l                /  (N * max_completion_len)

Exact gradient accumulation: compute the full batch's denominator once with `loss_denominator`
(same mask and mode) and pass it as `normaliser` to every microbatch call. Each microbatch loss is
then its numerator / global denominator, so the sum over microbatches of losses (and of gradients)
equals the full-batch loss (and gradient) exactly; DAPO's token mean uses the global token count.
Without `normaliser` the microbatch's own denominator is used (right for a single batch).

Importance-sampling level (`IS_LEVELS`, TRL's `importance_sampling_level`, verl's `loss_mode`):

    'token'           ratio_t = exp(logp_t - old_logp_t)                          (PPO, GRPO)
    'sequence'        s = exp(mean_t (logp_t - old_logp_t)) on every token of the sequence,
                      clipped per sequence; its gradient flows through the mean    (GSPO)
    'sequence_token'  s_t = sg[s] * exp(logp_t - sg[logp_t]): the value of s, with the gradient
                      of each token's own log-prob                                 (GSPO-token)

(Zheng et al. 2025, "Group Sequence Policy Optimization", eqs. 5-7 and 13-14.) With the
sequence-level advantages used here they have the same loss, and the same gradient as long as
the correction weights w_t (`is_weights_NxT`) are constant within each sequence (none, or a
`sequence_*` / `geometric_*` mode). With token-level weights (`tis_mode='token_*'`) the gradients
differ: for an unclipped sequence i with n_i loss tokens, per unit of the normaliser,

    'sequence'        d loss / d logp_t = -A_i s_i (sum_u w_u) / n_i    (TRL: its sequence-level
                      ratio, gradient through the mean, times its per-token vLLM IS weights)
    'sequence_token'  d loss / d logp_t = -A_i s_i w_t                  (verl's GSPO, whose
                      ratio is this GSPO-token form, times its rollout_is_weights)

Objectives (`OBJECTIVES`): 'ppo_clip' is the clipped surrogate above; 'cispo' (MiniMax-M1, Chen
et al. 2025, eq. 4) replaces it with a REINFORCE term weighted by the clipped ratio, no gradient
through the weight: l_t = -sg[clip(ratio_t, 1 - eps_low, 1 + eps_high)] * A * logp_t (verl
`loss_mode='cispo'`, NeMo-RL; TRL's `loss_type='cispo'` clamps at its `epsilon_high` itself).
Dual clip (`dual_clip_c` = c > 1; verl `clip_ratio_c`, TRL `delta`; Ye et al. 2020) caps the
surrogate of negative-advantage tokens: l_t = min(-A c, l_t) where A < 0, so a token whose ratio
exceeds c adds -A c and no gradient.

Entropy (`entropy_NxT`, the policy's per-token entropy, with its gradient): `entropy_coef`
subtracts coef * H_t from every loss token, aggregated like l_t (verl `entropy_coeff`), and
`top_entropy_quantile` = rho < 1 keeps the policy-gradient term only on the tokens whose entropy
is at least the (1 - rho)-quantile of this call's valid tokens (`high_entropy_mask`; Wang et al.
2025, "Beyond the 80/20 Rule"; TRL `top_entropy_quantile`). The normaliser is unchanged and the
KL term stays on every token, as in TRL; the entropy bonus stays on every token too (as verl),
where TRL's acts only on the kept tokens and is always a token mean (docs/algorithms.md).

The rollout/trainer mismatch (the engine's log-probs against the trainer's) is measured and
corrected in `mismatch`; its importance weights enter `policy_loss` as `is_weights_NxT`.
"""

from typing import Protocol

import chex
import jax
import jax.numpy as jnp

AGGREGATIONS = ("seq_mean_token_mean", "token_mean", "seq_mean_token_sum_norm")
KL_ESTIMATORS = ("k1", "k2", "k3")
IS_LEVELS = ("token", "sequence", "sequence_token")
OBJECTIVES = ("ppo_clip", "cispo")


class LossSettings(Protocol):
    """What `policy_loss` reads of a run's loss section (`config.schema.LossConfig` is one; its
    defaults are configs/base.py's). Passed whole, so that a new option is read where it is used,
    not copied key by key through each caller."""

    eps_low: float  # ratio clip 1 - eps_low ('cispo': its weight's lower bound)
    eps_high: float  # ratio clip 1 + eps_high (DAPO clip-higher)
    aggregation: str  # one of AGGREGATIONS
    beta: float  # KL coefficient (0 = no KL term)
    kl_estimator: str  # one of KL_ESTIMATORS
    importance_sampling_level: str  # one of IS_LEVELS
    objective: str  # one of OBJECTIVES
    dual_clip_c: float  # 0 = off, else c > 1: 'ppo_clip' loss of A < 0 tokens capped at -A c
    top_entropy_quantile: float  # in (0, 1]: the policy-gradient term's share of tokens


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
    mask_NxT: jax.Array, *, aggregation: str, max_completion_len: int | None = None
) -> jax.Array:
    """The normaliser of `policy_loss` for this mask and mode (module docstring), a float scalar.

    Call it on the full batch's mask and pass the result as `normaliser` to each microbatch.
    """
    chex.assert_rank(mask_NxT, 2)
    m = mask_NxT.astype(jnp.float32)
    if aggregation == "seq_mean_token_mean":
        return jnp.sum(jnp.any(mask_NxT, axis=-1)).astype(jnp.float32)
    if aggregation == "token_mean":
        return jnp.sum(m)
    if aggregation == "seq_mean_token_sum_norm":
        length = mask_NxT.shape[1] if max_completion_len is None else max_completion_len
        return jnp.asarray(mask_NxT.shape[0] * length, jnp.float32)
    raise ValueError(f"unknown aggregation {aggregation!r}; known: {AGGREGATIONS}")


def _numerator(loss_NxT: jax.Array, m_NxT: jax.Array, aggregation: str) -> jax.Array:
    """Sum of the per-token losses weighted as `aggregation` prescribes."""
    if aggregation == "seq_mean_token_mean":
        n_N = jnp.sum(m_NxT, axis=-1)
        per_seq_N = jnp.sum(loss_NxT * m_NxT, axis=-1) / jnp.maximum(n_N, 1.0)
        return jnp.sum(per_seq_N)
    return jnp.sum(loss_NxT * m_NxT)


def log_importance_ratio(
    logps_NxT: jax.Array, old_logps_NxT: jax.Array, mask_NxT: jax.Array, *, level: str = "token"
) -> jax.Array:
    """log of the policy ratio each token's surrogate uses, at `level` (module docstring).

    Args:
      logps_NxT: [N, T] log-probs under the current policy (the gradient flows from here).
      old_logps_NxT: [N, T] log-probs under the old policy (no gradient).
      mask_NxT: [N, T] bool or {0, 1}, True = a completion token; the sequence levels average
        over these only.
      level: one of IS_LEVELS.

    Returns:
      [N, T] float log-ratios, 0 at masked positions (with zero gradient there).
    """
    chex.assert_equal_shape([logps_NxT, old_logps_NxT, mask_NxT])
    valid = mask_NxT.astype(bool)
    logps = jnp.where(valid, logps_NxT, 0.0)
    d = logps - jnp.where(valid, jax.lax.stop_gradient(old_logps_NxT), 0.0)
    if level == "token":
        return d
    if level not in IS_LEVELS:
        raise ValueError(f"unknown importance sampling level {level!r}; known: {IS_LEVELS}")
    n_N = jnp.maximum(jnp.sum(valid, axis=-1), 1).astype(d.dtype)
    seq_Nx1 = (jnp.sum(d, axis=-1) / n_N)[:, None]
    if level == "sequence_token":  # value of the sequence's, gradient of each token's log-prob
        seq_Nx1 = jax.lax.stop_gradient(seq_Nx1) + (logps - jax.lax.stop_gradient(logps))
    return jnp.where(valid, seq_Nx1, 0.0)


def high_entropy_mask(entropy_NxT: jax.Array, mask_NxT: jax.Array, *, quantile: float) -> jax.Array:
    """The valid tokens whose entropy is in the top `quantile` share (TRL `top_entropy_quantile`).

    The threshold is the (1 - quantile)-quantile of the entropies of all valid tokens given
    (every row of the call), interpolated linearly between order statistics as
    `torch.quantile`; a token is kept when its entropy is >= the threshold, so ties at the
    threshold are all kept (TRL's `get_high_entropy_mask`). No gradient.

    Args:
      entropy_NxT: [N, T] per-token entropies.
      mask_NxT: [N, T] bool or {0, 1}, True = a loss token.
      quantile: share kept, in (0, 1]; 1 keeps every valid token.

    Returns:
      [N, T] bool, False at masked positions; all False when no token is valid.
    """
    chex.assert_equal_shape([entropy_NxT, mask_NxT])
    valid = mask_NxT.astype(bool)
    h = jax.lax.stop_gradient(entropy_NxT)
    n = jnp.sum(valid)
    sorted_h = jnp.sort(jnp.where(valid, h, jnp.inf).reshape(-1))  # valid ones first
    pos = (1.0 - quantile) * jnp.maximum(n - 1, 0).astype(h.dtype)  # as torch: in h's dtype
    lo = jnp.floor(pos).astype(jnp.int32)
    hi = jnp.minimum(lo + 1, jnp.maximum(n - 1, 0))
    a, b = sorted_h[lo], sorted_h[hi]
    threshold = a + (pos - lo.astype(h.dtype)) * jnp.where(n > 1, b - a, 0.0)
    return valid & (h >= threshold)


def ppo_clip_loss(ratio_NxT, adv_Nx1, *, eps_low: float, eps_high: float, dual_clip_c: float):
    """Per-token -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A); with `dual_clip_c` = c > 1,
    capped at -A c where A < 0 (verl `compute_policy_loss_vanilla`)."""
    clipped = jnp.clip(ratio_NxT, 1.0 - eps_low, 1.0 + eps_high)
    loss_NxT = -jnp.minimum(ratio_NxT * adv_Nx1, clipped * adv_Nx1)
    if dual_clip_c:
        loss_NxT = jnp.where(adv_Nx1 < 0, jnp.minimum(loss_NxT, -adv_Nx1 * dual_clip_c), loss_NxT)
    return loss_NxT


def cispo_loss(logps_NxT, ratio_NxT, adv_Nx1, *, eps_low: float, eps_high: float):
    """Per-token CISPO: -sg[clip(r, 1 - eps_low, 1 + eps_high)] * A * logp (MiniMax-M1 eq. 4)."""
    weight = jax.lax.stop_gradient(jnp.clip(ratio_NxT, 1.0 - eps_low, 1.0 + eps_high))
    return -weight * adv_Nx1 * logps_NxT


def _is_zero(x) -> bool:
    """True for a Python / NumPy scalar equal to 0 (a traced coefficient is never 'off')."""
    return not isinstance(x, jax.Array) and float(x) == 0.0


def _masked_stats(x: jax.Array, valid: jax.Array, m: jax.Array, n: jax.Array) -> dict:
    return {
        "mean": jnp.sum(x * m) / n,
        "min": jnp.min(jnp.where(valid, x, jnp.inf)),
        "max": jnp.max(jnp.where(valid, x, -jnp.inf)),
    }


def policy_loss(
    logps_NxT: jax.Array,
    old_logps_NxT: jax.Array,
    advantages_N: jax.Array,
    mask_NxT: jax.Array,
    *,
    settings: LossSettings,
    ref_logps_NxT: jax.Array | None = None,
    max_completion_len: int | None = None,
    normaliser: jax.Array | float | None = None,
    is_weights_NxT: jax.Array | None = None,
    entropy_NxT: jax.Array | None = None,
    entropy_coef: float | jax.Array = 0.0,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Clipped surrogate (PPO / GRPO / DAPO) or CISPO, with KL penalty and entropy options,
    aggregated as `settings.aggregation` says.

    The ratio is taken against `old_logps_NxT` (the policy that sampled, or the pre-update policy
    when iterations > 1). On the first pass pass `jax.lax.stop_gradient(logps_NxT)`: the ratio is
    then exactly 1 and the gradient is the plain policy gradient. Masked positions are replaced by
    0 before any arithmetic, so they carry no gradient and garbage there (even inf) cannot leak.

    Args:
      logps_NxT: [N, T] float log-probs of the completion tokens under the current policy.
      old_logps_NxT: [N, T] log-probs under the sampling (old) policy; no gradient flows into it.
      advantages_N: [N] per-sequence advantages.
      mask_NxT: [N, T] bool or {0, 1}, True = a completion token that counts.
      settings: the run's loss section whole (`LossSettings`: what each of its keys does is
        there; configs/base.py holds their defaults).
      ref_logps_NxT: [N, T] reference-policy log-probs; required when `settings.beta` > 0.
      max_completion_len: Dr.GRPO's constant length; defaults to T.
      normaliser: global denominator for exact gradient accumulation (module docstring).
      is_weights_NxT: [N, T] rollout/trainer importance weights (`mismatch.tis_weights`), no
        gradient; they multiply the clipped policy-gradient term only, not the KL penalty (as
        verl's TIS, whose KL loss is a separate term). None = no correction (loss unchanged).
      entropy_NxT: [N, T] per-token policy entropy (gradient flows through it); needed by an
        entropy bonus or `settings.top_entropy_quantile` < 1, ignored without them.
      entropy_coef: this call's entropy bonus: loss -= coef * (entropy aggregated as the loss); a
        Python number (0 = off, the graph is then unchanged) or a 0-d array (may be traced: the
        adaptive coefficient). `settings.entropy_coef` is only its start value and is not read.

    Returns:
      (loss, metrics): scalar loss = numerator / (normaliser or denominator); metrics hold
      loss_numerator, loss_denominator, num_tokens, clip_frac_low, clip_frac_high (token means of
      where the clip binds: at the sequence levels every token of a clipped sequence counts),
      kl (token mean; 0 without reference) and ratio_mean/min/max (over tokens). Under 'cispo'
      the clip shares count the tokens whose weight was clipped, whatever the sign of A. With
      the options on, also dual_clip_frac (share of tokens with A < 0 and ratio > c) and
      entropy_kept_frac (share of tokens `high_entropy_mask` keeps).
    """
    chex.assert_rank([logps_NxT, advantages_N], [2, 1])
    n, t = logps_NxT.shape
    chex.assert_shape([old_logps_NxT, mask_NxT], (n, t))
    chex.assert_shape(advantages_N, (n,))
    aggregation, objective = settings.aggregation, settings.objective
    eps_low, eps_high, dual_clip_c = settings.eps_low, settings.eps_high, settings.dual_clip_c
    top_entropy_quantile = settings.top_entropy_quantile
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {aggregation!r}; known: {AGGREGATIONS}")
    if settings.beta != 0.0 and ref_logps_NxT is None:
        raise ValueError("beta > 0 needs ref_logps_NxT")
    if objective not in OBJECTIVES:
        raise ValueError(f"unknown objective {objective!r}; known: {OBJECTIVES}")
    if objective == "cispo" and settings.importance_sampling_level != "token":
        raise ValueError("objective 'cispo' takes token ratios")
    if not 0.0 < top_entropy_quantile <= 1.0:
        raise ValueError(f"top_entropy_quantile must lie in (0, 1], got {top_entropy_quantile}")
    use_entropy = top_entropy_quantile < 1.0 or not _is_zero(entropy_coef)
    if use_entropy and entropy_NxT is None:
        raise ValueError("entropy_coef and top_entropy_quantile < 1 need entropy_NxT")
    valid = mask_NxT.astype(bool)
    m = valid.astype(logps_NxT.dtype)
    logps = jnp.where(valid, logps_NxT, 0.0)
    old = jnp.where(valid, jax.lax.stop_gradient(old_logps_NxT), 0.0)
    adv = advantages_N[:, None]

    level = settings.importance_sampling_level
    ratio = jnp.exp(log_importance_ratio(logps, old, valid, level=level))
    clip = dict(eps_low=eps_low, eps_high=eps_high)
    if objective == "cispo":
        loss_NxT = cispo_loss(logps, ratio, adv, **clip)
    else:
        loss_NxT = ppo_clip_loss(ratio, adv, **clip, dual_clip_c=dual_clip_c)
    if is_weights_NxT is not None:
        chex.assert_shape(is_weights_NxT, (n, t))
        loss_NxT = loss_NxT * jnp.where(valid, jax.lax.stop_gradient(is_weights_NxT), 0.0)
    extra = {}
    if use_entropy:
        chex.assert_shape(entropy_NxT, (n, t))
        entropy = jnp.where(valid, entropy_NxT, 0.0)
    if top_entropy_quantile < 1.0:
        keep = high_entropy_mask(entropy, valid, quantile=top_entropy_quantile)
        loss_NxT = loss_NxT * keep.astype(loss_NxT.dtype)
        extra["entropy_kept_frac"] = jnp.sum(keep * m) / jnp.maximum(jnp.sum(m), 1.0)
    kl = jnp.zeros_like(logps)
    if ref_logps_NxT is not None:
        chex.assert_shape(ref_logps_NxT, (n, t))
        ref = jnp.where(valid, jax.lax.stop_gradient(ref_logps_NxT), 0.0)
        kl = kl_divergence(logps, ref, estimator=settings.kl_estimator)
        loss_NxT = loss_NxT + settings.beta * kl
    if not _is_zero(entropy_coef):
        loss_NxT = loss_NxT - jnp.asarray(entropy_coef, loss_NxT.dtype) * entropy

    num = _numerator(loss_NxT, m, aggregation)
    den = loss_denominator(valid, aggregation=aggregation, max_completion_len=max_completion_len)
    norm = den if normaliser is None else jnp.asarray(normaliser, jnp.float32)
    loss = num / jnp.maximum(norm, 1.0).astype(num.dtype)

    n_tok = jnp.maximum(jnp.sum(m), 1.0)
    # The clip binds (zero gradient) below 1 - eps_low only for A < 0, above 1 + eps_high for A > 0.
    low = (ratio < 1.0 - eps_low) & (adv < 0)
    high = (ratio > 1.0 + eps_high) & (adv > 0)
    if objective == "cispo":  # the weight is clipped whatever the sign of A (the token keeps its
        low, high = ratio < 1.0 - eps_low, ratio > 1.0 + eps_high  # gradient)
    if dual_clip_c:
        extra["dual_clip_frac"] = jnp.sum(((ratio > dual_clip_c) & (adv < 0)) * m) / n_tok
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
        **extra,
    }
    return loss, metrics


_OBJECTIVE_WORDS = {"ppo_clip": "clipped surrogate", "cispo": "CISPO"}
_LEVEL_WORDS = {"token": "token", "sequence": "sequence (GSPO)", "sequence_token": "GSPO-token"}


def describe(settings: LossSettings) -> list[str]:
    """`settings` in words (a run's console header): the objective with its ratio level and clip
    range, the aggregation, then each option that changes the loss, when it is on."""
    s = settings
    level = _LEVEL_WORDS[s.importance_sampling_level]
    clip = f"clip [{1 - s.eps_low:g}, {1 + s.eps_high:g}]"
    out = [f"objective {_OBJECTIVE_WORDS[s.objective]}, {level} ratio, {clip}"]
    out.append(f"loss {s.aggregation}")
    if s.beta > 0:
        out.append(f"KL {s.kl_estimator} beta {s.beta:g}")
    if s.dual_clip_c > 0:
        out.append(f"dual clip c {s.dual_clip_c:g}")
    if s.top_entropy_quantile < 1:
        out.append(f"top {s.top_entropy_quantile:g} entropy tokens")
    return out
