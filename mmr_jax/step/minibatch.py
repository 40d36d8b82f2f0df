"""One minibatch of the train step: the policy's log-probs in any batch layout, and its loss.

Shape legend as `train_step`: N rows, P prompt tokens, T completion tokens, L = P + T, M chunks
of N / M rows, Q stored prompts.

`minibatch_loss` is what `train_step` differentiates for each of its M row chunks; `logprobs_fn`
computes the reference and old (pre-update) log-probs the trainer hands the step, with the same
forward. Pure functions of arrays and the model's split state.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from mmr_jax.algorithms import losses, mismatch
from mmr_jax.models import logprobs as logprobs_lib
from mmr_jax.models import sharding

MISMATCH_STATS = "mismatch_stats/"  # sufficient statistics, combined exactly, then made metrics


def with_dropout_key(rest, key):
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
    kw = dict(
        temperature=temperature,
        chunk_size=chunk or None,
        return_entropy=entropy,
        disable_lora=disable_lora,
    )
    if packed is not None:
        return logprobs_lib.packed_logprobs(
            model, prompt_tokens, prompt_mask, tokens, attention_mask, packed, **kw
        )
    return logprobs_lib.shared_prompt_logprobs(
        model, prompt_tokens, prompt_mask, tokens, attention_mask, **kw
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


def split(x, m):
    """[N, ...] -> [m, N / m, ...] (None stays None)."""
    return None if x is None else x.reshape(m, x.shape[0] // m, *x.shape[1:])


def minibatch_loss(
    params, mb, key, normaliser, first, entropy_coef, *, graphdef, frozen, rest, cfg
):
    """(loss, metrics) of one row chunk `mb` (a `train_step.Batch`) under `params`.

    `normaliser`: the loss denominator of the update this chunk belongs to. `first`: bool [],
    True in the step's first optimiser update, where the ratio is taken against this same
    forward. `entropy_coef`: the entropy bonus's coefficient (float or traced scalar).
    """
    model = nnx.merge(graphdef, params, frozen, with_dropout_key(rest, key))
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
    # else this forward's own (the only update of one pass, where they are the same policy).
    same = jax.lax.stop_gradient(logps)
    behaviour = same if mb.old_logps is None else mb.old_logps
    # The ratio's reference is the forward it divides in the step's first update, so that LoRA
    # dropout noise (absent from the clean old_logps) never enters the ratio or the clip there;
    # later updates compare the updated policy with the pre-update one.
    ratio_ref = same if mb.old_logps is None else jnp.where(first, same, mb.old_logps)
    tis = None  # rollout/trainer mismatch correction (issues 16, 37): `mismatch.tis_weights`
    if cfg.loss.tis_cap > 0:
        if mb.sampler_logps is None:
            raise ValueError("loss.tis_cap > 0 needs the engine's log-probs (Batch.sampler_logps)")
        tis = mismatch.tis_weights(
            behaviour, mb.sampler_logps, mb.completion_mask, settings=cfg.loss
        )
    loss, aux = losses.policy_loss(
        logps,
        ratio_ref,
        mb.advantages,
        mb.completion_mask,
        settings=cfg.loss,
        ref_logps_NxT=mb.ref_logps,
        max_completion_len=cfg.max_completion_len,
        normaliser=normaliser,
        is_weights_NxT=tis,
        entropy_NxT=entropy,
        entropy_coef=entropy_coef if cfg.entropy_on else 0.0,  # 0: the graph has no bonus term
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
    if mb.sampler_logps is not None:  # trainer (pre-update) vs engine log-probs: sums, combined
        stats = mismatch.mismatch_stats(behaviour, mb.sampler_logps, mask, settings=cfg.loss)
        out.update({MISMATCH_STATS + k: v for k, v in stats.items()})
    return loss, out


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
    mesh=None,
):
    """Log-probs [N, T] of the completion under the given parameters, in `minibatches` chunks.

    With `prompt_tokens` [Q, P] / `prompt_mask`, the shared-prompt layout (`tokens_NxL` is then
    the completions [N, T]), packed with `packed`; as the train step computes them. `mesh`: the
    run's, traced under as the train step is (`sharding.tracing_under`).
    """
    with sharding.tracing_under(mesh):
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
        out = jax.lax.map(one, jax.tree.map(functools.partial(split, m=minibatches), xs))
        return out.reshape(n, num_completion)


# The reference and old log-probs of a step (`pipeline.make_batch`), jitted here once for every
# caller; prompt_tokens / prompt_mask / packed (shared-prompt layouts) are traced arguments.
jit_logprobs = jax.jit(
    logprobs_fn,
    static_argnames=(
        "graphdef",
        "num_completion",
        "temperature",
        "chunk",
        "disable_lora",
        "minibatches",
        "mesh",
    ),
)
