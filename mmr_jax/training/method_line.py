"""The console header's method line: what a run's config trains, in words.

One line naming the reweighting (MMR with its scope and lambda, DRA, or none), the advantage
estimator, the objective with its ratio level and clip range, the loss aggregation, and each
option that changes the update when it is on (KL, dual clip, entropy bonus, top-entropy tokens,
the mismatch correction, DAPO dynamic sampling, off-policy rollouts, LoRA). A CISPO + RLOO + MMR
run reads as such, not as plain CISPO.
"""

from __future__ import annotations

from mmr_jax.config import schema

_ESTIMATORS = {
    "grpo": "GRPO (r - mean) / std",
    "dr_grpo": "Dr.GRPO r - mean",
    "rloo": "RLOO r - mean of the others",
    "batch_std": "(r - group mean) / batch std",
}
_OBJECTIVES = {"ppo_clip": "clipped surrogate", "cispo": "CISPO"}
_RATIO_LEVELS = {"token": "token", "sequence": "sequence (GSPO)", "sequence_token": "GSPO-token"}


def _reweighting(cfg: schema.TrainConfig) -> str:
    if cfg.reweight.method == "mmr":
        lam = "adaptive lambda" if cfg.reweight.lam is None else f"lambda {cfg.reweight.lam:g}"
        return f"MMR ({cfg.reweight.scope} scope, {lam}, {cfg.reweight.embedding_model})"
    if cfg.reweight.method == "dra":
        return f"DRA ({cfg.reweight.embedding_model})"
    return "none"


def _loss_options(loss: schema.LossConfig) -> list[str]:
    """The options that change the update, each when it is on."""
    out = []
    if loss.beta > 0:
        out.append(f"KL {loss.kl_estimator} beta {loss.beta:g}")
    if loss.dual_clip_c > 0:
        out.append(f"dual clip c {loss.dual_clip_c:g}")
    if loss.entropy_coef > 0:
        target = f", adaptive to {loss.entropy_target:g} nats" if loss.entropy_target > 0 else ""
        out.append(f"entropy bonus {loss.entropy_coef:g}{target}")
    if loss.top_entropy_quantile < 1:
        out.append(f"top {loss.top_entropy_quantile:g} entropy tokens")
    if loss.tis_cap > 0:
        out.append(f"mismatch {loss.tis_mode} cap {loss.tis_cap:g}")
    if loss.iterations > 1 or loss.updates_per_batch > 1:
        out.append(f"{loss.iterations} pass(es) x {loss.updates_per_batch} update(s) per batch")
    return out


def method_line(cfg: schema.TrainConfig) -> str:
    """'reweighting ... | advantages ... | objective ... | loss ...[ | options]' of `cfg`."""
    loss = cfg.loss
    objective = (
        f"{_OBJECTIVES.get(loss.objective, loss.objective)}, "
        f"{_RATIO_LEVELS.get(loss.importance_sampling_level, loss.importance_sampling_level)} "
        f"ratio, clip [{1 - loss.eps_low:g}, {1 + loss.eps_high:g}]"
    )
    parts = [
        f"reweighting {_reweighting(cfg)}",
        f"advantages {_ESTIMATORS.get(cfg.advantage.estimator, cfg.advantage.estimator)}",
        f"objective {objective}",
        f"loss {loss.aggregation}",
    ]
    options = _loss_options(loss)
    if cfg.reweight.uniform_group_guard:
        options.append("uniform-group guard")
    if cfg.dynamic_sampling.enabled:
        ds = cfg.dynamic_sampling
        options.append(
            f"DAPO dynamic sampling on {ds.filter_reward} (<= {ds.max_generation_batches} rounds)"
        )
    if cfg.rollout.off_policy_lag:
        options.append(f"off-policy lag {cfg.rollout.off_policy_lag}")
    if cfg.lora.enabled:
        options.append(f"LoRA r {cfg.lora.rank}")
    return " | ".join(parts + options)
