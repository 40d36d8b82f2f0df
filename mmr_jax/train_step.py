"""The jitted policy update: `iterations` passes over minibatches with exact gradient accumulation.

Shape legend: N rows (completions, B prompts x G), P prompt tokens (left-padded), T completion
tokens (right-padded to a length bucket), L = P + T, M minibatches of N / M rows, Q = N / g stored
prompts (g rows share each; `batch_layout`).

Three batch layouts, one step: full rows (`tokens` [N, L], every prompt repeated in each of its
rows), shared prompts (`prompt_tokens` [Q, P] set, `tokens` [N, T] the completions alone), where
each prompt is computed once for its g rows (`models.shared_prompt`), and shared prompts with
each group's completions packed into one row (`packed` set, `batch_layout.PackedCompletions`),
where the forward runs over real completion tokens only; same loss and gradients.

The model is functional here: `nnx.split` gives a graphdef, the trainable state (all `nnx.Param`,
or only the `nnx.LoRAParam` adapters), the frozen parameters and the rest (RNG streams). The step
is a module-level pure function of arrays, jitted once per (P, T) bucket with the state donated.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import nnx

from mmr_jax import losses, mismatch
from mmr_jax.models import logprobs as logprobs_lib


@flax.struct.dataclass
class TrainState:
    """What the optimiser carries between steps (all of it is checkpointed)."""

    step: jax.Array  # int32 [], training steps done
    params: Any  # nnx.State of the trainable parameters
    opt_state: Any  # optax state
    rng: jax.Array  # uint32 [2], raw key data (portable across PRNG implementations)


@flax.struct.dataclass
class Batch:
    """One step's rows, on device."""

    tokens: jax.Array  # int32 [N, L] prompt (left-padded) then completion (right-padded);
    # with prompt_tokens set: [N, T], the completions alone
    attention_mask: jax.Array  # bool, as tokens
    completion_mask: jax.Array  # bool [N, T] tokens that enter the loss (False for invalid rows)
    advantages: jax.Array  # float32 [N]
    old_logps: jax.Array | None = None  # float32 [N, T], when iterations > 1
    ref_logps: jax.Array | None = None  # float32 [N, T], when beta > 0
    sampler_logps: jax.Array | None = None  # float32 [N, T] the engine's; mismatch metrics, TIS
    prompt_tokens: jax.Array | None = None  # int32 [Q, P] shared-prompt layout (batch_layout)
    prompt_mask: jax.Array | None = None  # bool [Q, P]
    packed: Any = None  # batch_layout.PackedCompletions: the forward's inputs, with prompt_tokens


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """Static hyperparameters of the step (hashable: part of the jit cache key)."""

    minibatches: int
    iterations: int
    temperature: float
    eps_low: float
    eps_high: float
    aggregation: str
    beta: float
    kl_estimator: str
    max_completion_len: int
    logprob_chunk: int = 0
    tis_cap: float = 0.0  # truncated importance sampling cap (0 = off); needs sampler_logps
    tis_mode: str = "token_truncate"  # mismatch.TIS_MODES
    tis_mask_low: float = 0.0  # lower bound of the '_mask' modes (0 = none)
    importance_sampling_level: str = "token"  # losses.IS_LEVELS: 'sequence' = GSPO
    objective: str = "ppo_clip"  # losses.OBJECTIVES
    dual_clip_c: float = 0.0  # 0 = off
    entropy_coef: float = 0.0  # entropy bonus (0 = off)
    top_entropy_quantile: float = 1.0  # per minibatch (losses.high_entropy_mask); 1 = off


