"""Tests of benchmarks/*.py."""
