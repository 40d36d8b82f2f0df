"""Whole runs through scripts/train.py whose subject is no one subpackage."""
