"""Building blocks of the decoder: a LoRA-capable dense layer, RMSNorm, embedding and RoPE.

Parameters are stored in `param_dtype` (fp32 master weights) and cast to the compute `dtype` where
they are used. Attribute names follow the Hugging Face module names (`q_proj`, `input_layernorm`,
...) so that the safetensors name table in `loading.py` stays a plain rename.

Shape legend (docs/design.md): N rows, T tokens, E hidden width, H heads, D head dim, V vocab,
r LoRA rank.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mmr_jax.models import lora as lora_lib


def _lead(v_F, ndim: int):
    """Reshapes a vector [F] to [1, ..., 1, F] of rank `ndim` (explicit broadcasting)."""
    return v_F.reshape((1,) * (ndim - 1) + v_F.shape)


def weight_major_matmul(x, w_OxI, preferred_element_type=None):
    """x @ w_OxI.T for x [..., in] with the weight [out, in] as stored: computed as w @ x^T.

    XLA:CPU's matmul packs its right-hand operand; with the weight on the left only the few rows
    of x get packed, so a decode step (32 rows) reads each weight once as it lies: SmolLM2's
    linear layers 104 -> 70 ms a step. The barrier keeps XLA from folding the transpose of the
    small [out, rows] result back into the product (which would put the weight on the right).
    """
    lead, din = x.shape[:-1], x.shape[-1]
    y_OxN = jnp.einsum(
        "oi,ni->on", w_OxI, x.reshape(-1, din), preferred_element_type=preferred_element_type
    )
    return jax.lax.optimization_barrier(y_OxN).T.reshape(*lead, w_OxI.shape[0])


class Dense(nnx.Module):
    """y = x @ kernel + bias (+ scale * dropout(x) @ lora_a @ lora_b when LoRA is on).

    kernel is [in, out] (the transpose of a HF Linear weight), stored in `kernel_dtype` (default
    `param_dtype`: bf16 for a frozen base under LoRA); bias, lora_a [in, r] and lora_b [r, out]
    (`nnx.LoRAParam`, B zero-initialised so a fresh adapter leaves the base unchanged) in
    `param_dtype`.
    """

    def __init__(
        self,
        din: int,
        dout: int,
        *,
        use_bias: bool,
        dtype,
        param_dtype,
        lora: lora_lib.LoraConfig | None,
        key: jax.Array,
        kernel_dtype=None,
    ):
        k_kernel, k_lora = jax.random.split(key)
        init = jax.nn.initializers.normal(0.02)
        kernel_dtype = param_dtype if kernel_dtype is None else kernel_dtype
        self.kernel = nnx.Param(init(k_kernel, (din, dout), param_dtype).astype(kernel_dtype))
        self.bias = nnx.data(nnx.Param(jnp.zeros((dout,), param_dtype)) if use_bias else None)
        self.dtype = dtype
        a = b = None
        if lora is not None:
            bound = 1.0 / math.sqrt(din)  # PEFT's kaiming_uniform(a=sqrt(5)) for lora_A.
            a = nnx.LoRAParam(
                jax.random.uniform(k_lora, (din, lora.rank), param_dtype, -bound, bound)
            )
            b = nnx.LoRAParam(jnp.zeros((lora.rank, dout), param_dtype))
        self.lora_a, self.lora_b = nnx.data(a), nnx.data(b)
        self.lora_scale = lora.alpha / lora.rank if lora is not None else 0.0
        self.lora_dropout = lora.dropout if lora is not None else 0.0

    def __call__(self, x, *, disable_lora: bool = False, dropout_key=None, kernel_t=None):
        """x [..., in] -> [..., out] in the compute dtype.

        `kernel_t`: this layer's kernel transposed ([out, in], e.g. from
        `Decoder.weight_major_kernels`), used in its place through `weight_major_matmul`.
        """
        x = x.astype(self.dtype)
        if kernel_t is None:
            y = x @ self.kernel[...].astype(self.dtype)
        else:
            y = weight_major_matmul(x, kernel_t.astype(self.dtype))
        if self.bias is not None:
            y = y + _lead(self.bias[...].astype(self.dtype), y.ndim)
        if self.lora_a is not None and not disable_lora:
            xd = x
            if dropout_key is not None and self.lora_dropout > 0:
                keep = jax.random.bernoulli(dropout_key, 1.0 - self.lora_dropout, x.shape)
                xd = jnp.where(keep, x / (1.0 - self.lora_dropout), 0).astype(self.dtype)
            low = xd @ self.lora_a[...].astype(self.dtype)
            y = y + (low @ self.lora_b[...].astype(self.dtype)) * self.lora_scale
        return y


class RMSNorm(nnx.Module):
    """x / sqrt(mean(x^2) + eps) * weight, normalised in fp32 as transformers does."""

    def __init__(self, dim: int, *, eps: float, dtype, param_dtype):
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype))
        self.eps = eps
        self.dtype = dtype

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return _lead(self.weight[...].astype(self.dtype), x.ndim) * x32.astype(self.dtype)


class Embed(nnx.Module):
    """Token embedding [V, E]; `attend` gives tied-head logits in fp32."""

    def __init__(self, vocab: int, dim: int, *, dtype, param_dtype, key: jax.Array):
        init = jax.nn.initializers.normal(0.02)
        self.embedding = nnx.Param(init(key, (vocab, dim), param_dtype))
        self.dtype = dtype

    def __call__(self, tokens_NxT):
        return jnp.take(self.embedding[...], tokens_NxT, axis=0).astype(self.dtype)

    def attend(self, h_NxTxE):
        w = self.embedding[...].astype(self.dtype)
        return jnp.einsum(
            "bth,vh->btv", h_NxTxE.astype(self.dtype), w, preferred_element_type=jnp.float32
        )


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> np.ndarray:
    """Inverse frequencies [D/2] (float32), with the `llama3` rescaling when `scaling` is given."""
    inv = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / head_dim))
    inv = inv.astype(np.float32)
    if scaling is None:
        return inv
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv
    inv_l = np.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * inv_l / factor + smooth * inv_l
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, inv_l).astype(np.float32)


def rope_cos_sin(positions_NxT, inv_freq):
    """cos, sin [N, T, D] (fp32) for rotate-half RoPE at integer positions."""
    freqs = positions_NxT.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)[None, None, :]
    b, t, half = freqs.shape
    emb = jnp.broadcast_to(freqs[:, :, None, :], (b, t, 2, half)).reshape(b, t, 2 * half)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x_NxTxHxD, cos, sin):
    """Rotates x (HF `rotate_half` layout) in fp32 and casts back to x's dtype.

    rotate_half(x) = [-x2, x1] is taken as x viewed [..., 2, D/2], halves reversed, first
    negated: elementwise work that fuses, where concatenating slices made the backward pad.
    """
    x = x_NxTxHxD.astype(jnp.float32)
    *lead, d = x.shape
    sign = jnp.asarray([-1.0, 1.0], jnp.float32).reshape((1,) * len(lead) + (2, 1))
    rotated = (jnp.flip(x.reshape(*lead, 2, d // 2), axis=-2) * sign).reshape(x.shape)
    out = x * cos[:, :, None, :] + rotated * sin[:, :, None, :]
    return out.astype(x_NxTxHxD.dtype)


def merged_params(model: nnx.Module) -> list[tuple[tuple, jax.Array]]:
    """[(path, value)] of every non-LoRA parameter, each adapter merged into its kernel.

    A kernel with an adapter becomes kernel + scale * lora_a @ lora_b (per layer where the
    parameters are stacked: [L, in, r] @ [L, r, out]); the model is unchanged. Export and the
    embedded engine's weight copy both use this: one merge.
    """
    merged = {}
    for path, module in nnx.iter_graph(model):
        if isinstance(module, Dense) and module.lora_a is not None:
            kernel = module.kernel[...]
            delta = (module.lora_a[...] @ module.lora_b[...]) * module.lora_scale
            # in the wider of the two dtypes: a bf16 frozen base keeps the fp32 adapter's delta
            wide = jnp.promote_types(kernel.dtype, delta.dtype)
            merged[(*path, "kernel")] = kernel.astype(wide) + delta.astype(wide)
    return [
        (path, merged.get(path, var.get_value()))
        for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param))
        if not isinstance(var, nnx.LoRAParam)
    ]
