"""Typed, frozen views of a training config.

`from_config_dict` converts the ml_collections ConfigDict once, at the edge (`scripts/train.py`);
everything downstream receives these dataclasses. Each section mirrors a block of `configs/base.py`
key for key: a key missing on either side fails with the valid keys listed.
"""

from __future__ import annotations

import ast
import dataclasses
import json
from collections.abc import Mapping
from typing import Any

from mmr_jax.models import config as model_config


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    path: str
    dtype: str = "bfloat16"
    param_dtype: str = "float32"
    remat: str = "full"  # remat policy of the scanned layer (models.config.REMAT_POLICIES)
    logprob_chunk: int = 512
    attention_impl: str = "auto"  # training forwards' attention (models.config.ATTENTION_IMPLS)
    frozen_dtype: str = ""  # frozen base weights under LoRA ('' = param_dtype)
    init: str = "pretrained"  # or "random": random weights of the architecture at path

    def __post_init__(self):
        # Configs stored before policies had names say True / False (= full / none).
        object.__setattr__(self, "remat", model_config.remat_policy_name(self.remat))


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    enabled: bool = False
    rank: int = 64
    alpha: float = 128.0
    dropout: float = 0.05
    targets: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    lr: float = 1e-6
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    warmup_ratio: float = 0.1
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0


@dataclasses.dataclass(frozen=True)
class BatchConfig:
    prompts: int = 8
    generations: int = 6
    max_prompt_len: int = 512
    max_completion_len: int = 3584
    shared_prompt: bool = True
    min_bucket_len: int = 16
    pack_max_len: int = 4096
    compile_price_steps: float = 1.0


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    engine: str = "embedded"
    url: str = ""
    server_venv: str = ""
    model_name: str = ""
    timeout_s: float = 600.0
    max_retries: int = 5
    ready_timeout_s: float = 900.0
    temperature: float = 0.7
    top_p: float = 1.0
    top_k: int = 0
    sync_dir: str = ""
    off_policy_lag: int = 0


@dataclasses.dataclass(frozen=True)
class RewardsConfig:
    weights: Mapping[str, float] = dataclasses.field(default_factory=dict)
    cosine_form: str = "tokens"
    accuracy_number_only: bool = False
    overlong_max_len: int = 0  # DAPO's L_max (0 = batch.max_completion_len)
    overlong_cache_len: int = 0  # DAPO's L_cache (0 = L_max // 5)


@dataclasses.dataclass(frozen=True)
class AdvantageConfig:
    estimator: str = "grpo"
    std_ddof: int = 1
    eps: float = 1e-4


@dataclasses.dataclass(frozen=True)
class LossConfig:
    eps_low: float = 0.2
    eps_high: float = 0.2
    aggregation: str = "seq_mean_token_mean"
    beta: float = 0.04
    kl_estimator: str = "k3"
    iterations: int = 1
    minibatches: int = 8
    updates_per_batch: int = 1
    mask_truncated_completions: bool = False
    entropy_coef: float = 0.0
    entropy_target: float = 0.0
    entropy_coef_step: float = 0.005
    entropy_coef_min: float = 0.0
    entropy_coef_max: float = 0.01
    tis_cap: float = 0.0
    tis_mode: str = "token_truncate"
    tis_mask_low: float = 0.0
    importance_sampling_level: str = "token"
    objective: str = "ppo_clip"
    dual_clip_c: float = 0.0
    entropy_coef: float = 0.0
    top_entropy_quantile: float = 1.0


@dataclasses.dataclass(frozen=True)
class MmrConfig:
    enabled: bool = False
    lam: float | None = None
    scope: str = "group"
    uniform_group_guard: bool = False
    embedding_model: str = "jinaai/jina-embeddings-v2-small-en"
    embedding_max_length: int = 512
    embedding_batch_size: int = 64


@dataclasses.dataclass(frozen=True)
class DraConfig:
    enabled: bool = False


@dataclasses.dataclass(frozen=True)
class DynamicSamplingConfig:
    enabled: bool = False
    filter_reward: str = "accuracy"
    max_generation_batches: int = 10


