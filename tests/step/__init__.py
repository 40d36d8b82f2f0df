"""Tests of mmr_jax/step/."""
