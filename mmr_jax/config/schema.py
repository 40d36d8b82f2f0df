"""Typed, frozen views of a training config: one dataclass per block of `configs/base.py`.

`checks.from_config_dict` converts the ml_collections ConfigDict once, at the edge
(`scripts/train.py`); everything downstream receives these dataclasses. Each section mirrors a
block of `configs/base.py` key for key: a key missing on either side fails with the valid keys
listed.
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

    @property
    def layout(self) -> str:
        """The train step's batch layout (`step.batch_layout.LAYOUTS`): full rows, shared
        prompts, or shared prompts with each group's completions packed into one row."""
        if not self.shared_prompt:
            return "full"
        return "packed" if self.pack_max_len else "shared"


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
    top_entropy_quantile: float = 1.0


@dataclasses.dataclass(frozen=True)
class ReweightConfig:
    method: str = "none"  # 'none' | 'mmr' | 'dra' (algorithms.mmr.REWEIGHTERS)
    lam: float | None = None  # mmr only
    scope: str = "group"
    uniform_group_guard: bool = False
    embedding_model: str = "jinaai/jina-embeddings-v2-small-en"
    embedding_max_length: int = 512
    embedding_batch_size: int = 64


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
