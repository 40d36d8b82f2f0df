"""The decoder's KV-cache decoding (prefill and decode steps of the sampler), a mixin of
`decoder.Decoder`: the cache's layout and writes (`kv_cache`), the attention over it
(`attention`, the CPU kernel of `mmr_jax.kernels.decode_attention`) and the weight-major
matmuls of a decode step (`layers.weight_major_matmul`).

Shape legend (docs/design.md): N rows, T new tokens, S key/cache slots, B prompts of P slots (a
shared prompt cache: G = N / B rows each), E hidden width, K kv heads, D head dim, V vocab, L
layers.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp

from mmr_jax.kernels import decode_attention
from mmr_jax.models import attention, kv_cache, layers


class CachedDecoding:
    """`Decoder`'s methods that run new tokens against a KV cache. They use the decoder's
    `config`, `dtype`, `inv_freq`, `embed_tokens`, `norm`, `lm_head`, `scan` and
    `logits_from_hidden`."""

    def decode_logits(self, h_NxTxE, head_t=None):
        """`logits_from_hidden` for a decode step (one token per row, few rows).

        With tied embeddings the head is h @ W^T with the embedding W [V, E] as stored; XLA:CPU's
        matmul packs (transposes) all of W on every call for that, while W @ h^T reads W as it lies
        (SmolLM2, 32 rows: 20 -> 14 ms a step, same values; `layers.weight_major_matmul`). An
        untied head does the same with `head_t` ([V, E], from `weight_major_kernels`), else the
        plain h @ W.
        """
        if h_NxTxE.shape[1] > 1:  # several tokens a row (prefill): keep the plain form
            return self.logits_from_hidden(h_NxTxE)
        if self.lm_head is not None:
            if head_t is None:
                return self.logits_from_hidden(h_NxTxE)
            w = head_t.astype(self.dtype)  # [V, E]: the untied head, weight-major
        else:
            w = self.embed_tokens.embedding[...].astype(self.dtype)
        h = h_NxTxE.astype(self.dtype)
        return layers.weight_major_matmul(h, w, preferred_element_type=jnp.float32)

    def init_cache(self, batch: int, max_len: int, dtype=None) -> kv_cache.KVCache:
        """A zero cache, k and v [L, B, max_len, K, D] in `dtype` (default: the compute dtype)."""
        c = self.config
        return kv_cache.init(
            c.num_layers, batch, max_len, c.num_kv_heads, c.head_dim, dtype or self.dtype
        )

    def forward_cached(
        self,
        tokens_NxT,
        positions_NxT,
        cache: kv_cache.KVCache,
        *,
        write_index,
        kv_mask_NxS,
        segment_ids_NxS=None,
        disable_lora=False,
    ):
        """Runs T new tokens against the cache; returns (fp32 logits [N, T, V], updated cache).

        The new keys/values go to slots [write_index, write_index + T); query i attends to slot s
        iff `kv_mask_NxS[b, s] and s <= write_index + i`. `write_index` may be a traced int32.
        With `segment_ids_NxS` (int, -1 = none), query i must also share slot s's segment id,
        that of its own slot write_index + i, and that id must be >= 0: several sequences packed
        into one row then attend each to itself alone (packed prefill).
        """
        chex.assert_rank([tokens_NxT, positions_NxT, kv_mask_NxS], 2)
        chex.assert_equal_shape([tokens_NxT, positions_NxT])
        t = tokens_NxT.shape[1]
        write_index = jnp.asarray(write_index, jnp.int32)
        slots = jnp.arange(cache.max_len, dtype=jnp.int32)
        limit = write_index + jnp.arange(t, dtype=jnp.int32)
        mask = (slots[None, :] <= limit[:, None])[None] & kv_mask_NxS.astype(jnp.bool_)[:, None, :]
        if segment_ids_NxS is not None:
            chex.assert_rank(segment_ids_NxS, 2)
            seg_NxS = jnp.asarray(segment_ids_NxS, jnp.int32)
            seg_NxT = jax.lax.dynamic_slice_in_dim(seg_NxS, write_index, t, axis=1)
            same = seg_NxT[:, :, None] == seg_NxS[:, None, :]
            mask = mask & same & (seg_NxT >= 0)[:, :, None]
        attend_layer = attention.attend_split if cache.is_split else attention.attend

        def attend(q, ck, cv, i):
            k, v = kv_cache.layer(ck, i), kv_cache.layer(cv, i)
            return attend_layer(q, k.astype(q.dtype), v.astype(q.dtype), mask)

        return self._decode_layers(
            tokens_NxT, positions_NxT, cache, write_index, attend, disable_lora=disable_lora
        )

    def forward_cached_shared_prompt(
        self,
        tokens_Nx1,
        positions_Nx1,
        prompt_cache: kv_cache.KVCache,
        cache: kv_cache.KVCache,
        *,
        write_index,
        prompt_mask_BxP,
        disable_lora=False,
        kernels_t=None,
    ):
        """One new token per row, whose rows share their prompts' cache; -> (logits, new cache).

        `prompt_cache` (split, B prompts, P slots) is read only: rows r = b * G + i (G = N // B)
        attend to prompt b's slots where `prompt_mask_BxP[b]` holds. `cache` (split, N rows, S
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
        Returns fp32 logits [N, 1, V] and the updated `cache`.
        """
        chex.assert_shape([tokens_Nx1, positions_Nx1], (None, 1))
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

            return self._decode_layers(tokens_Nx1, positions_Nx1, cache, write_index, attend, **kw)

        def attend_step(q, k_new, v_new, i):
            return attention.attend_shared_prompt_step_decode(
                q, k_new, v_new, prompt_cache.k, prompt_cache.v, cache.k, cache.v, pmask,
                write_index, i,
            )  # fmt: skip

        return self._decode_step_layers(
            tokens_Nx1, positions_Nx1, cache, write_index, attend_step, **kw
        )

    def weight_major_kernels(self) -> dict:
        """Each matmul's kernel transposed to [out, in], for `forward_cached_shared_prompt`.

        {"layers": {"q_proj": [L, H*D, E], ..., "down_proj": [L, E, I]}, "lm_head": [V, E]
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
        self, tokens_NxT, positions_NxT, cache, write_index, attend, *, disable_lora, kernels_t=None
    ):
        """The scanned layers over new tokens with the cache read only: layer i's new k/v come
        out of the scan (its ys, [L, N, T, K, D]: a token's worth) and one write after the scan
        puts every layer's in slot `write_index` (`kv_cache.write_all_layers`). A scan that
        carried the stacked cache and wrote into it per layer made XLA copy or convert the whole
        stacked cache at every layer (the H200 profile's concatenations, issue 35).
        `attend(q, k_new, v_new, i)` attends layer i's cache plus the new key/value."""
        cos, sin = layers.rope_cos_sin(positions_NxT, self.inv_freq)

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
        x, (k_new, v_new) = self.scan(layer, self.embed_tokens(tokens_NxT), layer_kt)
        head_t = None if kernels_t is None else kernels_t.get("lm_head")
        logits = self.decode_logits(self.norm(x), head_t)
        return logits, kv_cache.write_all_layers(cache, k_new, v_new, write_index)

    def _decode_layers(
        self, tokens_NxT, positions_NxT, cache, write_index, attend, *, disable_lora, kernels_t=None
    ):
        """The scanned layers over new tokens: layer i writes its k/v into the stacked `cache` at
        `write_index` (in place: the cache is the scan's carry), then
        `attend(q, cache_k, cache_v, i)` gives the attention output (it reads layer i).
        `kernels_t`: see `forward_cached_shared_prompt`."""
        cos, sin = layers.rope_cos_sin(positions_NxT, self.inv_freq)
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
        carry = (self.embed_tokens(tokens_NxT), cache.k, cache.v)
        (x, ck, cv), _ = self.scan(layer, carry, layer_kt)
        head_t = None if kernels_t is None else kernels_t.get("lm_head")
        logits = self.decode_logits(self.norm(x), head_t)
        return logits, cache.replace(k=ck, v=cv)
