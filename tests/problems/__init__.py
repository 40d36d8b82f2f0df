"""Tests of mmr_jax/problems/."""
