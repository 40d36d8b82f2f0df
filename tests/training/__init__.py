"""Tests of mmr_jax/training/."""
