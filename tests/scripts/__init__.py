"""Tests of scripts/*.py, run as scripts."""