def make_optimizer(
    *,
    lr: float,
    total_updates: int,
    warmup_ratio: float,
    min_lr_ratio: float,
    grad_clip: float,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """AdamW after global-norm clipping, linear warmup then cosine decay to lr * min_lr_ratio."""
    warmup = int(round(warmup_ratio * total_updates))
    if warmup > 0:
        schedule = optax.warmup_cosine_decay_schedule(
            init_value=0.0,
            peak_value=lr,
            warmup_steps=warmup,
            decay_steps=max(total_updates, warmup + 1),
            end_value=lr * min_lr_ratio,
        )
    else:
        schedule = optax.cosine_decay_schedule(lr, max(total_updates, 1), alpha=min_lr_ratio)
    chain = [optax.clip_by_global_norm(grad_clip)] if grad_clip > 0 else []
    chain.append(optax.adamw(schedule, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay))
    return optax.chain(*chain), schedule


def _with_dropout_key(rest, key):
    """`rest` with every RNG stream reset to `key` (LoRA dropout draws depend only on the step)."""
    flat = []
    for path, var in nnx.to_flat_state(rest):
        if isinstance(var, nnx.RngKey):
            var = var.replace(
                jax.random.wrap_key_data(key, impl=jax.random.key_impl(var.get_value()))
            )
        elif isinstance(var, nnx.RngCount):
            var = var.replace(jnp.zeros_like(var.get_value()))
        flat.append((path, var))
    return nnx.from_flat_state(flat)


def completion_logprobs(
    model,
    tokens_NxL,
    attention_mask_NxL,
    *,
    num_completion: int,
    temperature: float,
    chunk: int = 0,
    entropy: bool = False,
    disable_lora: bool = False,
):
    """Log-probs (and entropy) of the last `num_completion` positions: [N, T] (each)."""
    out = logprobs_lib.token_logprobs(
        model,
        tokens_NxL,
        attention_mask_NxL,
        temperature=temperature,
        chunk_size=chunk or None,
        return_entropy=entropy,
        disable_lora=disable_lora,
    )
    if entropy:
        return out[0][:, -num_completion:], out[1][:, -num_completion:]
    return out[:, -num_completion:]


def batch_logprobs(
    model,
    tokens,
    attention_mask,
    *,
    prompt_tokens=None,
    prompt_mask=None,
    packed=None,
    num_completion: int,
    temperature: float,
    chunk: int = 0,
    entropy: bool = False,
    disable_lora: bool = False,
):
    """`completion_logprobs` of any layout: shared prompts when `prompt_tokens` is given, their
    completions packed when `packed` is too."""
    if prompt_tokens is None:
        return completion_logprobs(
            model,
            tokens,
            attention_mask,
            num_completion=num_completion,
            temperature=temperature,
            chunk=chunk,
            entropy=entropy,
            disable_lora=disable_lora,
        )
    if tokens.shape[1] != num_completion:
        raise ValueError(f"completions of {tokens.shape[1]} tokens, expected {num_completion}")
    if packed is not None:
        return logprobs_lib.packed_logprobs(
            model,
            prompt_tokens,
            prompt_mask,
            tokens,
            attention_mask,
            packed,
            temperature=temperature,
            chunk_size=chunk or None,
            return_entropy=entropy,
            disable_lora=disable_lora,
        )
    return logprobs_lib.shared_prompt_logprobs(
        model,
        prompt_tokens,
        prompt_mask,
        tokens,
        attention_mask,
        temperature=temperature,
        chunk_size=chunk or None,
        return_entropy=entropy,
        disable_lora=disable_lora,
    )


def check_minibatches(prompt_tokens, rows: int, minibatches: int) -> None:
    """Minibatches must hold whole groups: M divides the N rows and the Q stored prompts."""
    q = None if prompt_tokens is None else prompt_tokens.shape[0]
    if rows % minibatches or (q is not None and q % minibatches):
        raise ValueError(
            f"{minibatches} minibatches do not split {rows} rows"
            + ("" if q is None else f" sharing {q} prompts")
            + " into equal whole groups; pack with batch_layout.group_size(G, N, minibatches)"
        )


def _split(x, m):
    return None if x is None else x.reshape(m, x.shape[0] // m, *x.shape[1:])


def _minibatch_loss(
    params, mb: Batch, key, normaliser, iteration, *, graphdef, frozen, rest, cfg: StepConfig
):
    model = nnx.merge(graphdef, params, frozen, _with_dropout_key(rest, key))
    t = mb.completion_mask.shape[1]
    logps, entropy = batch_logprobs(
        model,
        mb.tokens,
        mb.attention_mask,
        prompt_tokens=mb.prompt_tokens,
        prompt_mask=mb.prompt_mask,
        packed=mb.packed,
        num_completion=t,
        temperature=cfg.temperature,
        chunk=cfg.logprob_chunk,
        entropy=True,
    )
    # The pre-update policy's log-probs: `old_logps` when given (a clean forward: no dropout),
    # else this forward's own (the first pass of one iteration, where they are the same policy).
    same = jax.lax.stop_gradient(logps)
    behaviour = same if mb.old_logps is None else mb.old_logps
    # The ratio's reference is the forward it divides: on the first pass this same forward, so
    # that LoRA dropout noise (absent from the clean old_logps) never enters the ratio or the
    # clip; later passes compare the updated policy with the pre-update one.
    ratio_ref = same if mb.old_logps is None else jnp.where(iteration == 0, same, mb.old_logps)
    tis = None  # rollout/trainer mismatch correction (issues 16, 37): `mismatch.tis_weights`
    if cfg.tis_cap > 0:
        if mb.sampler_logps is None:
            raise ValueError("loss.tis_cap > 0 needs the engine's log-probs (Batch.sampler_logps)")
        tis = mismatch.tis_weights(
            behaviour,
            mb.sampler_logps,
            mb.completion_mask,
            cap=cfg.tis_cap,
            mode=cfg.tis_mode,
            low=cfg.tis_mask_low,
        )
    loss, aux = losses.policy_loss(
        logps,
        ratio_ref,
        mb.advantages,
        mb.completion_mask,
        ref_logps_BxT=mb.ref_logps,
        eps_low=cfg.eps_low,
        eps_high=cfg.eps_high,
        aggregation=cfg.aggregation,
        beta=cfg.beta,
        kl_estimator=cfg.kl_estimator,
        max_completion_len=cfg.max_completion_len,
        normaliser=normaliser,
        is_weights_BxT=tis,
        importance_sampling_level=cfg.importance_sampling_level,
        objective=cfg.objective,
        dual_clip_c=cfg.dual_clip_c,
        entropy_BxT=entropy,
        entropy_coef=cfg.entropy_coef,
        top_entropy_quantile=cfg.top_entropy_quantile,
    )
    mask = mb.completion_mask
    tokens = jnp.maximum(mask.sum(), 1)
    out = {
        "kl": aux["kl"],
        "clip/low_frac": aux["clip_frac_low"],
        "clip/high_frac": aux["clip_frac_high"],
        "ratio/mean": aux["ratio_mean"],
        "ratio/min": aux["ratio_min"],
        "ratio/max": aux["ratio_max"],
        "entropy": jnp.sum(jax.lax.stop_gradient(entropy) * mask) / tokens,
        "tokens": mask.sum().astype(jnp.float32),
    }
    for key, name in (
        ("dual_clip_frac", "clip/dual_frac"),
        ("entropy_kept_frac", "entropy/kept_frac"),
    ):
        if key in aux:  # only with the option on
            out[name] = aux[key]
    if mb.sampler_logps is not None:  # trainer (pre-update) vs engine log-probs: sums, see _reduce
        stats = mismatch.mismatch_stats(
            behaviour,
            mb.sampler_logps,
            mask,
            tis_cap=cfg.tis_cap,
            tis_mode=cfg.tis_mode,
            tis_low=cfg.tis_mask_low,
        )
        out.update({MISMATCH_STATS + k: v for k, v in stats.items()})
    return loss, out


MISMATCH_STATS = "mismatch_stats/"  # sufficient statistics, combined exactly, then made metrics


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
    if name.startswith(MISMATCH_STATS):  # taken against the same pre-update log-probs each pass
        return values_I[0]
    if name == "ratio/min":
        return values_I.min()
    if name == "ratio/max":
        return values_I.max()
    return values_I.mean()


def _neutral_ratio(metrics: dict) -> dict:
    """A batch without a loss token has no ratio: log 1 (no change), not +-inf or 0."""
    has = metrics["tokens"] > 0
    return {k: jnp.where(has, v, 1.0) if k.startswith("ratio/") else v for k, v in metrics.items()}


def train_step(
    state: TrainState, batch: Batch, frozen, rest, *, graphdef, optimizer, schedule, cfg: StepConfig
) -> tuple[TrainState, dict[str, jax.Array]]:
    """`cfg.iterations` optimiser updates, each on the gradient accumulated over all minibatches."""
    m = cfg.minibatches
    check_minibatches(batch.prompt_tokens, batch.tokens.shape[0], m)
    mbs = jax.tree.map(functools.partial(_split, m=m), batch)
    # Every minibatch loss is divided by the whole batch's normaliser: the sum of the minibatch
    # gradients is the full-batch gradient exactly (losses module docstring).
    normaliser = losses.loss_denominator(
        batch.completion_mask,
        aggregation=cfg.aggregation,
        max_completion_len=cfg.max_completion_len,
    )
    loss_fn = functools.partial(
        _minibatch_loss, graphdef=graphdef, frozen=frozen, rest=rest, cfg=cfg
    )
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    step_key = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)

    def one_update(carry, it):
        params, opt_state = carry

        def accumulate(grads, xs):
            mb, i = xs
            key = jax.random.key_data(jax.random.fold_in(jax.random.fold_in(step_key, it), i))
            (loss, aux), g = grad_fn(params, mb, key, normaliser, it)
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
        one_update, (state.params, state.opt_state), jnp.arange(cfg.iterations)
    )
    metrics = _neutral_ratio({k: _over_iterations(k, v) for k, v in metrics.items()})
    names = [k for k in metrics if k.startswith(MISMATCH_STATS)]
    if names:
        stats = {k.removeprefix(MISMATCH_STATS): metrics.pop(k) for k in names}
        metrics.update(mismatch.mismatch_metrics(stats))
    metrics["clip/frac"] = metrics["clip/low_frac"] + metrics["clip/high_frac"]
    metrics["lr"] = schedule(state.step * cfg.iterations)
    new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state)
    return new_state, metrics


