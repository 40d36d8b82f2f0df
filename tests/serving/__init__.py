"""Tests of mmr_jax/serving/."""
