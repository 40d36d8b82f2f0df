"""LoRA configuration and the trainable filter (merging is `layers.merged_params`).

The adapters live inside `layers.Dense` as `nnx.LoRAParam` (lora_a [in, r], lora_b [r, out]) and
add `alpha / r * dropout(x) @ lora_a @ lora_b` to the frozen base projection. The reference policy
is the same model called with `disable_lora=True`: no second copy of the weights.
"""

from __future__ import annotations

import dataclasses

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
