"""Hand-written CPU kernels behind XLA's FFI, each with a pure-JAX reference it must equal.

May import: nothing of mmr_jax.
"""
