"""Tests of mmr_jax/config/ and of the config files in configs/ that it reads."""
