"""Tests of mmr_jax/studies/."""
