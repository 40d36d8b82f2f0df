"""Diversity-aware reward reweighting: MMR (MMR-GRPO, Algorithm 1) and the DRA-GRPO baseline.

Shape legend: B prompts, G completions per prompt, D embedding width. `...` is any leading batch
shape (usually [B]); every function treats the last reward axis as one group of G completions.

The kernels (`mmr_reweight`, `mmr_reweight_with_aux`, `dra_reweight`, `adaptive_lambda`) are pure,
jit-able and vmap-able; they assume finite inputs. The host-side entry `reweight` validates the
inputs with `check_inputs` (a clear ValueError instead of a silent NaN), picks the method by name
from `REWEIGHTERS` and applies the scope ('group' or the released code's 'batch').

Batch scope. The released code runs the MMR loop once over a whole micro-batch of completions
(several prompts at once, one lambda from all of their rewards). The same rule is obtained here by
reshaping [B, G] rewards to [1, B*G] (and [B, G, D] embeddings to [1, B*G, D]), reweighting that
single group, and reshaping back; `reweight(..., scope='batch')` does exactly this.
"""

from collections.abc import Callable
from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np


class MmrAux(NamedTuple):
    """Per-group by-products of the greedy MMR selection, for metrics."""

    lam: jax.Array  # [...] the lambda used (adaptive or fixed)
    order: jax.Array  # [..., G] int32 indices in selection order; -1 after the last valid pick


def _valid_mask(rewards: jax.Array, mask: jax.Array | None) -> jax.Array:
    return jnp.ones(rewards.shape, bool) if mask is None else mask.astype(bool)


def gram_cosine(embeddings: jax.Array) -> tuple[jax.Array, jax.Array]:
    """[..., G, D] -> (cosines [..., G, G], squared row norms [..., G]), no scaling."""
    # Normalising the Gram matrix by its diagonal reads the [G, D] embeddings once (the matmul)
    # instead of three times; it is the same cosine up to rounding.
    gram = jnp.einsum(
        "...id,...jd->...ij", embeddings, embeddings, precision=jax.lax.Precision.HIGHEST
    )
    sq = jnp.diagonal(gram, axis1=-2, axis2=-1)
    nonzero = sq > 0
    # Double `where`: a zero row gets similarity 0 and a finite (zero) gradient, never NaN.
    inv = jnp.where(nonzero, 1.0 / jnp.sqrt(jnp.where(nonzero, sq, 1.0)), 0.0)
    return gram * inv[..., :, None] * inv[..., None, :], sq


def cosine_similarity_scaled(embeddings: jax.Array) -> jax.Array:
    """`cosine_similarity` with every row first divided by its largest |entry| (always safe)."""
    # Cosine is scale-invariant per row: the scaled Gram matrix lies in [-D, D]. Unscaled, rows
    # of norm ~1e20 overflowed it (inf * 0 = NaN) and rows of norm ~1e-20 underflowed to a zero
    # diagonal (read as zero rows).
    amax = jnp.max(jnp.abs(embeddings), axis=-1, keepdims=True)
    embeddings = embeddings / jnp.where(amax > 0, amax, 1.0).astype(embeddings.dtype)
    return gram_cosine(embeddings)[0]


def cosine_similarity(embeddings: jax.Array, *, mask: jax.Array | None = None) -> jax.Array:
    """[..., G, D] -> [..., G, G] cosine similarities; a zero row has similarity 0 to everything.

    Overflow-safe at any scale. The unscaled Gram matrix is exact to rounding whenever every
    squared row norm is finite and well above the smallest normal number; only otherwise (huge,
    tiny or zero rows) are the cosines recomputed from max-abs scaled rows. Scaling on every call
    cost a pass over [..., G, D] and ~1.5x the MMR kernel's time (issue 27 item 9; measured by
    benchmarks/bench_mmr.py, which times both forms).

    mask: [..., G] bool, True = a real row. Rows masked out take no part in choosing the path,
    so garbage there changes no real row's cosines; their own rows and columns may then be
    non-finite, and callers must not read them (MMR and DRA never do).
    """
    cos, sq = gram_cosine(embeddings)
    info = jnp.finfo(embeddings.dtype)
    # sq >= tiny / eps: the row's squares and products sum far above the subnormal range, so
    # underflowed terms move the cosine by less than one rounding. A zero row also takes the
    # scaled path: a tiny nonzero row underflows to sq == 0 and only the scaling tells them apart.
    ok = jnp.isfinite(sq) & (sq >= info.tiny / info.eps)
    if mask is not None:
        ok = ok | ~mask.astype(bool)
    return jax.lax.cond(jnp.all(ok), lambda: cos, lambda: cosine_similarity_scaled(embeddings))


