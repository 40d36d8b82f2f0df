"""Group-relative advantages (GRPO, Dr.GRPO, RLOO, batch-std) and the DAPO dynamic-sampling
predicate.

Shape legend: B prompts, G completions per prompt. `...` is any leading batch shape (usually [B]);
the last axis is one group of G completions of the same prompt.

Masks (True = a real completion) make ragged groups exact: statistics are taken over the valid
entries only, and masked entries get advantage 0, so a fully masked group gives all zeros. A group
whose valid rewards are all equal (including a group of one) gets advantage 0 exactly, never NaN:
the test is max == min over the valid entries, not a threshold on the std.
"""

from collections.abc import Callable

import chex
import jax
import jax.numpy as jnp


def _valid(rewards: jax.Array, mask: jax.Array | None) -> jax.Array:
    valid = jnp.ones(rewards.shape, bool) if mask is None else mask.astype(bool)
    chex.assert_shape(valid, rewards.shape)
    return valid


def _count(valid: jax.Array) -> jax.Array:
    return jnp.sum(valid, axis=-1, keepdims=True).astype(jnp.float32)


def masked_mean(rewards: jax.Array, *, mask: jax.Array | None = None) -> jax.Array:
    """[..., G] -> [..., 1] mean over valid entries (0 for a fully masked group)."""
    valid = _valid(rewards, mask)
    total = jnp.sum(jnp.where(valid, rewards, 0.0), axis=-1, keepdims=True)
    return total / jnp.maximum(_count(valid), 1.0).astype(rewards.dtype)


def masked_std(rewards: jax.Array, *, mask: jax.Array | None = None, ddof: int = 1) -> jax.Array:
    """[..., G] -> [..., 1] std over valid entries with divisor max(n - ddof, 1); 0 if n <= ddof."""
    valid = _valid(rewards, mask)
    mean = masked_mean(rewards, mask=valid)
    dev = jnp.where(valid, rewards - mean, 0.0)
    # Squares of the deviations scaled by the largest one: unscaled, |dev| > ~1e19 overflowed the
    # float32 square to inf, the std to inf and every GRPO advantage silently to 0.
    scale = jnp.max(jnp.abs(dev), axis=-1, keepdims=True)
    sq = jnp.sum(jnp.square(dev / jnp.where(scale > 0, scale, 1.0)), axis=-1, keepdims=True)
    var = sq / jnp.maximum(_count(valid) - ddof, 1.0).astype(rewards.dtype)
    # Safe sqrt: a zero variance must give a finite (zero) gradient, not inf * 0.
    return scale * jnp.where(var > 0, jnp.sqrt(jnp.where(var > 0, var, 1.0)), 0.0)


def has_variance(rewards: jax.Array, *, mask: jax.Array | None = None) -> jax.Array:
    """DAPO dynamic sampling: True where a group's valid rewards are not all equal.

    Pass the reward the filter is defined on (DAPO: accuracy). Groups with fewer than two valid
    entries have no variance.

    Args:
      rewards: [..., G] rewards.
      mask: [..., G] bool, True = a real completion.

    Returns:
      [...] bool.
    """
    valid = _valid(rewards, mask)
    hi = jnp.max(jnp.where(valid, rewards, -jnp.inf), axis=-1)
    lo = jnp.min(jnp.where(valid, rewards, jnp.inf), axis=-1)
    return jnp.any(valid, axis=-1) & (hi > lo)


def varying_groups_mask(rewards: jax.Array, *, mask: jax.Array | None = None) -> jax.Array:
    """Uniform-group guard: the valid entries of groups whose valid rewards are not all equal.

    This project's variant, not MMR-GRPO's (issue 26): pass the raw rewards, and use the result
    as the mask of the reweighting and of the advantages. A group whose raw rewards are all
    equal then gets advantage 0, as in plain GRPO, and takes no part in the reweighting (in batch
    scope it neither sets lambda nor enters the greedy pass); only groups whose rewards differ
    are reweighted. Without it MMR's redundancy term gives such groups unit-size advantages
    after normalisation (docs/study_cpu.md, "A mechanism").

    Args:
      rewards: [..., G] raw rewards (before any reweighting).
      mask: [..., G] bool, True = a real completion; None = all valid.

    Returns:
      [..., G] bool.
    """
    valid = _valid(rewards, mask)
    return valid & has_variance(rewards, mask=valid)[..., None]


def _finish(adv: jax.Array, rewards: jax.Array, valid: jax.Array) -> jax.Array:
    """Zeroes masked entries and zero-variance groups."""
    varies = has_variance(rewards, mask=valid)[..., None]
    return jnp.where(valid & varies, adv, 0.0)


