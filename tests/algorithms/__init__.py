"""Tests of mmr_jax/algorithms/."""
