"""The jitted policy update: `iterations` passes over the batch, each of `updates_per_batch`
optimiser updates on successive row slices, each the gradient accumulated over its minibatches.

Shape legend: N rows (completions, B prompts x G), P prompt tokens (left-padded), T completion
tokens (right-padded to a length bucket), L = P + T, M minibatches of N / M rows, U updates per
pass of M / U minibatches each, Q = N / g stored prompts (g rows share each; `batch_layout`).

Three batch layouts, one step: full rows (`tokens` [N, L], every prompt repeated in each of its
rows), shared prompts (`prompt_tokens` [Q, P] set, `tokens` [N, T] the completions alone), where
each prompt is computed once for its g rows (`models.shared_prompt`), and shared prompts with
each group's completions packed into one row (`packed` set, `batch_layout.PackedCompletions`),
where the forward runs over real completion tokens only; same loss and gradients. Minibatches
and updates take whole stored prompts (and packed rows) in every layout
(`minibatch.check_minibatches`).

The model is functional here: `nnx.split` gives a graphdef, the trainable state (all `nnx.Param`,
or only the `nnx.LoRAParam` adapters), the frozen parameters and the rest (RNG streams). The step
is a module-level pure function of arrays, jitted once per (P, T) bucket with the state donated;
one minibatch's log-probs and loss are `minibatch`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax

from mmr_jax.algorithms import entropy_control, losses, mismatch
from mmr_jax.config import schema
from mmr_jax.models import lora, sharding
from mmr_jax.step import minibatch


@flax.struct.dataclass
class TrainState:
    """What the optimiser carries between steps (all of it is checkpointed)."""

    step: jax.Array  # int32 [], training steps done
    params: Any  # nnx.State of the trainable parameters
    opt_state: Any  # optax state
    rng: jax.Array  # uint32 [2], raw key data (portable across PRNG implementations)
    # float32 [], the adaptive entropy coefficient used by the next step (None: not adaptive)
    entropy_coef: jax.Array | None = None


@flax.struct.dataclass
class Batch:
    """One step's rows, on device."""

    tokens: jax.Array  # int32 [N, L] prompt (left-padded) then completion (right-padded);
    # with prompt_tokens set: [N, T], the completions alone
    attention_mask: jax.Array  # bool, as tokens
    completion_mask: jax.Array  # bool [N, T] tokens that enter the loss (False for invalid rows)
    advantages: jax.Array  # float32 [N]
    old_logps: jax.Array | None = None  # float32 [N, T], when iterations * updates > 1
    ref_logps: jax.Array | None = None  # float32 [N, T], when beta > 0
    sampler_logps: jax.Array | None = None  # float32 [N, T] the engine's; mismatch metrics, TIS
    prompt_tokens: jax.Array | None = None  # int32 [Q, P] shared-prompt layout (batch_layout)
    prompt_mask: jax.Array | None = None  # bool [Q, P]
    packed: Any = None  # batch_layout.PackedCompletions: the forward's inputs, with prompt_tokens


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """Static settings of the step (hashable: part of the jit cache key): the run's `loss`
    section whole, and what the step reads of the others."""

    loss: schema.LossConfig
    temperature: float  # rollout.temperature: the log-probs are the sampler's
    max_completion_len: int  # batch.max_completion_len: Dr.GRPO's normaliser
    logprob_chunk: int = 0  # model.logprob_chunk
    entropy_control: entropy_control.Control | None = None  # adaptive coefficient (None: fixed)

    @classmethod
    def from_config(cls, cfg: schema.TrainConfig) -> StepConfig:
        """The step's settings of a run: its loss section, and what the step reads of the rest."""
        loss = cfg.loss
        control = None
        if loss.entropy_target > 0:  # the adaptive coefficient's constants; else a fixed one
            control = entropy_control.Control(
                target=loss.entropy_target,
                step=loss.entropy_coef_step,
                low=loss.entropy_coef_min,
                high=loss.entropy_coef_max,
            )
        return cls(
            loss=loss,
            temperature=cfg.rollout.temperature,
            max_completion_len=cfg.batch.max_completion_len,
            logprob_chunk=cfg.model.logprob_chunk,
            entropy_control=control,
        )

    @property
    def entropy_on(self) -> bool:
        """Whether the loss carries an entropy bonus (fixed non-zero, or adaptive)."""
        return self.loss.entropy_coef != 0 or self.entropy_control is not None


def make_optimizer(
    optim: schema.OptimConfig, *, total_updates: int
) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """AdamW after global-norm clipping, linear warmup then cosine decay to lr * min_lr_ratio,
    over a run's `total_updates` optimiser updates (`TrainConfig.total_updates`)."""
    lr, warmup = optim.lr, int(round(optim.warmup_ratio * total_updates))
    if warmup > 0:
        schedule = optax.warmup_cosine_decay_schedule(
            init_value=0.0,
            peak_value=lr,
            warmup_steps=warmup,
            decay_steps=max(total_updates, warmup + 1),
            end_value=lr * optim.min_lr_ratio,
        )
    else:
        schedule = optax.cosine_decay_schedule(lr, max(total_updates, 1), alpha=optim.min_lr_ratio)
    chain = [optax.clip_by_global_norm(optim.grad_clip)] if optim.grad_clip > 0 else []
    chain.append(
        optax.adamw(
            schedule, b1=optim.b1, b2=optim.b2, eps=optim.eps, weight_decay=optim.weight_decay
        )
    )
    return optax.chain(*chain), schedule