@dataclasses.dataclass(frozen=True)
class DataConfig:
    source: str = ""
    split: str = "train"
    problem_field: str = "problem"
    answer_field: str = "answer"
    arithmetic_max_operand: int = 50
    arithmetic_ops: tuple[str, ...] = ("+", "-", "*")
    system_prompt: str = ""


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    every: int = 50
    data_dir: str = ""
    benchmarks: tuple[str, ...] = ()
    max_problems: int = 0
    n: int = 16
    temperature: float = 0.6
    top_p: float = 0.95
    max_new_tokens: int = 3584
    system_prompt: str = ""
    source: str = "benchmarks"
    arithmetic_problems: int = 64
    arithmetic_seed: int = 777_777
    number_only: bool = False
    at_start: bool = False


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    every: int = 50
    at_end: bool = True  # also save after the last step
    keep: int = 3
    keep_period: int = 0
    export_hf: bool = False


@dataclasses.dataclass(frozen=True)
class LoggingConfig:
    every: int = 1
    tensorboard: bool = True
    samples: int = 2


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    shape: tuple[int, ...] = (1, -1, 1)
    layout: str = "hybrid"  # several hosts: fsdp / tensor within a host (sharding.device_grid)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """The whole run. `reweighting` is derived: 'mmr' | 'dra' | 'none'."""

    name: str
    seed: int
    total_steps: int
    model: ModelConfig
    lora: LoraConfig
    optim: OptimConfig
    batch: BatchConfig
    rollout: RolloutConfig
    rewards: RewardsConfig
    advantage: AdvantageConfig
    loss: LossConfig
    mmr: MmrConfig
    dra: DraConfig
    dynamic_sampling: DynamicSamplingConfig
    data: DataConfig
    eval: EvalConfig
    checkpoint: CheckpointConfig
    logging: LoggingConfig
    mesh: MeshConfig

    @property
    def reweighting(self) -> str:
        return "mmr" if self.mmr.enabled else "dra" if self.dra.enabled else "none"

    @property
    def rows_per_step(self) -> int:
        return self.batch.prompts * self.batch.generations

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict (tuples as lists), the form stored in the run metadata."""
        return json.loads(json.dumps(dataclasses.asdict(self), default=dict))


class ConfigError(ValueError):
    """A config value is out of range or contradicts another."""


_CHOICES = {
    ("rollout", "engine"): ("embedded", "vllm"),
    ("rollout", "off_policy_lag"): (0, 1),
    ("model", "remat"): model_config.REMAT_POLICIES,
    ("model", "attention_impl"): model_config.ATTENTION_IMPLS,
    ("model", "frozen_dtype"): ("", "float32", "bfloat16", "float16"),
    ("model", "init"): ("pretrained", "random"),
    ("advantage", "estimator"): ("grpo", "dr_grpo", "rloo", "batch_std"),
    ("loss", "objective"): ("ppo_clip", "cispo"),
    ("loss", "aggregation"): ("seq_mean_token_mean", "token_mean", "seq_mean_token_sum_norm"),
    ("loss", "kl_estimator"): ("k1", "k2", "k3"),
    ("loss", "importance_sampling_level"): ("token", "sequence", "sequence_token"),
    ("loss", "tis_mode"): tuple(
        f"{level}_{kind}"
        for level in ("token", "sequence", "geometric")
        for kind in ("truncate", "mask")
    ),
    ("mmr", "scope"): ("group", "batch"),
    ("rewards", "cosine_form"): ("tokens", "released"),
    ("eval", "source"): ("benchmarks", "arithmetic", "task"),
    ("mesh", "layout"): ("hybrid", "flat"),
}


def _plain(value):
    """ConfigDict / FieldReference / list -> dict / scalar / tuple."""
    if hasattr(value, "to_dict"):
        value = value.to_dict()
    if hasattr(value, "get") and callable(value.get) and not isinstance(value, Mapping):
        value = value.get()  # FieldReference
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return tuple(_plain(v) for v in value)
    return value


def _build(cls, values: Mapping[str, Any], where: str):
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - set(fields))
    missing = sorted(n for n, f in fields.items() if n not in values and _required(f))
    if unknown or missing:
        raise ValueError(
            f"config section {where!r}: unknown keys {unknown}, missing keys {missing}; "
            f"valid keys: {sorted(fields)}"
        )
    kwargs = {}
    for name, value in values.items():
        sub = _SECTIONS.get(name) if cls is TrainConfig else None
        if sub is not None:
            if not isinstance(value, Mapping):
                raise ValueError(f"config section {name!r} must be a dict, got {value!r}")
            value = _build(sub, value, name)
        elif name == "weights":
            value = {str(k): float(v) for k, v in value.items()}
        kwargs[name] = value
    return cls(**kwargs)


def _required(f: dataclasses.Field) -> bool:
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


_SECTIONS = {
    "model": ModelConfig,
    "lora": LoraConfig,
    "optim": OptimConfig,
    "batch": BatchConfig,
    "rollout": RolloutConfig,
    "rewards": RewardsConfig,
    "advantage": AdvantageConfig,
    "loss": LossConfig,
    "mmr": MmrConfig,
    "dra": DraConfig,
    "dynamic_sampling": DynamicSamplingConfig,
    "data": DataConfig,
    "eval": EvalConfig,
    "checkpoint": CheckpointConfig,
    "logging": LoggingConfig,
    "mesh": MeshConfig,
}


def validate(cfg: TrainConfig) -> TrainConfig:
    """Checks choices and cross-field constraints; returns `cfg`."""
    for (section, key), choices in _CHOICES.items():
        value = getattr(getattr(cfg, section), key)
        if value not in choices:
            raise ConfigError(f"config {section}.{key}={value!r}; expected one of {choices}")
    if cfg.mmr.enabled and cfg.dra.enabled:
        raise ConfigError("mmr.enabled and dra.enabled are exclusive; pick one reweighting")
    if cfg.mmr.lam is not None and not 0.0 <= cfg.mmr.lam <= 1.0:
        raise ConfigError(f"mmr.lam={cfg.mmr.lam} must lie in [0, 1] (or None for adaptive)")
    if cfg.rows_per_step % cfg.loss.minibatches:
        raise ConfigError(
            f"loss.minibatches={cfg.loss.minibatches} must divide "
            "batch.prompts * batch.generations "
            f"= {cfg.rows_per_step}"
        )
    b = cfg.batch
    if b.pack_max_len < 0 or 0 < b.pack_max_len < b.max_completion_len - 1:
        # A completion of T tokens is T - 1 packed inputs: the longest must fit one packed row.
        raise ConfigError(
            f"batch.pack_max_len={b.pack_max_len} must be 0 (no packing) or at least "
            f"batch.max_completion_len - 1 = {b.max_completion_len - 1}"
        )
    if not cfg.batch.compile_price_steps >= 0:  # also refuses NaN
        raise ConfigError(
            f"batch.compile_price_steps={cfg.batch.compile_price_steps} must be >= 0 "
            "(0: compile every packed length a step needs)"
        )
    if cfg.batch.min_bucket_len < 1:
        raise ConfigError(f"batch.min_bucket_len={cfg.batch.min_bucket_len} must be >= 1")
    loss = cfg.loss
    if not (loss.tis_cap == 0 or 1 <= loss.tis_cap < float("inf")):  # also refuses NaN
        # w = min(pi_trainer / pi_engine, cap): a cap below 1 would scale down tokens on which
        # both agree (w = 1), which is no truncation of the importance weight.
        raise ConfigError(
            f"loss.tis_cap={loss.tis_cap} must be 0 (off) or finite and >= 1 (verl/TRL use 2)"
        )
    if not 0 <= loss.tis_mask_low < 1:  # also refuses NaN
        raise ConfigError(f"loss.tis_mask_low={loss.tis_mask_low} must lie in [0, 1)")
    if loss.tis_mask_low > 0 and not (loss.tis_cap > 0 and loss.tis_mode.endswith("_mask")):
        raise ConfigError(
            f"loss.tis_mask_low={loss.tis_mask_low} needs a '_mask' loss.tis_mode and "
            f"loss.tis_cap > 0 (got tis_mode={loss.tis_mode!r}, tis_cap={loss.tis_cap})"
        )
    if loss.tis_mode != "token_truncate" and loss.tis_cap == 0:
        raise ConfigError(f"loss.tis_mode={loss.tis_mode!r} needs loss.tis_cap >= 1 (0 = off)")
    _validate_objective(loss)
    if cfg.loss.iterations < 1 or cfg.total_steps < 1:
        raise ConfigError("loss.iterations and total_steps must be >= 1")
    _validate_issue47(cfg)
    if cfg.model.init == "random" and cfg.rollout.engine != "embedded":
        raise ConfigError(
            "model.init='random' needs rollout.engine='embedded' (a vLLM server loads model.path)"
        )
    if cfg.model.init == "random" and cfg.checkpoint.export_hf:
        raise ConfigError("model.init='random' has no tokenizer files to export: export_hf=False")
    if not any(cfg.rewards.weights.values()):
        raise ConfigError(f"rewards.weights={dict(cfg.rewards.weights)} has no non-zero weight")
    ds = cfg.dynamic_sampling
    if ds.enabled and ds.filter_reward not in cfg.rewards.weights:
        raise ConfigError(
            f"dynamic_sampling.filter_reward={ds.filter_reward!r} is not among rewards.weights "
            f"{sorted(cfg.rewards.weights)}"
        )
    return cfg


def _validate_issue47(cfg: TrainConfig) -> None:
    """Updates per batch, the adaptive entropy coefficient and the overlong punishment."""
    loss = cfg.loss
    if loss.updates_per_batch < 1 or loss.minibatches % loss.updates_per_batch:
        raise ConfigError(
            f"loss.updates_per_batch={loss.updates_per_batch} must be >= 1 and divide "
            f"loss.minibatches={loss.minibatches} (each update takes whole minibatches)"
        )
    if not (loss.entropy_target >= 0 and abs(loss.entropy_coef) < float("inf")):  # and NaN
        raise ConfigError(
            f"loss.entropy_target={loss.entropy_target} must be >= 0 (0: fixed coefficient) "
            f"and loss.entropy_coef={loss.entropy_coef} finite"
        )
    if loss.entropy_target > 0 and not (
        loss.entropy_coef_step > 0
        and 0 <= loss.entropy_coef_min <= loss.entropy_coef <= loss.entropy_coef_max < float("inf")
    ):
        raise ConfigError(
            f"adaptive entropy (loss.entropy_target={loss.entropy_target}) needs "
            f"loss.entropy_coef_step={loss.entropy_coef_step} > 0 and 0 <= "
            f"loss.entropy_coef_min={loss.entropy_coef_min} <= loss.entropy_coef="
            f"{loss.entropy_coef} (its start) <= loss.entropy_coef_max={loss.entropy_coef_max}"
        )
    r = cfg.rewards
    l_max = r.overlong_max_len or cfg.batch.max_completion_len
    if r.overlong_max_len < 0 or not 0 <= r.overlong_cache_len <= l_max:
        raise ConfigError(
            f"rewards.overlong_cache_len={r.overlong_cache_len} must lie in [0, L_max={l_max}] "
            f"(rewards.overlong_max_len={r.overlong_max_len}, 0 = batch.max_completion_len)"
        )


def advisories(cfg: TrainConfig) -> list[str]:
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


def _validate_objective(loss: LossConfig) -> None:
    """The objective options (`losses.policy_loss`) and the combinations they refuse."""
    if loss.objective == "cispo":
        if loss.importance_sampling_level != "token":
            raise ConfigError(
                "loss.objective='cispo' weights each token by its own clipped ratio; it does not "
                f"combine with loss.importance_sampling_level={loss.importance_sampling_level!r}"
            )
        if loss.dual_clip_c:
            raise ConfigError(
                "loss.dual_clip_c caps the 'ppo_clip' surrogate; loss.objective='cispo' has none"
            )
        if not (0 <= loss.eps_low <= 1 and loss.eps_high >= 0):  # also refuses NaN
            raise ConfigError(
                f"loss.objective='cispo' clips its weight to [1 - eps_low, 1 + eps_high]: needs "
                f"0 <= loss.eps_low <= 1 (1 = no lower bound) and loss.eps_high >= 0, got "
                f"{loss.eps_low}, {loss.eps_high}"
            )
    if not (loss.dual_clip_c == 0 or 1 < loss.dual_clip_c < float("inf")):  # also refuses NaN
        raise ConfigError(
            f"loss.dual_clip_c={loss.dual_clip_c} must be 0 (off) or finite and > 1 (verl: 3)"
        )
    if not 0 <= loss.entropy_coef < float("inf"):
        raise ConfigError(f"loss.entropy_coef={loss.entropy_coef} must be finite and >= 0")
    if not 0 < loss.top_entropy_quantile <= 1:
        raise ConfigError(
            f"loss.top_entropy_quantile={loss.top_entropy_quantile} must lie in (0, 1] (1 = off)"
        )


def from_config_dict(config) -> TrainConfig:
    """ConfigDict (or nested dict) -> validated `TrainConfig`."""
    return validate(_build(TrainConfig, _plain(config), "<root>"))


class UnknownKeyError(KeyError):
    """An override names a config key that does not exist."""

    def __str__(self) -> str:
        return str(self.args[0])


def load_config_file(spec: str):
    """'configs/grpo.py:7b,smoke' -> that file's `get_config('7b,smoke')` (a ConfigDict)."""
    import importlib.util
    import pathlib

    path, _, arg = spec.partition(":")
    module_spec = importlib.util.spec_from_file_location(pathlib.Path(path).stem, path)
    if module_spec is None or not pathlib.Path(path).exists():
        raise FileNotFoundError(f"config file {path!r} not found")
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module.get_config(arg) if arg else module.get_config()


