"""Decoder-only transformer of the Llama and Qwen2 families (Flax NNX).

One module covers both: GQA, rotate-half RoPE (optionally `llama3`-scaled), q/k/v bias (Qwen2),
o_proj bias (Llama `attention_bias`), SwiGLU MLP, RMSNorm, tied or untied embeddings. Parameters
are fp32 master weights (`param_dtype`) cast to the compute `dtype` (e.g. bf16) at use; attention
scores, softmax and logits are fp32.

Dropout (LoRA only) runs when the model is in train mode (`model.train()`); a new model is in eval
mode (`model.eval()`), so sampling and log-probs are deterministic by default.

Shape legend (docs/design.md): N rows, T new tokens, S key/cache slots, E hidden width, H heads,
K kv heads, D head dim, V vocab.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
from flax import nnx

from mmr_jax.models import attention_impl, decoding, layers
from mmr_jax.models import config as config_lib
from mmr_jax.models import lora as lora_lib


def split_key(key, i):
    """The dropout key of part `i` (a layer, the prompt or the completions), None without one."""
    return None if key is None else jax.random.fold_in(key, i)


def _dense(name, din, dout, bias, *, dtype, param_dtype, frozen_dtype, lora, key, index):
    use = lora if lora is not None and lora.targets(name) else None
    return layers.Dense(
        din,
        dout,
        use_bias=bias,
        dtype=dtype,
        param_dtype=param_dtype,
        kernel_dtype=frozen_dtype,
        lora=use,
        key=jax.random.fold_in(key, index),
    )


class Attention(nnx.Module):
    def __init__(
        self, cfg: config_lib.ModelConfig, *, dtype, param_dtype, lora, key, frozen_dtype=None
    ):
        kw = dict(dtype=dtype, param_dtype=param_dtype, frozen_dtype=frozen_dtype)
        kw.update(lora=lora, key=key)

        h, d = cfg.hidden_size, cfg.head_dim
        self.q_proj = _dense("q_proj", h, cfg.num_heads * d, cfg.attention_bias, index=0, **kw)
        self.k_proj = _dense("k_proj", h, cfg.num_kv_heads * d, cfg.attention_bias, index=1, **kw)
        self.v_proj = _dense("v_proj", h, cfg.num_kv_heads * d, cfg.attention_bias, index=2, **kw)
        self.o_proj = _dense("o_proj", cfg.num_heads * d, h, cfg.o_proj_bias, index=3, **kw)
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, d

    def qkv(self, x_NxTxE, cos, sin, *, disable_lora, key, kernels_t=None):
        """Rotated q [N,T,H,D], k [N,T,K,D] and v [N,T,K,D]. `kernels_t`: see `Decoder`."""
        b, t, _ = x_NxTxE.shape
        kt = kernels_t or {}
        kw = dict(disable_lora=disable_lora)
        q = self.q_proj(x_NxTxE, dropout_key=split_key(key, 0), kernel_t=kt.get("q_proj"), **kw)
        k = self.k_proj(x_NxTxE, dropout_key=split_key(key, 1), kernel_t=kt.get("k_proj"), **kw)
        v = self.v_proj(x_NxTxE, dropout_key=split_key(key, 2), kernel_t=kt.get("v_proj"), **kw)
        q = layers.apply_rope(q.reshape(b, t, self.num_heads, self.head_dim), cos, sin)
        k = layers.apply_rope(k.reshape(b, t, self.num_kv_heads, self.head_dim), cos, sin)
        return q, k, v.reshape(b, t, self.num_kv_heads, self.head_dim)

    def out(self, o_NxTxHD, *, disable_lora, key, kernels_t=None):
        return self.o_proj(
            o_NxTxHD,
            disable_lora=disable_lora,
            dropout_key=split_key(key, 3),
            kernel_t=(kernels_t or {}).get("o_proj"),
        )


class MLP(nnx.Module):
    def __init__(
        self, cfg: config_lib.ModelConfig, *, dtype, param_dtype, lora, key, frozen_dtype=None
    ):
        kw = dict(dtype=dtype, param_dtype=param_dtype, frozen_dtype=frozen_dtype)
        kw.update(lora=lora, key=key)
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = _dense("gate_proj", h, i, False, index=4, **kw)
        self.up_proj = _dense("up_proj", h, i, False, index=5, **kw)
        self.down_proj = _dense("down_proj", i, h, False, index=6, **kw)

    def __call__(self, x_NxTxE, *, disable_lora=False, key=None, kernels_t=None):
        kt = kernels_t or {}
        kw = dict(disable_lora=disable_lora)
        g = self.gate_proj(
            x_NxTxE, dropout_key=split_key(key, 4), kernel_t=kt.get("gate_proj"), **kw
        )
        u = self.up_proj(x_NxTxE, dropout_key=split_key(key, 5), kernel_t=kt.get("up_proj"), **kw)
        return self.down_proj(
            jax.nn.silu(g) * u, dropout_key=split_key(key, 6), kernel_t=kt.get("down_proj"), **kw
        )


class Block(nnx.Module):
    def __init__(
        self, cfg: config_lib.ModelConfig, *, dtype, param_dtype, lora, key, frozen_dtype=None
    ):
        kw = dict(dtype=dtype, param_dtype=param_dtype)
        self.input_layernorm = layers.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, **kw)
        self.self_attn = Attention(cfg, lora=lora, key=key, frozen_dtype=frozen_dtype, **kw)
        self.post_attention_layernorm = layers.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, **kw)
        self.mlp = MLP(cfg, lora=lora, key=key, frozen_dtype=frozen_dtype, **kw)

    def __call__(self, x_NxTxE, cos, sin, mask, disable_lora, key, *, impl="xla", dense=None):
        """Full-sequence block (keys = the T tokens themselves): `mask` an `attention_impl.Mask`
        (`dense` its [N, T, T] form, made once outside the layer scan), `impl` the backend."""
        h = self.input_layernorm(x_NxTxE)
        q, k, v = self.self_attn.qkv(h, cos, sin, disable_lora=disable_lora, key=key)
        o = attention_impl.dot_product(q, k, v, mask, implementation=impl, dense=dense)
        x = x_NxTxE + self.self_attn.out(o, disable_lora=disable_lora, key=key)
        return x + self.mlp(self.post_attention_layernorm(x), disable_lora=disable_lora, key=key)


_CHECKPOINT_POLICIES = {  # config_lib.REMAT_POLICIES -> what jax.checkpoint keeps
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    "dots_with_no_batch_dims_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def scan_layers(layers_module, fn, carry, xs=None, *, remat="none", unroll=1):
    """Runs `fn(block, carry, index, x) -> (carry, y)` over the stacked layers with one scan.

    `layers_module` is the decoder's stacked `Block` (every variable has a leading layer axis);
    each step merges one layer's slice into a `Block` and calls `fn` on it, so XLA compiles the
    layer once, not once per layer. `xs` (a pytree with a leading layer axis, or None) is sliced
    with it. `remat` names a `REMAT_POLICIES` entry applied to the scanned body (the backward pass
    keeps what the policy saves of each layer); `unroll` is `lax.scan`'s (num_layers unrolls it
    into the straight-line program of an unscanned model: used by benchmarks/bench_compile.py).
    Returns (carry, ys).
    """
    graphdef, state = nnx.split(layers_module)
    num_layers = jax.tree.leaves(state)[0].shape[0]

    def body(carry, inputs):
        layer_state, index, x = inputs
        return fn(nnx.merge(graphdef, layer_state), carry, index, x)

    policy = _CHECKPOINT_POLICIES[config_lib.remat_policy_name(remat)]
    if policy is not None:
        body = jax.checkpoint(body, policy=policy, prevent_cse=False)
    inputs = (state, jnp.arange(num_layers, dtype=jnp.int32), xs)
    return jax.lax.scan(body, carry, inputs, unroll=unroll)


class Decoder(decoding.CachedDecoding, nnx.Module):
    """Causal LM: tokens [N, T] -> fp32 logits [N, T, V]; its KV-cache decoding methods
    (`init_cache`, `forward_cached`, `forward_cached_shared_prompt`, ...) are in
    `decoding.CachedDecoding`.

    Args:
      cfg: sizes and options from config.json; `cfg.remat` names the remat policy of the
        scanned layer in the training forwards (`config.REMAT_POLICIES`).
      dtype: compute dtype (jnp.float32 or jnp.bfloat16).
      param_dtype: storage dtype of the parameters (fp32 master weights).
      lora: adapters on `lora.target_modules`, or None.
      frozen_dtype: with `lora`, the storage dtype of the frozen weight matrices (projection
        kernels, embedding, LM head; e.g. bf16: half the memory, and with a bf16 compute dtype
        the same values, since they are cast to it at use); norms, biases and the adapters stay
        in `param_dtype`. None (or no LoRA): `param_dtype`.
      rngs: parameter init (and LoRA dropout) randomness.
    """

    def __init__(
        self,
        cfg: config_lib.ModelConfig,
        *,
        dtype=jnp.float32,
        param_dtype=jnp.float32,
        lora: lora_lib.LoraConfig | None = None,
        frozen_dtype=None,
        rngs: nnx.Rngs,
    ):
        self.config, self.dtype, self.lora_config = cfg, dtype, lora
        kw = dict(dtype=dtype, param_dtype=param_dtype)
        frozen = param_dtype if lora is None or frozen_dtype is None else frozen_dtype
        fkw = dict(dtype=dtype, param_dtype=frozen)  # the frozen matrices outside the layers
        # One draw from `rngs`, then fold_in per module: cheap to trace under nnx.eval_shape.
        key = rngs.params()
        embed_key, head_key = jax.random.fold_in(key, 10**6), jax.random.fold_in(key, 10**6 + 1)
        self.embed_tokens = layers.Embed(cfg.vocab_size, cfg.hidden_size, key=embed_key, **fkw)
        # One Block whose variables carry a leading layer axis (layer i drawn from fold_in(key, i)).
        layer_keys = jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(cfg.num_layers))
        self.layers = nnx.vmap(
            lambda k: Block(cfg, lora=lora, key=k, frozen_dtype=frozen, **kw), in_axes=0, out_axes=0
        )(layer_keys)
        self.norm = layers.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, **kw)
        self.lm_head = nnx.data(
            None
            if cfg.tie_word_embeddings
            else layers.Dense(
                cfg.hidden_size, cfg.vocab_size, use_bias=False, lora=None, key=head_key, **fkw
            )
        )
        self.inv_freq = tuple(
            float(f)
            for f in layers.rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling_dict)
        )
        use_dropout = lora is not None and lora.dropout > 0
        self.dropout_rngs = nnx.data(nnx.Rngs(dropout=lora.seed) if use_dropout else None)
        self.deterministic = True  # eval mode; `model.train()` turns LoRA dropout on

    # ----- full-sequence forward -------------------------------------------------------------

    def __call__(
        self, tokens_NxT, *, positions_NxT=None, attention_mask_NxT=None, disable_lora=False
    ):
        """fp32 logits [N, T, V]; attention is causal and ignores keys where the mask is 0."""
        h = self.hidden(
            tokens_NxT,
            positions_NxT=positions_NxT,
            attention_mask_NxT=attention_mask_NxT,
            disable_lora=disable_lora,
        )
        return self.logits_from_hidden(h)

    def hidden(
        self, tokens_NxT, *, positions_NxT=None, attention_mask_NxT=None, disable_lora=False
    ):
        """Final-normed hidden states [N, T, E] in the compute dtype."""
        chex.assert_rank(tokens_NxT, 2)
        b, t = tokens_NxT.shape
        if attention_mask_NxT is None:
            attention_mask_NxT = jnp.ones((b, t), jnp.bool_)
        attention_mask_NxT = attention_mask_NxT.astype(jnp.bool_)
        if positions_NxT is None:
            positions_NxT = jnp.maximum(jnp.cumsum(attention_mask_NxT, axis=-1) - 1, 0)
        mask = attention_impl.causal(attention_mask_NxT)
        impl = self.config.attention_impl
        dense = None if impl == "pallas_tpu" else mask.dense()
        cos, sin = layers.rope_cos_sin(positions_NxT, self.inv_freq)
        key = self.dropout_key()

        def layer(block, x, i, _):
            out = block(x, cos, sin, mask, disable_lora, split_key(key, i), impl=impl, dense=dense)
            return out, None

        x, _ = self.scan(layer, self.embed_tokens(tokens_NxT), remat=self.config.remat)
        return self.norm(x)

    def scan(self, fn, carry, xs=None, *, remat="none"):
        """`scan_layers` over this model's layers (`config.scan_unroll` applies)."""
        return scan_layers(self.layers, fn, carry, xs, remat=remat, unroll=self.config.scan_unroll)

    def logits_from_hidden(self, h_NxTxE):
        """fp32 logits [N, T, V] from final-normed hidden states."""
        if self.lm_head is None:
            return self.embed_tokens.attend(h_NxTxE)
        w = self.lm_head.kernel[...].astype(self.dtype)
        return jnp.einsum(
            "bth,hv->btv", h_NxTxE.astype(self.dtype), w, preferred_element_type=jnp.float32
        )

    def dropout_key(self):
        """This call's dropout key (None when deterministic or without a dropout stream)."""
        if self.deterministic or self.dropout_rngs is None:
            return None
        return self.dropout_rngs.dropout()
