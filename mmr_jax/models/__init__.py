"""Flax decoder of the Llama / Qwen2 families, HF loading and export, LoRA, sharding, log-probs.

May import: `kernels` and `infra` (`user_errors`: a checkpoint path that is not there is told in
one line), and nothing else of mmr_jax.
"""

from mmr_jax.models.loading import from_pretrained

__all__ = ["from_pretrained"]