Estimator = Callable[..., jax.Array]
ESTIMATORS: dict[str, Estimator] = {}


def register(name: str) -> Callable[[Estimator], Estimator]:
    """Decorator: `ESTIMATORS[name] = fn`; fn(rewards, *, mask, **options) -> advantages."""

    def deco(fn: Estimator) -> Estimator:
        if name in ESTIMATORS:
            raise ValueError(f"advantage estimator {name!r} is already registered")
        ESTIMATORS[name] = fn
        return fn

    return deco


@register("grpo")
def grpo_advantages(
    rewards: jax.Array, *, mask: jax.Array | None = None, ddof: int = 1, eps: float = 1e-4
) -> jax.Array:
    """GRPO: A_i = (r_i - mean(r)) / (std(r) + eps) within each group.

    Shao et al. 2024 (DeepSeekMath), MMR-GRPO eq. 1. Defaults ddof=1, eps=1e-4 follow the
    method's released code (torch.std is unbiased; TRL adds 1e-4).

    Args:
      rewards: [..., G] (possibly MMR-reweighted) rewards.
      mask: [..., G] bool, True = a real completion; masked entries get 0.
      ddof: std divisor is n - ddof (n valid entries); groups with n <= ddof get 0.
      eps: added to the std.

    Returns:
      [..., G] advantages, dtype of `rewards`.
    """
    valid = _valid(rewards, mask)
    mean = masked_mean(rewards, mask=valid)
    std = masked_std(rewards, mask=valid, ddof=ddof)
    return _finish((rewards - mean) / (std + eps), rewards, valid)


@register("dr_grpo")
def dr_grpo_advantages(rewards: jax.Array, *, mask: jax.Array | None = None) -> jax.Array:
    """Dr.GRPO: A_i = r_i - mean(r) within each group, no std normalisation.

    Liu et al. 2025 ("Understanding R1-Zero-Like Training").

    Args:
      rewards: [..., G] rewards.
      mask: [..., G] bool, True = a real completion; masked entries get 0.

    Returns:
      [..., G] advantages.
    """
    valid = _valid(rewards, mask)
    return _finish(rewards - masked_mean(rewards, mask=valid), rewards, valid)


@register("rloo")
def rloo_advantages(rewards: jax.Array, *, mask: jax.Array | None = None) -> jax.Array:
    """RLOO: A_i = r_i - mean_{j != i} r_j over the other valid entries of the group.

    Kool et al. 2019; Ahmadian et al. 2024 ("Back to Basics"); verl `adv_estimator='rloo'`,
    OpenRLHF, tunix. Equal to n / (n - 1) * (r_i - mean(r)) with n valid entries. A group of
    fewer than two valid entries has no leave-one-out baseline and gets 0 (verl instead passes
    a lone completion its raw reward).

    Args:
      rewards: [..., G] rewards.
      mask: [..., G] bool, True = a real completion; masked entries get 0 and are no baseline.

    Returns:
      [..., G] advantages.
    """
    valid = _valid(rewards, mask)
    n = _count(valid).astype(rewards.dtype)
    scale = n / jnp.maximum(n - 1.0, 1.0)
    return _finish(scale * (rewards - masked_mean(rewards, mask=valid)), rewards, valid)


@register("batch_std")
def batch_std_advantages(
    rewards: jax.Array, *, mask: jax.Array | None = None, ddof: int = 1, eps: float = 1e-4
) -> jax.Array:
    """Group-mean-centred rewards over one std of the whole batch: (r_i - mean_group) / (std + eps).

    TRL `scale_rewards='batch'`: the std of the rewards over every valid entry of every group of
    the call, ddof and eps as `grpo_advantages`. REINFORCE++-baseline (Hu et al. 2025; verl
    `reinforce_plus_plus_baseline`) is close but not equal: it divides the centred values by
    their own std, token-weighted, and re-centres them. Pass the whole step's batch: the std is
    global only over what it is given (the trainer's `experience.compute_advantages` is).

    Args:
      rewards: [..., G] (possibly MMR-reweighted) rewards; all leading axes form the batch.
      mask: [..., G] bool, True = a real completion; masked entries get 0 and are left out of
        both the group means and the batch std.
      ddof: the batch std's divisor is n - ddof over the n valid entries of the batch.
      eps: added to the std.

    Returns:
      [..., G] advantages.
    """
    valid = _valid(rewards, mask)
    std = masked_std(rewards.reshape(1, -1), mask=valid.reshape(1, -1), ddof=ddof)[0, 0]
    centred = rewards - masked_mean(rewards, mask=valid)
    return _finish(centred / (std + eps), rewards, valid)