def init_state(params, optimizer, *, seed: int, loss: schema.LossConfig, mesh=None) -> TrainState:
    """The step-0 state. With a mesh, leaves without a sharding (step, counts, RNG) are replicated
    on it, as the train step's outputs will be, so that the step compiles only once."""
    state = TrainState(
        step=jnp.zeros([], jnp.int32),
        params=params,
        opt_state=optimizer.init(params),
        rng=jax.random.key_data(jax.random.key(seed)),
        entropy_coef=jnp.float32(loss.entropy_coef) if loss.entropy_target > 0 else None,
    )
    if mesh is None:
        return state
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

    def place(x):
        on_mesh = isinstance(x.sharding, jax.sharding.NamedSharding)
        return x if on_mesh else jax.device_put(x, replicated)

    return jax.tree.map(place, state)


def step_graphdef(policy: lora.Policy, loss: schema.LossConfig, lora_dropout: float):
    """The train step's graphdef: LoRA dropout on, except when the step takes more than one
    optimiser update. From the second update on the ratio divides the training forward by the
    dropout-free old log-probs, and dropout's noise alone then moves GSPO's sequence ratio past
    its 3e-4 band (docs/algorithms.md, benchmarks/lora_dropout_ratio.py); with one update the
    ratio is taken against the same forward and dropout cannot enter it."""
    several = loss.iterations * loss.updates_per_batch > 1
    if policy.lora and lora_dropout > 0 and several:
        return policy.eval_graphdef
    return policy.graphdef


def _reduce(name: str, values_M: jax.Array, tokens_M: jax.Array) -> jax.Array:
    """Minibatch metrics -> one value: token-weighted means, or min / max / sum.

    The ratio's extrema of minibatches without a token are +-inf (`losses.policy_loss`); they
    drop out of the min / max, and `_neutral_ratio` replaces them when no minibatch had one.
    """
    if name == "ratio/min":
        return values_M.min()
    if name == "ratio/max":
        return values_M.max()
    if name in ("loss", "tokens"):
        return values_M.sum()
    return jnp.sum(values_M * tokens_M) / jnp.maximum(tokens_M.sum(), 1.0)


def _over_iterations(name: str, values_I: jax.Array) -> jax.Array:
    """Per-iteration metrics -> one value: the extrema of all passes, else their mean."""
    if name.startswith(minibatch.MISMATCH_STATS):
        return values_I[0]  # taken against the same pre-update log-probs each pass
    if name == "ratio/min":
        return values_I.min()
    if name == "ratio/max":
        return values_I.max()
    return values_I.mean()


def _neutral_ratio(metrics: dict) -> dict:
    """A batch without a loss token has no ratio: log 1 (no change), not +-inf or 0."""
    has = metrics["tokens"] > 0
    return {k: jnp.where(has, v, 1.0) if k.startswith("ratio/") else v for k, v in metrics.items()}


def _combine(aux: dict, reduce) -> dict:
    """Stacked metrics of disjoint row sets -> one value each (`reduce`); mismatch statistics
    merge jointly (mean and M2 by Chan's update), not key by key."""
    out = {
        k: reduce(k, v, aux["tokens"])
        for k, v in aux.items()
        if not k.startswith(minibatch.MISMATCH_STATS)
    }
    prefix = len(minibatch.MISMATCH_STATS)
    stats = {k[prefix:]: v for k, v in aux.items() if k.startswith(minibatch.MISMATCH_STATS)}
    stats = mismatch.combine_mismatch_stats(stats)
    out.update({minibatch.MISMATCH_STATS + k: v for k, v in stats.items()})
    return out


def _over_updates(name: str, values_U: jax.Array, tokens_U: jax.Array) -> jax.Array:
    """One pass's U updates -> one value: each update's loss is normalised by its own rows, so
    the loss (and the gradient norm) is their mean; the rest as over minibatches."""
    if name in ("loss", "grad_norm"):
        return values_U.mean()
    return _reduce(name, values_U, tokens_U)


def _update_normalisers(mask_NxT: jax.Array, cfg: StepConfig) -> jax.Array:
    """[U] the loss denominator of each update's rows (DAPO's token mean: its own tokens)."""
    masks = minibatch.split(mask_NxT, cfg.loss.updates_per_batch)
    return jnp.stack(
        [
            losses.loss_denominator(
                mask, aggregation=cfg.loss.aggregation, max_completion_len=cfg.max_completion_len
            )
            for mask in masks
        ]
    )


