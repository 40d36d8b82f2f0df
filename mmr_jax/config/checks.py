"""A ConfigDict made typed and checked: `from_config_dict`, the choices and cross-field rules
(`validate`), and the valid-but-surprising combinations a run warns about (`advisories`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from mmr_jax.algorithms import advantages, losses, mismatch, mmr
from mmr_jax.config import schema
from mmr_jax.models import config as model_config
from mmr_jax.models import sharding

# Each choice is written once: where a registry implements the choices (the estimators, the
# reweighters, the objectives, ...), the allowed names are that registry's (a registry dict is read
# when a config is checked, so an entry registered later is a valid choice without a second edit).
# The rest have no registry to read.
_CHOICES = {
    ("rollout", "engine"): ("embedded", "vllm"),
    ("rollout", "off_policy_lag"): (0, 1),
    ("model", "remat"): model_config.REMAT_POLICIES,
    ("model", "attention_impl"): model_config.ATTENTION_IMPLS,
    ("model", "frozen_dtype"): ("", "float32", "bfloat16", "float16"),
    ("model", "init"): ("pretrained", "random"),
    ("advantage", "estimator"): advantages.ESTIMATORS,
    ("loss", "objective"): losses.OBJECTIVES,
    ("loss", "aggregation"): losses.AGGREGATIONS,
    ("loss", "kl_estimator"): losses.KL_ESTIMATORS,
    ("loss", "importance_sampling_level"): losses.IS_LEVELS,
    ("loss", "tis_mode"): mismatch.TIS_MODES,
    ("reweight", "method"): mmr.REWEIGHTERS,
    ("reweight", "scope"): mmr.SCOPES,
    ("rewards", "cosine_form"): ("tokens", "released"),
    ("eval", "source"): ("benchmarks", "arithmetic", "task"),
    ("mesh", "over_hosts"): sharding.OVER_HOSTS,
}
ARITHMETIC_OPS = ("+", "-", "*")  # the operators `problems.data.arithmetic_problems` draws


def plain(value):
    """ConfigDict / FieldReference / list -> dict / scalar / tuple."""
    if hasattr(value, "to_dict"):
        value = value.to_dict()
    if hasattr(value, "get") and callable(value.get) and not isinstance(value, Mapping):
        value = value.get()  # FieldReference
    if isinstance(value, Mapping):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return tuple(plain(v) for v in value)
    return value


def _build(cls, values: Mapping[str, Any], where: str):
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - set(fields))
    missing = sorted(set(fields) - set(values))
    if unknown or missing:
        raise schema.ConfigError(
            f"config section {where!r}: unknown keys {unknown}, missing keys {missing}; "
            f"valid keys: {sorted(fields)}"
        )
    kwargs = {}
    for name, value in values.items():
        sub = _SECTIONS.get(name) if cls is schema.TrainConfig else None
        if sub is not None:
            if not isinstance(value, Mapping):
                raise ValueError(f"config section {name!r} must be a dict, got {value!r}")
            value = _build(sub, value, name)
        elif name == "weights":
            value = {str(k): float(v) for k, v in value.items()}
        kwargs[name] = value
    return cls(**kwargs)


_SECTIONS = {
    "model": schema.ModelConfig,
    "lora": schema.LoraConfig,
    "optim": schema.OptimConfig,
    "batch": schema.BatchConfig,
    "rollout": schema.RolloutConfig,
    "rewards": schema.RewardsConfig,
    "advantage": schema.AdvantageConfig,
    "loss": schema.LossConfig,
    "reweight": schema.ReweightConfig,
    "dynamic_sampling": schema.DynamicSamplingConfig,
    "data": schema.DataConfig,
    "eval": schema.EvalConfig,
    "checkpoint": schema.CheckpointConfig,
    "logging": schema.LoggingConfig,
    "mesh": schema.MeshConfig,
}


def validate(cfg: schema.TrainConfig) -> schema.TrainConfig:
    """Checks choices and cross-field constraints; returns `cfg`."""
    for (section, key), choices in _CHOICES.items():
        value = getattr(getattr(cfg, section), key)
        if value not in choices:
            raise schema.ConfigError(
                f"config {section}.{key}={value!r}; expected one of {tuple(choices)}"
            )
    ops = cfg.data.arithmetic_ops
    if not ops or not set(ops) <= set(ARITHMETIC_OPS):
        raise schema.ConfigError(
            f"config data.arithmetic_ops={tuple(ops)!r}; expected operators among "
            f"{ARITHMETIC_OPS}, e.g. --config.data.arithmetic_ops=\"('+', '-')\""
        )
    rw = cfg.reweight
    if rw.lam is not None and not 0.0 <= rw.lam <= 1.0:
        raise schema.ConfigError(f"reweight.lam={rw.lam} must lie in [0, 1] (or None for adaptive)")
    if rw.lam is not None and rw.method == "dra":
        raise schema.ConfigError("reweight.lam is MMR's; reweight.method='dra' takes none")
    if cfg.rows_per_step % cfg.loss.minibatches:
        raise schema.ConfigError(
            f"loss.minibatches={cfg.loss.minibatches} must divide "
            "batch.prompts * batch.generations "
            f"= {cfg.rows_per_step}"
        )
    b = cfg.batch
    if b.pack_max_len < 0 or 0 < b.pack_max_len < b.max_completion_len - 1:
        # A completion of T tokens is T - 1 packed inputs: the longest must fit one packed row.
        raise schema.ConfigError(
            f"batch.pack_max_len={b.pack_max_len} must be 0 (no packing) or at least "
            f"batch.max_completion_len - 1 = {b.max_completion_len - 1}"
        )
    if cfg.model.attention_impl == "pallas_tpu" and b.shared_prompt and b.pack_max_len:
        # splash's segment ids cannot let every packed completion see its prompt's keys
        raise schema.ConfigError(
            "model.attention_impl='pallas_tpu' (splash) takes no packed completions (its segment "
            "ids cannot let each see its prompt's keys too): set batch.pack_max_len=0, or "
            "attention_impl='auto' (on a TPU 'unfused' when packed)"
        )
    if not cfg.batch.compile_price_steps >= 0:  # also refuses NaN
        raise schema.ConfigError(
            f"batch.compile_price_steps={cfg.batch.compile_price_steps} must be >= 0 "
            "(0: compile every packed length a step needs)"
        )
    if cfg.batch.min_bucket_len < 1:
        raise schema.ConfigError(f"batch.min_bucket_len={cfg.batch.min_bucket_len} must be >= 1")
    loss = cfg.loss
    if not (loss.tis_cap == 0 or 1 <= loss.tis_cap < float("inf")):  # also refuses NaN
        # w = min(pi_trainer / pi_engine, cap): a cap below 1 would scale down tokens on which
        # both agree (w = 1), which is no truncation of the importance weight.
        raise schema.ConfigError(
            f"loss.tis_cap={loss.tis_cap} must be 0 (off) or finite and >= 1 (verl/TRL use 2)"
        )
    if not 0 <= loss.tis_mask_low < 1:  # also refuses NaN
        raise schema.ConfigError(f"loss.tis_mask_low={loss.tis_mask_low} must lie in [0, 1)")
    if loss.tis_mask_low > 0 and not (loss.tis_cap > 0 and loss.tis_mode.endswith("_mask")):
        raise schema.ConfigError(
            f"loss.tis_mask_low={loss.tis_mask_low} needs a '_mask' loss.tis_mode and "
            f"loss.tis_cap > 0 (got tis_mode={loss.tis_mode!r}, tis_cap={loss.tis_cap})"
        )
    if loss.tis_mode != "token_truncate" and loss.tis_cap == 0:
        raise schema.ConfigError(
            f"loss.tis_mode={loss.tis_mode!r} needs loss.tis_cap >= 1 (0 = off)"
        )
    _validate_objective(loss)
    if cfg.loss.iterations < 1 or cfg.total_steps < 1:
        raise schema.ConfigError("loss.iterations and total_steps must be >= 1")
    _validate_issue47(cfg)
    if cfg.model.init == "random" and cfg.rollout.engine != "embedded":
        raise schema.ConfigError(
            "model.init='random' needs rollout.engine='embedded' (a vLLM server loads model.path)"
        )
    if cfg.model.init == "random" and cfg.checkpoint.export_hf:
        raise schema.ConfigError(
            "model.init='random' has no tokenizer files to export: export_hf=False"
        )
    if not any(cfg.rewards.weights.values()):
        raise schema.ConfigError(
            f"rewards.weights={dict(cfg.rewards.weights)} has no non-zero weight"
        )
    ds = cfg.dynamic_sampling
    if ds.enabled and ds.filter_reward not in cfg.rewards.weights:
        raise schema.ConfigError(
            f"dynamic_sampling.filter_reward={ds.filter_reward!r} is not among rewards.weights "
            f"{sorted(cfg.rewards.weights)}"
        )
    return cfg


def _validate_issue47(cfg: schema.TrainConfig) -> None:
    """Updates per batch, the adaptive entropy coefficient and the overlong punishment."""
    loss = cfg.loss
    if loss.updates_per_batch < 1 or loss.minibatches % loss.updates_per_batch:
        raise schema.ConfigError(
            f"loss.updates_per_batch={loss.updates_per_batch} must be >= 1 and divide "
            f"loss.minibatches={loss.minibatches} (each update takes whole minibatches)"
        )
    if not (loss.entropy_target >= 0 and abs(loss.entropy_coef) < float("inf")):  # and NaN
        raise schema.ConfigError(
            f"loss.entropy_target={loss.entropy_target} must be >= 0 (0: fixed coefficient) "
            f"and loss.entropy_coef={loss.entropy_coef} finite"
        )
    if loss.entropy_target > 0 and not (
        loss.entropy_coef_step > 0
        and 0 <= loss.entropy_coef_min <= loss.entropy_coef <= loss.entropy_coef_max < float("inf")
    ):
        raise schema.ConfigError(
            f"adaptive entropy (loss.entropy_target={loss.entropy_target}) needs "
            f"loss.entropy_coef_step={loss.entropy_coef_step} > 0 and 0 <= "
            f"loss.entropy_coef_min={loss.entropy_coef_min} <= loss.entropy_coef="
            f"{loss.entropy_coef} (its start) <= loss.entropy_coef_max={loss.entropy_coef_max}"
        )
    r = cfg.rewards
    l_max = r.overlong_max_len or cfg.batch.max_completion_len
    if r.overlong_max_len < 0 or not 0 <= r.overlong_cache_len <= l_max:
        raise schema.ConfigError(
            f"rewards.overlong_cache_len={r.overlong_cache_len} must lie in [0, L_max={l_max}] "
            f"(rewards.overlong_max_len={r.overlong_max_len}, 0 = batch.max_completion_len)"
        )


def check_processes(cfg: schema.TrainConfig, processes: int) -> None:
    """The rules that depend on the number of processes the run spans (`jax.process_count()`)."""
    if cfg.rollout.off_policy_lag and processes > 1:
        # A background rollout's gathers would interleave with the update's collectives.
        raise schema.ConfigError(
            f"rollout.off_policy_lag={cfg.rollout.off_policy_lag} runs on one process only "
            f"(this run has {processes})"
        )


def advisories(cfg: schema.TrainConfig) -> list[str]:
    """Valid but easily unintended combinations, one line each, logged when a run starts."""
    out = []
    if cfg.rollout.off_policy_lag > 0 and cfg.loss.tis_cap == 0:
        out.append(
            f"rollout.off_policy_lag={cfg.rollout.off_policy_lag} with loss.tis_cap=0: training "
            "on samples one weight version stale, uncorrected (set loss.tis_cap, e.g. 2, to "
            "weight them by pi_trainer / pi_engine; docs/off_policy.md)"
        )
    several = cfg.loss.iterations * cfg.loss.updates_per_batch > 1
    if cfg.lora.enabled and cfg.lora.dropout > 0 and several:
        out.append(
            f"lora.dropout={cfg.lora.dropout} is not applied in the train step: with several "
            "updates per batch its noise against the dropout-free old log-probs rivals GSPO's "
            "clip band (docs/algorithms.md); set lora.dropout=0 to silence this"
        )
    return out


def _validate_objective(loss: schema.LossConfig) -> None:
    """The objective options (`losses.policy_loss`) and the combinations they refuse."""
    if loss.objective == "cispo":
        if loss.importance_sampling_level != "token":
            raise schema.ConfigError(
                "loss.objective='cispo' weights each token by its own clipped ratio; it does not "
                f"combine with loss.importance_sampling_level={loss.importance_sampling_level!r}"
            )
        if not (0 <= loss.eps_low <= 1 and loss.eps_high >= 0):  # also refuses NaN
            raise schema.ConfigError(
                f"loss.objective='cispo' clips its weight to [1 - eps_low, 1 + eps_high]: needs "
                f"0 <= loss.eps_low <= 1 (1 = no lower bound) and loss.eps_high >= 0, got "
                f"{loss.eps_low}, {loss.eps_high}"
            )
    c = loss.dual_clip_c
    if not (c == 0 or (1 < c < float("inf") and loss.objective == "ppo_clip")):  # NaN refused
        raise schema.ConfigError(
            f"loss.dual_clip_c={c} must be 0 (off) or finite and > 1 (verl: 3), and it caps the "
            f"'ppo_clip' surrogate only (loss.objective={loss.objective!r})"
        )
    if not 0 <= loss.entropy_coef < float("inf"):
        raise schema.ConfigError(f"loss.entropy_coef={loss.entropy_coef} must be finite and >= 0")
    if not 0 < loss.top_entropy_quantile <= 1:
        raise schema.ConfigError(
            f"loss.top_entropy_quantile={loss.top_entropy_quantile} must lie in (0, 1] (1 = off)"
        )


# Keys renamed since runs were stored, old dotted name -> new: a stored run resumes under the new
# name (`upgrade`), and a command line that names the old one is told the new (`command_line`).
RENAMED = {"mesh.layout": "mesh.over_hosts"}  # issue 53: "layout" is the train step's batch's


def upgrade(stored: Mapping[str, Any]) -> dict[str, Any]:
    """A config dict stored by an older version (a run.json) in today's keys: each `RENAMED` key
    under its new name; and, stored before the `reweight` section, `mmr.enabled` ->
    `reweight.method='mmr'`, `dra.enabled` -> `reweight.method='dra'`, the other `mmr.*` keys ->
    `reweight.*`. Others unchanged; `stored` is not modified."""
    out = {k: dict(v) if isinstance(v, Mapping) else v for k, v in stored.items()}
    for old, new in RENAMED.items():
        (section, key), (new_section, new_key) = old.split("."), new.split(".")
        if isinstance(out.get(section), dict) and key in out[section]:
            out.setdefault(new_section, {})[new_key] = out[section].pop(key)
    if "mmr" not in out and "dra" not in out:
        return out
    mmr, dra = dict(out.pop("mmr", {})), dict(out.pop("dra", {}))
    on = mmr.pop("enabled", False), dra.pop("enabled", False)
    out["reweight"] = {"method": "mmr" if on[0] else "dra" if on[1] else "none", **mmr}
    return out


def from_config_dict(config) -> schema.TrainConfig:
    """ConfigDict (or nested dict, also one stored by an older version: `upgrade`) -> validated
    `schema.TrainConfig`."""
    return validate(_build(schema.TrainConfig, upgrade(plain(config)), "<root>"))
