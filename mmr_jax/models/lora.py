"""LoRA configuration, the trainable filter, and the model split into the trainable params and
the rest for the functional train step (`Policy`; merging is `layers.merged_params`).

The adapters live inside `layers.Dense` as `nnx.LoRAParam` (lora_a [in, r], lora_b [r, out]) and
add `alpha / r * dropout(x) @ lora_a @ lora_b` to the frozen base projection. The reference policy
is the same model called with `disable_lora=True`: no second copy of the weights.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from flax import nnx

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """Paper defaults: r=64, alpha=128, dropout 0.05 on q/k/v/o/gate/up/down."""

    rank: int = 64
    alpha: float = 128.0
    dropout: float = 0.05
    target_modules: tuple[str, ...] = ALL_TARGETS
    seed: int = 0  # dropout stream seed

    def __post_init__(self):
        unknown = set(self.target_modules) - set(ALL_TARGETS)
        if unknown:
            raise ValueError(
                f"unsupported LoRA target_modules {sorted(unknown)}; known: {ALL_TARGETS}"
            )
        if self.rank <= 0:
            raise ValueError(f"LoRA rank must be positive, got {self.rank}")

    def targets(self, name: str) -> bool:
        return name in self.target_modules


def trainable_filter(model: nnx.Module):
    """`nnx.LoRAParam` when the model has adapters, else `nnx.Param` (full fine-tuning)."""
    has_lora = bool(nnx.state(model, nnx.LoRAParam))
    return nnx.LoRAParam if has_lora else nnx.Param


@dataclasses.dataclass
class Policy:
    """The model split for the functional train step (trainable params live in `TrainState`)."""

    graphdef: Any  # train mode (LoRA dropout on)
    eval_graphdef: Any  # eval mode, for sampling
    params: nnx.State  # trainable: nnx.LoRAParam with LoRA, else nnx.Param
    frozen: nnx.State  # the other parameters (the base under LoRA; empty otherwise)
    rest: nnx.State  # RNG streams
    lora: bool
    attention: Any = None  # attention_probe.Choice: the training forwards' attention backend

    def model(self, params=None, *, train=False) -> nnx.Module:
        """A Decoder viewing `params` (default: the initial ones); no copy."""
        gd = self.graphdef if train else self.eval_graphdef
        return nnx.merge(gd, self.params if params is None else params, self.frozen, self.rest)


def split_policy(model: nnx.Module, attention=None) -> Policy:
    """Splits a loaded Decoder into graphdefs and states."""
    trainable = trainable_filter(model)
    model.eval()
    eval_graphdef = nnx.split(model, trainable, nnx.Param, ...)[0]
    model.train()
    graphdef, params, frozen, rest = nnx.split(model, trainable, nnx.Param, ...)
    lora = trainable is nnx.LoRAParam
    return Policy(graphdef, eval_graphdef, params, frozen, rest, lora=lora, attention=attention)
