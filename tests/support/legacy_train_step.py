"""The train step's update loop as it was before `updates_per_batch` (commit 6dd19a4), kept
verbatim as the reference that `tests/step/train_step_test.py` holds the U = 1 step to, bit for bit.
Only the minibatch loss is called where it now lives (`minibatch`, moved unchanged), and the
loss settings are read from `StepConfig.loss` (issue 53)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax

from mmr_jax.algorithms import losses, mismatch
from mmr_jax.step import minibatch, train_step

# The helpers the old loop shared with today's (unchanged by issue 47), under its old names.
MISMATCH_STATS, _split = minibatch.MISMATCH_STATS, minibatch.split
check_minibatches = minibatch.check_minibatches
TrainState, _neutral_ratio = train_step.TrainState, train_step._neutral_ratio
_over_iterations, _reduce = train_step._over_iterations, train_step._reduce


def train_step(
    state: TrainState, batch, frozen, rest, *, graphdef, optimizer, schedule, cfg
) -> tuple[TrainState, dict[str, jax.Array]]:
    """`loss.iterations` optimiser updates, each on the gradient summed over all minibatches."""
    m = cfg.loss.minibatches
    check_minibatches(batch.prompt_tokens, batch.tokens.shape[0], m)
    mbs = jax.tree.map(functools.partial(_split, m=m), batch)
    # Every minibatch loss is divided by the whole batch's normaliser: the sum of the minibatch
    # gradients is the full-batch gradient exactly (losses module docstring).
    normaliser = losses.loss_denominator(
        batch.completion_mask,
        aggregation=cfg.loss.aggregation,
        max_completion_len=cfg.max_completion_len,
    )
    loss_fn = functools.partial(
        minibatch.minibatch_loss, graphdef=graphdef, frozen=frozen, rest=rest, cfg=cfg
    )
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    step_key = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)

    def one_update(carry, it):
        params, opt_state = carry

        def accumulate(grads, xs):
            mb, i = xs
            key = jax.random.key_data(jax.random.fold_in(jax.random.fold_in(step_key, it), i))
            (loss, aux), g = grad_fn(params, mb, key, normaliser, it == 0, 0.0)
            grads = jax.tree.map(jnp.add, grads, g)
            return grads, dict(aux, loss=loss)

        zeros = jax.tree.map(jnp.zeros_like, params)
        grads, aux = jax.lax.scan(accumulate, zeros, (mbs, jnp.arange(m)))
        grad_norm = optax.global_norm(grads)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        metrics = {
            k: _reduce(k, v, aux["tokens"])
            for k, v in aux.items()
            if not k.startswith(MISMATCH_STATS)
        }
        # Mismatch statistics merge jointly (mean and M2 by Chan's update), not key by key.
        prefix = len(MISMATCH_STATS)
        stats = {k[prefix:]: v for k, v in aux.items() if k.startswith(MISMATCH_STATS)}
        stats = mismatch.combine_mismatch_stats(stats)
        metrics.update({MISMATCH_STATS + k: v for k, v in stats.items()})
        metrics["grad_norm"] = grad_norm
        return (params, opt_state), metrics

    (params, opt_state), metrics = jax.lax.scan(
        one_update, (state.params, state.opt_state), jnp.arange(cfg.loss.iterations)
    )
    metrics = _neutral_ratio({k: _over_iterations(k, v) for k, v in metrics.items()})
    names = [k for k in metrics if k.startswith(MISMATCH_STATS)]
    if names:
        stats = {k.removeprefix(MISMATCH_STATS): metrics.pop(k) for k in names}
        metrics.update(mismatch.mismatch_metrics(stats))
    metrics["clip/frac"] = metrics["clip/low_frac"] + metrics["clip/high_frac"]
    metrics["lr"] = schedule(state.step * cfg.loss.iterations)
    new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state)
    return new_state, metrics
