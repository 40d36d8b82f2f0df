"""The method's math: pure functions of arrays, in the optax / rlax mould.

`mmr` (MMR reweighting of a group's rewards, the adaptive lambda, the DRA baseline),
`advantages` (group advantage estimators behind a registry), `losses` (the clipped policy
objectives, their aggregation modes and KL estimators) and `mismatch` (rollout/trainer
log-prob corrections). Arrays in, arrays (or `(loss, aux)`) out; no model, tokenizer, config
dict, clock or file inside.

May import: jax, chex, numpy, and nothing of mmr_jax.
"""
