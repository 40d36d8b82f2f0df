"""Tests of mmr_jax/models/."""
