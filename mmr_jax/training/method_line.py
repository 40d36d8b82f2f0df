"""The console header's method line: what a run's config trains, in words.

One line naming the reweighting (MMR with its scope and lambda, DRA, or none), the advantage
estimator, the loss in the words of the module that computes it (`losses.describe`: the objective
with its ratio level and clip range, the aggregation, KL, dual clip, top-entropy tokens), and each
other option that changes the update when it is on (entropy bonus, the mismatch correction,
passes and updates, DAPO dynamic sampling, off-policy rollouts, LoRA). A CISPO + RLOO + MMR run
reads as such, not as plain CISPO.
"""

from __future__ import annotations

from mmr_jax.algorithms import losses
from mmr_jax.config import schema

_ESTIMATORS = {
    "grpo": "GRPO (r - mean) / std",
    "dr_grpo": "Dr.GRPO r - mean",
    "rloo": "RLOO r - mean of the others",
    "batch_std": "(r - group mean) / batch std",
}


def _reweighting(cfg: schema.TrainConfig) -> str:
    if cfg.reweight.method == "mmr":
        lam = "adaptive lambda" if cfg.reweight.lam is None else f"lambda {cfg.reweight.lam:g}"
        return f"MMR ({cfg.reweight.scope} scope, {lam}, {cfg.reweight.embedding_model})"
    if cfg.reweight.method == "dra":
        return f"DRA ({cfg.reweight.embedding_model})"
    return "none"


def _update_options(loss: schema.LossConfig) -> list[str]:
    """The options of the update outside the loss's own (`losses.describe`), each when it is on."""
    out = []
    if loss.entropy_coef > 0:
        target = f", adaptive to {loss.entropy_target:g} nats" if loss.entropy_target > 0 else ""
        out.append(f"entropy bonus {loss.entropy_coef:g}{target}")
    if loss.tis_cap > 0:
        out.append(f"mismatch {loss.tis_mode} cap {loss.tis_cap:g}")
    if loss.iterations > 1 or loss.updates_per_batch > 1:
        out.append(f"{loss.iterations} pass(es) x {loss.updates_per_batch} update(s) per batch")
    return out


def method_line(cfg: schema.TrainConfig) -> str:
    """'reweighting ... | advantages ... | objective ... | loss ...[ | options]' of `cfg`."""
    parts = [
        f"reweighting {_reweighting(cfg)}",
        f"advantages {_ESTIMATORS.get(cfg.advantage.estimator, cfg.advantage.estimator)}",
        *losses.describe(cfg.loss),  # objective, aggregation, the loss's options
    ]
    options = _update_options(cfg.loss)
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
