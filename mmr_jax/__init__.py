"""mmr_jax: GRPO-style RL for math reasoning in JAX/Flax, with MMR-GRPO reward reweighting."""

__version__ = "0.1.0"
