"""Tests of mmr_jax/rewards/."""
