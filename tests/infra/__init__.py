"""Tests of mmr_jax/infra/."""