def adaptive_lambda(rewards: jax.Array, *, mask: jax.Array | None = None) -> jax.Array:
    """lambda = sigmoid(std(r)) per group, std the population std (ddof=0) over valid entries.

    MMR-GRPO, Sec. 3.3: lambda lies in [0.5, 1); 0.5 when the group's rewards are all equal.

    Args:
      rewards: [..., G] float rewards.
      mask: [..., G] bool, True = a real completion; None = all valid.

    Returns:
      [...] lambda per group (0.5 for a fully masked group).
    """
    valid = _valid_mask(rewards, mask)
    n = jnp.maximum(jnp.sum(valid, axis=-1, keepdims=True), 1)
    mean = jnp.sum(jnp.where(valid, rewards, 0.0), axis=-1, keepdims=True) / n
    var = jnp.sum(jnp.where(valid, jnp.square(rewards - mean), 0.0), axis=-1) / n[..., 0]
    # sqrt has an infinite derivative at 0; keep the gradient finite for equal rewards.
    std = jnp.where(var > 0, jnp.sqrt(jnp.where(var > 0, var, 1.0)), 0.0)
    return jax.nn.sigmoid(std)


def _mmr_group(
    r_G: jax.Array, sim_GxG: jax.Array, lam: jax.Array, valid_G: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Algorithm 1 on one group from its similarities; returns (reweighted [G], order [G])."""
    g = r_G.shape[0]
    idx_G = jnp.arange(g)
    neg_inf = jnp.array(-jnp.inf, r_G.dtype)
    # jnp.argmax returns the first maximum, which is the lowest-index tie-break required.
    first = jnp.argmax(jnp.where(valid_G, r_G, neg_inf))
    any_valid = jnp.any(valid_G)
    picked_G = (idx_G == first) & any_valid
    out_G = r_G
    # best_sim starts as the similarity to the first pick only: Algorithm 1 takes the max over
    # the selected set S (no clamp at 0, unlike the released code's zero-initialised running max).
    best_G = sim_GxG[:, first]
    # Each entry's pick step (g = never picked); the order is rebuilt after the loop, because a
    # dynamic-index write per step costs more than the rest of the step on CPU.
    step_G = jnp.where(picked_G, 0, g).astype(jnp.int32)

    def step(t, carry):
        out_G, picked_G, best_G, step_G = carry
        score_G = lam * r_G - (1.0 - lam) * best_G
        cand_G = valid_G & ~picked_G
        i = jnp.argmax(jnp.where(cand_G, score_G, neg_inf))
        ok = jnp.any(cand_G)  # False once every valid entry is placed (ragged groups)
        hit_G = (idx_G == i) & ok
        out_G = jnp.where(hit_G, score_G, out_G)
        picked_G = picked_G | hit_G
        best_G = jnp.where(ok, jnp.maximum(best_G, sim_GxG[:, i]), best_G)
        step_G = jnp.where(hit_G, t, step_G)
        return out_G, picked_G, best_G, step_G

    carry = (out_G, picked_G, best_G, step_G)
    # Unrolling short loops lets XLA fuse the steps; long groups keep a compact while loop.
    out_G, _, _, step_G = jax.lax.fori_loop(1, g, step, carry, unroll=g <= 16)
    order_G = jnp.argsort(step_G, stable=True).astype(jnp.int32)
    order_G = jnp.where(jnp.sort(step_G) < g, order_G, -1)
    return jnp.where(valid_G, out_G, r_G), order_G


def mmr_reweight_with_aux(
    rewards: jax.Array,
    embeddings: jax.Array,
    *,
    lam: float | jax.Array | None = None,
    mask: jax.Array | None = None,
) -> tuple[jax.Array, MmrAux]:
    """`mmr_reweight` that also returns the lambda and the selection order (see `MmrAux`)."""
    chex.assert_rank(embeddings, rewards.ndim + 1)
    chex.assert_equal_shape_prefix([rewards, embeddings], rewards.ndim)
    lead, g, d = rewards.shape[:-1], rewards.shape[-1], embeddings.shape[-1]
    valid = _valid_mask(rewards, mask)
    chex.assert_shape(valid, rewards.shape)
    lam_ = adaptive_lambda(rewards, mask=valid) if lam is None else jnp.asarray(lam, rewards.dtype)
    lam_ = jnp.broadcast_to(lam_, lead)
    n = int(np.prod(lead))
    sim = cosine_similarity(embeddings.reshape(n, g, d), mask=valid.reshape(n, g))
    out, order = jax.vmap(_mmr_group)(
        rewards.reshape(n, g), sim, lam_.reshape(n), valid.reshape(n, g)
    )
    return out.reshape(rewards.shape), MmrAux(lam=lam_, order=order.reshape(rewards.shape))


def mmr_reweight(
    rewards: jax.Array,
    embeddings: jax.Array,
    *,
    lam: float | jax.Array | None = None,
    mask: jax.Array | None = None,
) -> jax.Array:
    """MMR reward reweighting per group (MMR-GRPO, Algorithm 1).

    Greedy selection: the first pick is argmax r (lowest index on ties) and keeps its raw reward;
    then, G-1 times, every unpicked valid i gets score_i = lam * r_i - (1 - lam) * max_{j in S}
    cos(i, j), the argmax of score (lowest index on ties) joins S and its reward becomes its score.
    lam=None uses `adaptive_lambda` (sigmoid of the population std of the valid rewards).

    Masked entries come back unchanged and influence nothing (lambda, argmax, similarities). A
    fully masked group comes back unchanged. With lam=1 the output equals the input.

    Args:
      rewards: [..., G] float rewards.
      embeddings: [..., G, D] completion embeddings (normalised inside; zero rows are allowed and
        have cosine 0 to everything).
      lam: None for the adaptive lambda, or a fixed value in [0, 1] (scalar or [...]).
      mask: [..., G] bool, True = a real completion; None = all valid.

    Returns:
      [..., G] reweighted rewards, same dtype as `rewards`.
    """
    return mmr_reweight_with_aux(rewards, embeddings, lam=lam, mask=mask)[0]


def dra_reweight(
    rewards: jax.Array, embeddings: jax.Array, *, mask: jax.Array | None = None
) -> jax.Array:
    """DRA-GRPO baseline: r_i / (1 + sum_{j != i, j valid} cos(i, j)) within each group.

    Chen et al. 2025 (DRA-GRPO), as stated in docs/design.md. The denominator can reach 0 or go
    negative only for strongly anti-aligned embeddings, which sentence encoders do not produce in
    practice; it is floored at the dtype's machine epsilon there (see the code), never changed
    above it.

    Args:
      rewards: [..., G] float rewards.
      embeddings: [..., G, D] completion embeddings.
      mask: [..., G] bool, True = a real completion; masked entries come back unchanged.

    Returns:
      [..., G] reweighted rewards.
    """
    chex.assert_rank(embeddings, rewards.ndim + 1)
    chex.assert_equal_shape_prefix([rewards, embeddings], rewards.ndim)
    valid = _valid_mask(rewards, mask)
    chex.assert_shape(valid, rewards.shape)
    g = rewards.shape[-1]
    sim = cosine_similarity(embeddings, mask=valid)
    off_diag = ~jnp.eye(g, dtype=bool).reshape((1,) * (rewards.ndim - 1) + (g, g))
    pair = valid[..., :, None] & valid[..., None, :] & off_diag
    denom = 1.0 + jnp.sum(jnp.where(pair, sim, 0.0), axis=-1)
    # Two antipodal embeddings give 1 + (-1) = 0 exactly (inf or 0/0 = NaN), a net-negative sum
    # flips the reward's sign: the floor keeps the reward finite with its sign.
    denom = jnp.maximum(denom, jnp.finfo(denom.dtype).eps)
    return jnp.where(valid, rewards / jnp.where(valid, denom, 1.0), rewards)


# --- Registry and host-side entry -------------------------------------------------------------

Reweighter = Callable[..., jax.Array]
REWEIGHTERS: dict[str, Reweighter] = {}
SCOPES = ("group", "batch")  # one selection per prompt (the paper), or one over the whole batch


def register(name: str) -> Callable[[Reweighter], Reweighter]:
    """Decorator: `REWEIGHTERS[name] = fn`; fn(rewards, embeddings, *, lam, mask) -> rewards."""

    def deco(fn: Reweighter) -> Reweighter:
        if name in REWEIGHTERS:
            raise ValueError(f"reweighting method {name!r} is already registered")
        REWEIGHTERS[name] = fn
        return fn

    return deco


@register("none")
def _none(rewards, embeddings, *, lam=None, mask=None):
    del embeddings, lam, mask
    return rewards


@register("mmr")
def _mmr(rewards, embeddings, *, lam=None, mask=None):
    return mmr_reweight(rewards, embeddings, lam=lam, mask=mask)


@register("dra")
def _dra(rewards, embeddings, *, lam=None, mask=None):
    if lam is not None:
        raise ValueError("dra reweighting takes no lam")
    return dra_reweight(rewards, embeddings, mask=mask)


def check_inputs(
    rewards: np.ndarray | jax.Array,
    embeddings: np.ndarray | jax.Array | None,
    *,
    mask: np.ndarray | jax.Array | None = None,
    lam: float | None = None,
) -> None:
    """Host-side validation; raises ValueError naming the argument and its shape.

    Checks: rewards rank >= 1, floating (bfloat16 included) and finite; embeddings rank = rewards
    rank + 1, the same leading and G axes, finite; mask the shape of rewards, bool or 0/1; lam in
    [0, 1]. Not for use inside jit.
    """
    r = np.asarray(rewards)
    if r.ndim < 1:
        raise ValueError(f"rewards must have rank >= 1 ([..., G]), got shape {r.shape}")
    # jnp.issubdtype, not np's: NumPy does not count ml_dtypes' bfloat16 as floating.
    if not jnp.issubdtype(r.dtype, jnp.floating):
        raise ValueError(f"rewards must be floating point, got {r.dtype} with shape {r.shape}")
    if not np.all(np.isfinite(r)):
        raise ValueError(f"rewards of shape {r.shape} contain NaN or inf")
    if embeddings is not None:
        e = np.asarray(embeddings)
        if e.ndim != r.ndim + 1:
            raise ValueError(
                f"embeddings must have rank {r.ndim + 1} ([..., G, D]) to match rewards of shape "
                f"{r.shape}, got shape {e.shape}"
            )
        if e.shape[:-1] != r.shape:
            raise ValueError(
                f"embeddings of shape {e.shape} do not match rewards of shape {r.shape} "
                f"(leading and G axes must agree)"
            )
        if not np.all(np.isfinite(e)):
            raise ValueError(f"embeddings of shape {e.shape} contain NaN or inf")
    if mask is not None and np.shape(mask) != r.shape:
        raise ValueError(
            f"mask of shape {np.shape(mask)} does not match rewards of shape {r.shape}"
        )
    # A float mask would be cast to bool later, NaN and 0.5 silently becoming True.
    if mask is not None and np.asarray(mask).dtype != bool:
        m = np.asarray(mask)
        if not np.all((m == 0) | (m == 1)):
            raise ValueError(f"mask of shape {m.shape} must be bool or 0/1, got other values")
    if lam is not None and not 0.0 <= float(lam) <= 1.0:
        raise ValueError(f"lam must lie in [0, 1], got {lam}")


_JITTED = {name: jax.jit(fn) for name, fn in REWEIGHTERS.items()}
_MMR_WITH_AUX = jax.jit(mmr_reweight_with_aux)


def reweight(
    method: str,
    rewards: np.ndarray | jax.Array,
    embeddings: np.ndarray | jax.Array | None,
    *,
    lam: float | None = None,
    mask: np.ndarray | jax.Array | None = None,
    scope: str = "group",
) -> jax.Array:
    """Reweighted rewards, the shape of `rewards` (`reweight_with_lambda` without its lambda)."""
    return reweight_with_lambda(method, rewards, embeddings, lam=lam, mask=mask, scope=scope)[0]


def reweight_with_lambda(
    method: str,
    rewards: np.ndarray | jax.Array,
    embeddings: np.ndarray | jax.Array | None,
    *,
    lam: float | None = None,
    mask: np.ndarray | jax.Array | None = None,
    scope: str = "group",
) -> tuple[jax.Array, jax.Array | None]:
    """Validates, then reweights with `REWEIGHTERS[method]` (jitted) in the given scope.

    Args:
      method: 'none', 'mmr' or 'dra' (any name in REWEIGHTERS).
      rewards: [B, G] (or [..., G]) rewards.
      embeddings: [B, G, D]; may be None for 'none'.
      lam: fixed MMR lambda, None = adaptive.
      mask: [B, G] bool, True = a real completion.
      scope: 'group' (one greedy selection per prompt, the paper) or 'batch' (one over all B*G
        completions, the released code): the latter reshapes [B, G] -> [1, B*G] and back.

    Returns:
      (reweighted rewards, the shape of `rewards`; the lambda MMR used, [B] by group or [1] in
      batch scope, taken from the selection itself (`MmrAux.lam`); None for other methods).
    """
    if method not in REWEIGHTERS:
        raise ValueError(f"unknown reweighting method {method!r}; known: {sorted(REWEIGHTERS)}")
    if scope not in SCOPES:
        raise ValueError(f"scope must be one of {SCOPES}, got {scope!r}")
    if method == "none":
        check_inputs(rewards, None, mask=mask)
        return jnp.asarray(rewards), None
    check_inputs(rewards, embeddings, mask=mask, lam=lam)
    r, e = jnp.asarray(rewards), jnp.asarray(embeddings)
    m = None if mask is None else jnp.asarray(mask, bool)
    if scope == "batch":
        r, e = r.reshape(1, -1), e.reshape(1, -1, e.shape[-1])
        m = None if m is None else m.reshape(1, -1)
    if method == "mmr":
        out, aux = _MMR_WITH_AUX(r, e, lam=lam, mask=m)
        return out.reshape(np.shape(rewards)), aux.lam
    fn = _JITTED.get(method) or jax.jit(REWEIGHTERS[method])
    return fn(r, e, lam=lam, mask=m).reshape(np.shape(rewards)), None
