"""Decoder-only transformer of the Llama and Qwen2 families (Flax NNX).

One module covers both: GQA, rotate-half RoPE (optionally `llama3`-scaled), q/k/v bias (Qwen2),
o_proj bias (Llama `attention_bias`), SwiGLU MLP, RMSNorm, tied or untied embeddings. Parameters
are fp32 master weights (`param_dtype`) cast to the compute `dtype` (e.g. bf16) at use; attention
scores, softmax and logits are fp32.

Dropout (LoRA only) runs when the model is in train mode (`model.train()`); a new model is in eval
mode (`model.eval()`), so sampling and log-probs are deterministic by default.

Legend: B batch, T new tokens, S key/cache slots, H hidden, N heads, K kv heads, D head dim,
V vocab.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
from flax import nnx

from mmr_jax.kernels import decode_attention
from mmr_jax.models import attention, attention_impl, kv_cache, layers
from mmr_jax.models import config as config_lib
from mmr_jax.models import lora as lora_lib


def _split_key(key, i):
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

    def qkv(self, x_BxTxH, cos, sin, *, disable_lora, key, kernels_t=None):
        """Rotated q [B,T,N,D], k [B,T,K,D] and v [B,T,K,D]. `kernels_t`: see `Decoder`."""
        b, t, _ = x_BxTxH.shape
        kt = kernels_t or {}
        kw = dict(disable_lora=disable_lora)
        q = self.q_proj(x_BxTxH, dropout_key=_split_key(key, 0), kernel_t=kt.get("q_proj"), **kw)
        k = self.k_proj(x_BxTxH, dropout_key=_split_key(key, 1), kernel_t=kt.get("k_proj"), **kw)
        v = self.v_proj(x_BxTxH, dropout_key=_split_key(key, 2), kernel_t=kt.get("v_proj"), **kw)
        q = layers.apply_rope(q.reshape(b, t, self.num_heads, self.head_dim), cos, sin)
        k = layers.apply_rope(k.reshape(b, t, self.num_kv_heads, self.head_dim), cos, sin)
        return q, k, v.reshape(b, t, self.num_kv_heads, self.head_dim)

    def out(self, o_BxTxND, *, disable_lora, key, kernels_t=None):
        return self.o_proj(
            o_BxTxND,
            disable_lora=disable_lora,
            dropout_key=_split_key(key, 3),
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

    def __call__(self, x_BxTxH, *, disable_lora=False, key=None, kernels_t=None):
        kt = kernels_t or {}
        kw = dict(disable_lora=disable_lora)
        g = self.gate_proj(
            x_BxTxH, dropout_key=_split_key(key, 4), kernel_t=kt.get("gate_proj"), **kw
        )
        u = self.up_proj(x_BxTxH, dropout_key=_split_key(key, 5), kernel_t=kt.get("up_proj"), **kw)
        return self.down_proj(
            jax.nn.silu(g) * u, dropout_key=_split_key(key, 6), kernel_t=kt.get("down_proj"), **kw
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

    def __call__(self, x_BxTxH, cos, sin, mask, disable_lora, key, *, impl="xla", dense=None):
        """Full-sequence block (keys = the T tokens themselves): `mask` an `attention_impl.Mask`
        (`dense` its [B, T, T] form, made once outside the layer scan), `impl` the backend."""
        h = self.input_layernorm(x_BxTxH)
        q, k, v = self.self_attn.qkv(h, cos, sin, disable_lora=disable_lora, key=key)
        o = attention_impl.dot_product(q, k, v, mask, implementation=impl, dense=dense)
        x = x_BxTxH + self.self_attn.out(o, disable_lora=disable_lora, key=key)
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


class Decoder(nnx.Module):
    """Causal LM: tokens [B, T] -> fp32 logits [B, T, V].

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
        self, tokens_BxT, *, positions_BxT=None, attention_mask_BxT=None, disable_lora=False
    ):
        """fp32 logits [B, T, V]; attention is causal and ignores keys where the mask is 0."""
        h = self.hidden(
            tokens_BxT,
            positions_BxT=positions_BxT,
            attention_mask_BxT=attention_mask_BxT,
            disable_lora=disable_lora,
        )
        return self.logits_from_hidden(h)

    def hidden(
        self, tokens_BxT, *, positions_BxT=None, attention_mask_BxT=None, disable_lora=False
    ):
        """Final-normed hidden states [B, T, H] in the compute dtype."""
        chex.assert_rank(tokens_BxT, 2)
        b, t = tokens_BxT.shape
        if attention_mask_BxT is None:
            attention_mask_BxT = jnp.ones((b, t), jnp.bool_)
        attention_mask_BxT = attention_mask_BxT.astype(jnp.bool_)
        if positions_BxT is None:
            positions_BxT = jnp.maximum(jnp.cumsum(attention_mask_BxT, axis=-1) - 1, 0)
        mask = attention_impl.causal(attention_mask_BxT)
        impl = self.config.attention_impl
        dense = None if impl == "pallas_tpu" else mask.dense()
        cos, sin = layers.rope_cos_sin(positions_BxT, self.inv_freq)
        key = self._dropout_key()

        def layer(block, x, i, _):
            out = block(x, cos, sin, mask, disable_lora, _split_key(key, i), impl=impl, dense=dense)
            return out, None

        x, _ = self.scan(layer, self.embed_tokens(tokens_BxT), remat=self.config.remat)
        return self.norm(x)

    def scan(self, fn, carry, xs=None, *, remat="none"):
        """`scan_layers` over this model's layers (`config.scan_unroll` applies)."""
        return scan_layers(self.layers, fn, carry, xs, remat=remat, unroll=self.config.scan_unroll)

    def logits_from_hidden(self, h_BxTxH):
        """fp32 logits [B, T, V] from final-normed hidden states."""
        if self.lm_head is None:
            return self.embed_tokens.attend(h_BxTxH)
        w = self.lm_head.kernel[...].astype(self.dtype)
        return jnp.einsum(
            "bth,hv->btv", h_BxTxH.astype(self.dtype), w, preferred_element_type=jnp.float32
        )

    def _decode_logits(self, h_BxTxH, head_t=None):
        """`logits_from_hidden` for a decode step (one token per row, few rows).

        With tied embeddings the head is h @ E^T with E [V, H] as stored; XLA:CPU's matmul packs
        (transposes) all of E on every call for that, while E @ h^T reads E as it lies (SmolLM2,
        32 rows: 20 -> 14 ms a step, same values; `layers.weight_major_matmul`). An untied head
        does the same with `head_t` ([V, H], from `weight_major_kernels`), else the plain h @ W.
        """
        if h_BxTxH.shape[1] > 1:  # several tokens a row (prefill): keep the plain form
            return self.logits_from_hidden(h_BxTxH)
        if self.lm_head is not None:
            if head_t is None:
                return self.logits_from_hidden(h_BxTxH)
            w = head_t.astype(self.dtype)  # [V, H]: the untied head, weight-major
        else:
            w = self.embed_tokens.embedding[...].astype(self.dtype)
        h = h_BxTxH.astype(self.dtype)
        return layers.weight_major_matmul(h, w, preferred_element_type=jnp.float32)

    def _dropout_key(self):
        if self.deterministic or self.dropout_rngs is None:
            return None
        return self.dropout_rngs.dropout()

    # ----- KV-cache decoding -----------------------------------------------------------------

    def init_cache(self, batch: int, max_len: int, dtype=None) -> kv_cache.KVCache:
        """A zero cache, k and v [L, B, max_len, K, D] in `dtype` (default: the compute dtype)."""
        c = self.config
        return kv_cache.init(
            c.num_layers, batch, max_len, c.num_kv_heads, c.head_dim, dtype or self.dtype
        )

    def forward_cached(
        self,
        tokens_BxT,
        positions_BxT,
        cache: kv_cache.KVCache,
        *,
        write_index,
        kv_mask_BxS,
        segment_ids_BxS=None,
        disable_lora=False,
    ):
        """Runs T new tokens against the cache; returns (fp32 logits [B, T, V], updated cache).

        The new keys/values go to slots [write_index, write_index + T); query i attends to slot s
        iff `kv_mask_BxS[b, s] and s <= write_index + i`. `write_index` may be a traced int32.
        With `segment_ids_BxS` (int, -1 = none), query i must also share slot s's segment id,
        that of its own slot write_index + i, and that id must be >= 0: several sequences packed
        into one row then attend each to itself alone (packed prefill).
        """
        chex.assert_rank([tokens_BxT, positions_BxT, kv_mask_BxS], 2)
        chex.assert_equal_shape([tokens_BxT, positions_BxT])
        t = tokens_BxT.shape[1]
        write_index = jnp.asarray(write_index, jnp.int32)
        slots = jnp.arange(cache.max_len, dtype=jnp.int32)
        limit = write_index + jnp.arange(t, dtype=jnp.int32)
        mask = (slots[None, :] <= limit[:, None])[None] & kv_mask_BxS.astype(jnp.bool_)[:, None, :]
        if segment_ids_BxS is not None:
            chex.assert_rank(segment_ids_BxS, 2)
            seg_BxS = jnp.asarray(segment_ids_BxS, jnp.int32)
            seg_BxT = jax.lax.dynamic_slice_in_dim(seg_BxS, write_index, t, axis=1)
            same = seg_BxT[:, :, None] == seg_BxS[:, None, :]
            mask = mask & same & (seg_BxT >= 0)[:, :, None]
        attend_layer = attention.attend_split if cache.is_split else attention.attend

        def attend(q, ck, cv, i):
            k, v = kv_cache.layer(ck, i), kv_cache.layer(cv, i)
            return attend_layer(q, k.astype(q.dtype), v.astype(q.dtype), mask)

        return self._decode_layers(
            tokens_BxT, positions_BxT, cache, write_index, attend, disable_lora=disable_lora
        )

    def forward_cached_shared_prompt(
        self,
        tokens_Rx1,
        positions_Rx1,
        prompt_cache: kv_cache.KVCache,
        cache: kv_cache.KVCache,
        *,
        write_index,
        prompt_mask_BxP,
        disable_lora=False,
        kernels_t=None,
    ):
        """One new token per row, whose rows share their prompts' cache; -> (logits, new cache).

        `prompt_cache` (split, B prompts, P slots) is read only: rows r = b * n + i (n = R // B)
        attend to prompt b's slots where `prompt_mask_BxP[b]` holds. `cache` (split, R rows, S
        slots) is the rows' own: the new key/value go to slot `write_index` (may be traced) and
        row r attends to its slots <= write_index. Equals `forward_cached` on the cache that
        repeats each prompt's slots n times ahead of the rows' own
        (`attention.attend_shared_prompt`).
        `kernels_t` (`weight_major_kernels()`, made outside this jit) runs the linear layers
        weight-major (`layers.weight_major_matmul`): faster on CPU, same values up to rounding.
        The layer scan only reads the caches and `cache` gets every layer's new slot in one write
        after it (`_decode_step_layers`), so a donated or loop-carried cache is updated in place;
        with fp32 on CPU the C++ attention kernel, which reads the new slot from the cache, runs
        instead with the write inside the scan (in place on XLA:CPU).
        Returns fp32 logits [R, 1, V] and the updated `cache`.
        """
        chex.assert_shape([tokens_Rx1, positions_Rx1], (None, 1))
        if not (prompt_cache.is_split and cache.is_split):
            raise ValueError("forward_cached_shared_prompt takes split caches (kv_cache.split)")
        write_index = jnp.asarray(write_index, jnp.int32)
        pmask = prompt_mask_BxP.astype(jnp.bool_)
        kw = dict(disable_lora=disable_lora, kernels_t=kernels_t)
        f32 = (self.dtype, prompt_cache.k.dtype, prompt_cache.v.dtype, cache.k.dtype, cache.v.dtype)
        if all(x == jnp.float32 for x in f32) and decode_attention.usable():
            # The CPU kernel reads each layer's new slot from the cache: the scan writes it
            # there first (the cache is the scan's carry; in place on XLA:CPU, see the tests).
            def attend(q, ck, cv, i):
                return attention.attend_shared_prompt_decode(
                    q, prompt_cache.k, prompt_cache.v, ck, cv, pmask, write_index, i
                )

            return self._decode_layers(tokens_Rx1, positions_Rx1, cache, write_index, attend, **kw)

        def attend_step(q, k_new, v_new, i):
            return attention.attend_shared_prompt_step_decode(
                q, k_new, v_new, prompt_cache.k, prompt_cache.v, cache.k, cache.v, pmask,
                write_index, i,
            )  # fmt: skip

        return self._decode_step_layers(
            tokens_Rx1, positions_Rx1, cache, write_index, attend_step, **kw
        )

    def weight_major_kernels(self) -> dict:
        """Each matmul's kernel transposed to [out, in], for `forward_cached_shared_prompt`.

        {"layers": {"q_proj": [L, N*D, H], ..., "down_proj": [L, H, I]}, "lm_head": [V, H]
        (untied heads only)}. Call it outside the jit that decodes and pass the result in: only a
        jit's outputs are sure to be laid out [out, in] in memory (inside one, XLA may make the
        transpose a change of layout instead of a copy). It is a copy of the weights.
        """
        attn, mlp = ("q_proj", "k_proj", "v_proj", "o_proj"), ("gate_proj", "up_proj", "down_proj")
        block = self.layers
        dense = {n: getattr(block.self_attn, n) for n in attn}
        dense.update({n: getattr(block.mlp, n) for n in mlp})
        out = {"layers": {n: jnp.swapaxes(d.kernel[...], 1, 2) for n, d in dense.items()}}
        if self.lm_head is not None:
            out["lm_head"] = self.lm_head.kernel[...].T
        return out

    def _decode_step_layers(
        self, tokens_BxT, positions_BxT, cache, write_index, attend, *, disable_lora, kernels_t=None
    ):
        """The scanned layers over new tokens with the cache read only: layer i's new k/v come
        out of the scan (its ys, [L, B, T, K, D]: a token's worth) and one write after the scan
        puts every layer's in slot `write_index` (`kv_cache.write_all_layers`). A scan that
        carried the stacked cache and wrote into it per layer made XLA copy or convert the whole
        stacked cache at every layer (the H200 profile's concatenations, issue 35).
        `attend(q, k_new, v_new, i)` attends layer i's cache plus the new key/value."""
        cos, sin = layers.rope_cos_sin(positions_BxT, self.inv_freq)

        def layer(block, x, i, kt):
            h = block.input_layernorm(x)
            q, k, v = block.self_attn.qkv(
                h, cos, sin, disable_lora=disable_lora, key=None, kernels_t=kt
            )
            o = attend(q, k, v, i)
            x = x + block.self_attn.out(o, disable_lora=disable_lora, key=None, kernels_t=kt)
            h = block.post_attention_layernorm(x)
            x = x + block.mlp(h, disable_lora=disable_lora, kernels_t=kt)
            return x, (k, v)

        layer_kt = None if kernels_t is None else kernels_t["layers"]
        x, (k_new, v_new) = self.scan(layer, self.embed_tokens(tokens_BxT), layer_kt)
        head_t = None if kernels_t is None else kernels_t.get("lm_head")
        logits = self._decode_logits(self.norm(x), head_t)
        return logits, kv_cache.write_all_layers(cache, k_new, v_new, write_index)

    def _decode_layers(
        self, tokens_BxT, positions_BxT, cache, write_index, attend, *, disable_lora, kernels_t=None
    ):
        """The scanned layers over new tokens: layer i writes its k/v into the stacked `cache` at
        `write_index` (in place: the cache is the scan's carry), then
        `attend(q, cache_k, cache_v, i)` gives the attention output (it reads layer i).
        `kernels_t`: see `forward_cached_shared_prompt`."""
        cos, sin = layers.rope_cos_sin(positions_BxT, self.inv_freq)
        split = cache.is_split

        def layer(block, carry, i, kt):
            x, ck, cv = carry
            h = block.input_layernorm(x)
            q, k, v = block.self_attn.qkv(
                h, cos, sin, disable_lora=disable_lora, key=None, kernels_t=kt
            )
            ck = kv_cache.write_keys(ck, i, k, write_index, split=split)
            cv = kv_cache.write_values(cv, i, v, write_index, split=split)
            o = attend(q, ck, cv, i)
            x = x + block.self_attn.out(o, disable_lora=disable_lora, key=None, kernels_t=kt)
            h = block.post_attention_layernorm(x)
            x = x + block.mlp(h, disable_lora=disable_lora, kernels_t=kt)
            return (x, ck, cv), None

        layer_kt = None if kernels_t is None else kernels_t["layers"]
        carry = (self.embed_tokens(tokens_BxT), cache.k, cache.v)
        (x, ck, cv), _ = self.scan(layer, carry, layer_kt)
        head_t = None if kernels_t is None else kernels_t.get("lm_head")
        logits = self._decode_logits(self.norm(x), head_t)
        return logits, cache.replace(k=ck, v=cv)
