"""Tests of mmr_jax/rollout/."""