def logprobs_fn(
    params,
    frozen,
    rest,
    tokens_NxL,
    attention_mask_NxL,
    *,
    graphdef,
    num_completion,
    temperature,
    chunk=0,
    disable_lora=False,
    minibatches=1,
    prompt_tokens=None,
    prompt_mask=None,
    packed=None,
):
    """Log-probs [N, T] of the completion under the given parameters, in `minibatches` chunks.

    With `prompt_tokens` [Q, P] / `prompt_mask`, the shared-prompt layout (`tokens_NxL` is then
    the completions [N, T]), packed with `packed`; as the train step computes them.
    """
    model = nnx.merge(graphdef, params, frozen, rest)
    n = tokens_NxL.shape[0]
    check_minibatches(prompt_tokens, n, minibatches)

    def one(xs):
        tokens, mask, ptokens, pmask, pk = xs
        return batch_logprobs(
            model,
            tokens,
            mask,
            prompt_tokens=ptokens,
            prompt_mask=pmask,
            packed=pk,
            num_completion=num_completion,
            temperature=temperature,
            chunk=chunk,
            disable_lora=disable_lora,
        )

    xs = (tokens_NxL, attention_mask_NxL, prompt_tokens, prompt_mask, packed)
    out = jax.lax.map(one, jax.tree.map(functools.partial(_split, m=minibatches), xs))
    return out.reshape(n, num_completion)


def jit_train_step(*, graphdef, optimizer, schedule, cfg: StepConfig):
    """`train_step` jitted with the state donated; one compilation per batch shape."""
    fn = functools.partial(
        train_step, graphdef=graphdef, optimizer=optimizer, schedule=schedule, cfg=cfg
    )
    return jax.jit(fn, donate_argnums=(0,))