def parse_assignments(items) -> dict[str, Any]:
    """['a.b=1024', 'c=false', 'd=/ckpt'] -> {'a.b': 1024, 'c': False, 'd': '/ckpt'}: values as
    Python literals (true / false in any case as bools), else strings; `name=value` is required."""
    parsed = {}
    for item in items:
        name, sep, raw = (part.strip() for part in item.partition("="))
        if not sep or not name:
            raise ValueError(f"expected name=value, got {item!r}")
        if raw.lower() in ("true", "false"):
            parsed[name] = raw.lower() == "true"
            continue
        try:
            parsed[name] = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            parsed[name] = raw
    return parsed


def set_keys(config, values: Mapping[str, Any]):
    """Sets dotted keys ('checkpoint.every') of a ConfigDict in place; returns it."""
    for key, value in values.items():
        *sections, leaf = key.split(".")
        node = config
        for section in sections:
            node = node[section]
        node[leaf] = value
    return config


def check_override_keys(argv, flag_name: str = "config") -> None:
    """Raises `UnknownKeyError` naming the valid keys when a `--config.a.b=v` path does not exist.

    Run on argv before absl parses it: ml_collections reports only a close match, not the keys.
    """
    prefix = f"--{flag_name}"
    spec = next((a.split("=", 1)[1] for a in argv if a.startswith(prefix + "=")), None)
    overrides = [a[len(prefix) + 1 :].split("=", 1)[0] for a in argv if a.startswith(prefix + ".")]
    if spec is None or not overrides:
        return
    config = _plain(load_config_file(spec))
    for path in overrides:
        node, walked = config, []
        for key in path.split("."):
            if not isinstance(node, Mapping) or key not in node:
                where = ".".join(walked) or "<root>"
                valid = sorted(node) if isinstance(node, Mapping) else []
                raise UnknownKeyError(
                    f"unknown config key {path!r}: {where!r} has no key {key!r}; "
                    f"valid keys: {valid}"
                )
            node, walked = node[key], [*walked, key]