def train_step(
    state: TrainState, batch: Batch, frozen, rest, *, graphdef, optimizer, schedule, cfg: StepConfig
) -> tuple[TrainState, dict[str, jax.Array]]:
    """`loss.iterations` passes of `loss.updates_per_batch` optimiser updates (module docstring).

    Update j of a pass takes minibatches j * M / U ... (j + 1) * M / U - 1, each row once per
    pass; its gradient is the sum of their losses' gradients, each divided by the update's own
    denominator (`losses.loss_denominator` of its rows), so that it is the exact gradient of
    the update's rows as one batch. With U = 1 that is the whole batch, as before this option.
    """
    m, u = cfg.loss.minibatches, cfg.loss.updates_per_batch
    minibatch.check_minibatches(batch.prompt_tokens, batch.tokens.shape[0], m)
    if m % u:
        raise ValueError(f"loss.updates_per_batch={u} must divide loss.minibatches={m}")
    if u > 1 and batch.old_logps is None:
        raise ValueError("updates_per_batch > 1 needs the pre-update log-probs (Batch.old_logps)")
    if cfg.entropy_control is not None and state.entropy_coef is None:
        raise ValueError("an adaptive entropy coefficient needs TrainState.entropy_coef")
    per = m // u
    mbs = jax.tree.map(
        lambda x: minibatch.split(minibatch.split(x, m), u), batch
    )  # [U, M / U, N / M, ...]
    normalisers = _update_normalisers(batch.completion_mask, cfg)
    coef = cfg.loss.entropy_coef if cfg.entropy_control is None else state.entropy_coef
    loss_fn = functools.partial(
        minibatch.minibatch_loss, graphdef=graphdef, frozen=frozen, rest=rest, cfg=cfg
    )
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    step_key = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)

    def one_update(carry, it, j, update_mbs, normaliser):
        params, opt_state = carry
        first = (it == 0) & (j == 0)

        def accumulate(grads, xs):
            mb, i = xs
            key = jax.random.fold_in(jax.random.fold_in(step_key, it), j * per + i)
            (loss, aux), g = grad_fn(params, mb, jax.random.key_data(key), normaliser, first, coef)
            grads = jax.tree.map(jnp.add, grads, g)
            return grads, dict(aux, loss=loss)

        zeros = jax.tree.map(jnp.zeros_like, params)
        grads, aux = jax.lax.scan(accumulate, zeros, (update_mbs, jnp.arange(per)))
        grad_norm = optax.global_norm(grads)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        metrics = _combine(aux, _reduce)
        metrics["grad_norm"] = grad_norm
        return (params, opt_state), metrics

    def one_pass(carry, it):
        if u == 1:  # the program of a single update, as before updates_per_batch existed
            first_mbs = jax.tree.map(lambda x: x[0], mbs)
            return one_update(carry, it, 0, first_mbs, normalisers[0])
        body = lambda c, xs: one_update(c, it, *xs)
        carry, metrics = jax.lax.scan(body, carry, (jnp.arange(u), mbs, normalisers))
        return carry, _combine(metrics, _over_updates)

    (params, opt_state), metrics = jax.lax.scan(
        one_pass, (state.params, state.opt_state), jnp.arange(cfg.loss.iterations)
    )
    metrics = _neutral_ratio({k: _over_iterations(k, v) for k, v in metrics.items()})
    names = [k for k in metrics if k.startswith(minibatch.MISMATCH_STATS)]
    if names:
        stats = {k.removeprefix(minibatch.MISMATCH_STATS): metrics.pop(k) for k in names}
        metrics.update(mismatch.mismatch_metrics(stats))
    metrics["clip/frac"] = metrics["clip/low_frac"] + metrics["clip/high_frac"]
    metrics["lr"] = schedule(state.step * cfg.loss.iterations * u)
    new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state)
    if cfg.entropy_control is not None:  # this step's coefficient logged, the next one kept
        metrics["entropy_coef"] = state.entropy_coef
        coef = entropy_control.update(state.entropy_coef, metrics["entropy"], cfg.entropy_control)
        new_state = new_state.replace(entropy_coef=coef)
    elif cfg.loss.entropy_coef:
        metrics["entropy_coef"] = jnp.asarray(cfg.loss.entropy_coef, jnp.float32)
    return new_state, metrics


def jit_train_step(*, graphdef, optimizer, schedule, cfg: StepConfig, mesh=None):
    """`train_step` jitted with the state donated; one compilation per batch shape. `mesh`: the
    run's, traced under (`sharding.tracing_under`: splash attention splits over it)."""
    step = functools.partial(
        train_step, graphdef=graphdef, optimizer=optimizer, schedule=schedule, cfg=cfg
    )

    # The arguments named as train_step names them: XLA's parameters carry those names
    # (`frozen[...]`), which the compiled-HLO tests read.
    def fn(state, batch, frozen, rest):
        with sharding.tracing_under(mesh):
            return step(state, batch, frozen, rest)

    return jax.jit(fn, donate_argnums=(0,))
