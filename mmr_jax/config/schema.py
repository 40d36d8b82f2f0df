"""Typed, frozen views of a training config: one dataclass per block of `configs/base.py`.

`checks.from_config_dict` converts the ml_collections ConfigDict once, at the edge
(`scripts/train.py`); everything downstream receives these dataclasses. Each section mirrors a
block of `configs/base.py` key for key: a key missing on either side fails with the valid keys
listed.

The fields are names and types only. What a key means, and its default, are written once, in
configs/base.py (one commented line each); its choices and ranges in `checks`. A run stored before
a key existed takes the key at that default when it resumes (`command_line.stored_config`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

from mmr_jax.infra import user_errors
from mmr_jax.models import config as model_config


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    path: str
    dtype: str
    param_dtype: str
    remat: str
    logprob_chunk: int
    attention_impl: str
    frozen_dtype: str
    init: str

    def __post_init__(self):
        # Configs stored before policies had names say True / False (= full / none).
        object.__setattr__(self, "remat", model_config.remat_policy_name(self.remat))


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    enabled: bool
    rank: int
    alpha: float
    dropout: float
    targets: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    lr: float
    b1: float
    b2: float
    eps: float
    weight_decay: float
    warmup_ratio: float
    min_lr_ratio: float
    grad_clip: float


@dataclasses.dataclass(frozen=True)
class BatchConfig:
    prompts: int
    generations: int
    max_prompt_len: int
    max_completion_len: int
    shared_prompt: bool
    min_bucket_len: int
    pack_max_len: int
    compile_price_steps: float

    @property
    def layout(self) -> str:
        """The train step's batch layout (`step.batch_layout.LAYOUTS`): full rows, shared
        prompts, or shared prompts with each group's completions packed into one row."""
        if not self.shared_prompt:
            return "full"
        return "packed" if self.pack_max_len else "shared"


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    engine: str
    url: str
    server_venv: str
    model_name: str
    timeout_s: float
    max_retries: int
    ready_timeout_s: float
    temperature: float
    top_p: float
    top_k: int
    sync_dir: str
    off_policy_lag: int


@dataclasses.dataclass(frozen=True)
class RewardsConfig:
    weights: Mapping[str, float]
    cosine_form: str
    accuracy_number_only: bool
    overlong_max_len: int
    overlong_cache_len: int


@dataclasses.dataclass(frozen=True)
class AdvantageConfig:
    estimator: str
    std_ddof: int
    eps: float


@dataclasses.dataclass(frozen=True)
class LossConfig:
    eps_low: float
    eps_high: float
    aggregation: str
    beta: float
    kl_estimator: str
    iterations: int
    minibatches: int
    updates_per_batch: int
    mask_truncated_completions: bool
    entropy_coef: float
    entropy_target: float
    entropy_coef_step: float
    entropy_coef_min: float
    entropy_coef_max: float
    tis_cap: float
    tis_mode: str
    tis_mask_low: float
    importance_sampling_level: str
    objective: str
    dual_clip_c: float
    top_entropy_quantile: float


@dataclasses.dataclass(frozen=True)
class ReweightConfig:
    method: str
    lam: float | None
    scope: str
    uniform_group_guard: bool
    embedding_model: str
    embedding_max_length: int
    embedding_batch_size: int


@dataclasses.dataclass(frozen=True)
class DynamicSamplingConfig:
    enabled: bool
    filter_reward: str
    max_generation_batches: int


@dataclasses.dataclass(frozen=True)
class DataConfig:
    source: str
    split: str
    problem_field: str
    answer_field: str
    arithmetic_max_operand: int
    arithmetic_ops: tuple[str, ...]
    system_prompt: str


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    every: int
    data_dir: str
    benchmarks: tuple[str, ...]
    max_problems: int
    n: int
    temperature: float
    top_p: float
    max_new_tokens: int
    system_prompt: str
    source: str
    arithmetic_problems: int
    arithmetic_seed: int
    number_only: bool
    at_start: bool


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    every: int
    at_end: bool
    keep: int
    keep_period: int
    export_hf: bool


@dataclasses.dataclass(frozen=True)
class LoggingConfig:
    every: int
    tensorboard: bool
    samples: int


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    shape: tuple[int, ...]
    over_hosts: str


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """The whole run."""

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
    reweight: ReweightConfig
    dynamic_sampling: DynamicSamplingConfig
    data: DataConfig
    eval: EvalConfig
    checkpoint: CheckpointConfig
    logging: LoggingConfig
    mesh: MeshConfig

    @property
    def rows_per_step(self) -> int:
        return self.batch.prompts * self.batch.generations

    @property
    def total_updates(self) -> int:
        """Optimiser updates in the whole run (the learning-rate schedule's length)."""
        return self.total_steps * self.loss.iterations * self.loss.updates_per_batch

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict (tuples as lists), the form stored in the run metadata."""
        return json.loads(json.dumps(dataclasses.asdict(self), default=dict))


class ConfigError(user_errors.UserError, ValueError):
    """A config value is out of range or contradicts another (told in one line: `user_errors`)."""
