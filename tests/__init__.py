"""Tests of mmr_jax, laid out as the code (docs/testing.md)."""
