"""Plumbing every part uses: console, metrics files, run paths, fault points, child
processes, the compile cache and its statistics, and the benchmarks' harness.

Side effects live here and at the other edges (files, clocks, printing), never in the math.

May import: nothing of mmr_jax outside this package (it is the bottom of the tree).
"""
