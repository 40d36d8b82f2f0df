"""Tests of mmr_jax/distributed/."""
