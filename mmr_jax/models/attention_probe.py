"""Resolves `attention_impl='auto'` once at start-up, outside any trace, by trying the fused
backends on the run's own attention structure (issue 45: 'auto' must never break a run).

`choose` compiles and runs, for each candidate in order, the forward and the gradient of the
training forward's two attention calls at a small size with the config's heads, kv heads, head
dim and dtype, and odd lengths (the completions' T = bucket - 1 is odd):
  the prompts: causal over left-padded rows (`attention_impl.causal`);
  the completions: prompt-then-causal over [prompt ; own] keys, with left-padded prompts,
  right-padded completions and, when the run packs them, several completions (segments) a row.
Each is compared with 'xla' (the reference) on the queries that see a key: outputs within
OUT_ULPS, gradients within GRAD_ULPS bf16 roundings (2^-8) of the reference's largest magnitude
(attention_impl_test's bound, 2 and 4, doubled: the probe must reject a wrong kernel, not
rounding). The first candidate that passes is used; when none does (an error at trace, compile
or run, or a mismatch), one warning names each candidate's reason and 'xla' is used. An explicit
cuDNN form is probed too and raises with the reason (it fails loudly, at start-up).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from mmr_jax.models import attention_impl

CANDIDATES = ("cudnn", "cudnn_maskfree")  # tried in this order by 'auto' on a GPU
OUT_ULPS, GRAD_ULPS = 4, 8
BF16_EPS = 2.0**-8
# The probe's sizes: 2 prompts of P (odd) tokens, 2 completion rows each of T (odd) tokens.
PROBE_B, PROBE_ROWS, PROBE_P, PROBE_T = 2, 2, 37, 45


class Choice(NamedTuple):
    """The backend a run uses and why (for the console header and run.json)."""

    implementation: str
    reason: str


def choose(
    implementation: str,
    dtype,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    *,
    packed: bool = False,
    platform: str | None = None,
    candidates: Sequence[str] = CANDIDATES,
    attend: Callable | None = None,
) -> Choice:
    """The attention backend a run uses (see the module docstring).

    Args:
      implementation: the configured `model.attention_impl`.
      dtype, num_heads, num_kv_heads, head_dim: the model's compute dtype and attention shape.
      packed: whether the run packs several completions a row (its masks carry segments).
      platform: JAX's default backend unless given ('gpu' probes on any platform: the tests).
      candidates: the cuDNN forms 'auto' tries, in order.
      attend: `attention_impl.dot_product` unless given (the tests inject a failing backend).
    """
    attention_impl.resolve(implementation, dtype, head_dim)  # rejects unknown names
    platform = platform or jax.default_backend()
    if implementation not in ("auto", "cudnn", "cudnn_maskfree"):
        return Choice(implementation, "configured")
    if implementation != "auto":
        error = _probe_one(implementation, dtype, num_heads, num_kv_heads, head_dim, packed, attend)
        if error:
            raise RuntimeError(
                f"attention_impl={implementation!r} fails on this run's attention ({error}); "
                "use attention_impl='auto' (falls back to 'xla') or 'xla'"
            )
        return Choice(implementation, "configured; probe passed")
    if platform != "gpu":
        return Choice(*attention_impl.auto_off_gpu(platform, packed))
    if not attention_impl.cudnn_eligible(dtype, head_dim):
        why = f"auto: cuDNN takes no {jnp.dtype(dtype).name} with head dim {head_dim}"
        return Choice("unfused", why)
    reasons = []
    for name in candidates:
        error = _probe_one(name, dtype, num_heads, num_kv_heads, head_dim, packed, attend)
        if not error:
            tried = f" (before it: {'; '.join(reasons)})" if reasons else ""
            return Choice(name, "auto: probe passed" + tried)
        reasons.append(f"{name}: {error}")
    logging.warning(
        "attention_impl=auto: no cuDNN form works on this run's attention, using 'xla' (%s)",
        "; ".join(reasons),
    )
    return Choice("xla", "auto: fallback (" + "; ".join(reasons) + ")")


@functools.cache
def choose_once(implementation: str, dtype, num_heads, num_kv_heads, head_dim, *, packed) -> Choice:
    """`choose`, run once per process and shape: the trainer's header, run.json and a dry run
    read the same answer."""
    choice = choose(implementation, dtype, num_heads, num_kv_heads, head_dim, packed=packed)
    logging.info("attention: %s (%s)", choice.implementation, choice.reason)
    return choice


def _probe_one(name, dtype, num_heads, num_kv_heads, head_dim, packed, attend) -> str | None:
    """None if backend `name` matches 'xla' on both calls, else why not (one line)."""
    attend = attend or attention_impl.dot_product
    try:
        for q, k, v, mask in probe_cases(dtype, num_heads, num_kv_heads, head_dim, packed):
            weight = _query_weight(q, mask)
            got = _value_and_grads(attend, name, q, k, v, mask, weight)
            ref = _value_and_grads(attention_impl.dot_product, "xla", q, k, v, mask, weight)
            for what, g, r, ulps in zip(
                ("output", "dq", "dk", "dv"), got, ref, (OUT_ULPS,) + (GRAD_ULPS,) * 3, strict=True
            ):
                g, r = np.asarray(g, np.float32), np.asarray(r, np.float32)
                if what == "output":
                    g, r = g * np.asarray(weight != 0), r * np.asarray(weight != 0)
                tol = ulps * BF16_EPS * (float(np.abs(r).max()) or 1.0)
                err = float(np.abs(g - r).max()) if np.isfinite(g).all() else float("inf")
                if not err <= tol:
                    return f"{what} differs from xla by {err:.3g} > {tol:.3g} (T={q.shape[1]})"
    except Exception as e:  # any failure (trace, compile, run) is a reason
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return f"{type(e).__name__}: {first[:200]}"
    return None


def probe_cases(dtype, num_heads, num_kv_heads, head_dim, packed, *, p=PROBE_P, t=PROBE_T):
    """(q, k, v, mask) of the prompts' call (P tokens) and the completions' call (T tokens) at
    the probe's size, or at the run's own P and T (the GPU parity tests)."""
    b, r = PROBE_B, PROBE_B * PROBE_ROWS
    keys = jax.random.split(jax.random.key(0), 6)

    def normal(key, shape):
        return jax.random.normal(key, shape).astype(dtype)

    pvalid = jnp.asarray(np.arange(p)[None] >= np.array([0, p // 3])[:, None])  # left-padded
    prompts = (
        normal(keys[0], (b, p, num_heads, head_dim)),
        normal(keys[1], (b, p, num_kv_heads, head_dim)),
        normal(keys[2], (b, p, num_kv_heads, head_dim)),
        attention_impl.causal(pvalid),
    )
    lengths = np.array([t, t * 4 // 9, 1, t * 3 // 4])  # right-padded, ragged
    own = jnp.asarray(np.arange(t)[None] < lengths[:, None])
    same = None
    if packed:  # two completions a row: tokens [0, 3T/8) and [3T/8, length)
        seg = np.where(np.arange(t)[None] < t * 3 // 8, 0, 1) + 2 * np.arange(r)[:, None]
        same = jnp.asarray(seg[:, :, None] == seg[:, None, :])
    s = p + t
    completions = (
        normal(keys[3], (r, t, num_heads, head_dim)),
        normal(keys[4], (r, s, num_kv_heads, head_dim)),
        normal(keys[5], (r, s, num_kv_heads, head_dim)),
        attention_impl.prompt_then_causal(jnp.repeat(pvalid, PROBE_ROWS, 0), own, same),
    )
    return prompts, completions


def _query_weight(q, mask):
    """Loss weights on the queries whose own position is valid (padding's outputs differ
    between backends and nothing uses them)."""
    t = q.shape[1]
    seen = mask.kv_valid_NxS[:, -t:] & jnp.any(mask.dense(), axis=-1)
    w = jax.random.normal(jax.random.key(1), q.shape[:2] + (q.shape[2] * q.shape[3],))
    return w * seen[..., None]


def _value_and_grads(attend, name, q, k, v, mask, weight):
    """The output and the gradients (q, k, v) of sum(output * weight), compiled and run."""

    def loss(q, k, v, mask):
        o = attend(q, k, v, mask, implementation=name)
        return jnp.sum(o.astype(jnp.float32) * weight), o

    @jax.jit
    def run(q, k, v, valid, extra):  # the static pattern stays a host constant
        m = mask._replace(kv_valid_NxS=valid, extra_NxTxS=extra)
        (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v, m)
        return (out, *grads)

    return jax.block_until_ready(run(q, k, v, mask.kv_valid_NxS, mask.extra_NxTxS))
