"""Tests of mmr_jax/kernels/."""
