"""The linear floor under a decode step (`bench_decode_step.py`'s linear rows): only the step's
matmuls (q, k, v, o, gate, up, down of every layer, then the LM head) at M = rows, chained as in
the model, in JAX as x @ W (`linear_chain_jax`), weight-major on [out, in] copies
(`transpose_weights`, `layers.weight_major_matmul`: the sampler's CPU form) and in torch
(`to_torch`, `linear_chain_torch`: `F.linear`, as transformers runs them), on the weights
`layer_weights` takes out of a model.
"""

from __future__ import annotations

import numpy as np


def layer_weights(model) -> tuple[list[list[np.ndarray]], np.ndarray]:
    """The model's matmul weights as [in, out] arrays: per layer [q, k, v, o, gate, up, down]."""
    a, m = model.layers.self_attn, model.layers.mlp  # stacked: kernels [L, in, out]
    dense = [a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj]
    stacked = [np.asarray(d.kernel[...], np.float32) for d in dense]
    per_layer = [[w[i] for w in stacked] for i in range(model.config.num_layers)]
    if model.lm_head is None:
        head = np.asarray(model.embed_tokens.embedding[...], np.float32).T
    else:
        head = np.asarray(model.lm_head.kernel[...], np.float32)
    return per_layer, head


def gflops(per_layer, head, rows: int) -> float:
    """GFLOP of one chain at M = `rows` (2 per multiply-add)."""
    return 2 * rows * (sum(w.size for ws in per_layer for w in ws) + head.size) / 1e9


def _plain(x, w):
    return x @ w


def linear_chain_jax(per_layer, head, x, matmul=_plain):
    """The step's matmuls in the model's order; each layer's output feeds the next.

    `matmul(x, w)` is x @ w on [in, out] weights; with `layers.weight_major_matmul` and the
    weights transposed to [out, in] (`transpose_weights`) it is the sampler's CPU form.
    """
    import jax
    import jax.numpy as jnp

    for wq, wk, wv, wo, wg, wu, wd in per_layer:
        q, k, v = matmul(x, wq), matmul(x, wk), matmul(x, wv)
        x = (
            x
            + matmul(q, wo)
            + 1e-3 * (jnp.mean(k, -1, keepdims=True) + jnp.mean(v, -1, keepdims=True))
        )
        x = x + matmul(jax.nn.silu(matmul(x, wg)) * matmul(x, wu), wd)
        x = x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6)
    return matmul(x, head)


def transpose_weights(per_layer, head):
    """[in, out] numpy weights -> C-contiguous [out, in] copies (the weight-major layout)."""
    t = lambda w: np.ascontiguousarray(w.T)
    return [[t(w) for w in layer] for layer in per_layer], t(head)


def linear_chain_torch(per_layer_t, head_t, x):
    """`linear_chain_jax` in torch on [out, in] weights (`F.linear`, as transformers calls it)."""
    import torch
    import torch.nn.functional as F

    for wq, wk, wv, wo, wg, wu, wd in per_layer_t:
        q, k, v = F.linear(x, wq), F.linear(x, wk), F.linear(x, wv)
        x = x + F.linear(q, wo) + 1e-3 * (k.mean(-1, keepdim=True) + v.mean(-1, keepdim=True))
        x = x + F.linear(F.silu(F.linear(x, wg)) * F.linear(x, wu), wd)
        x = x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-6)
    return F.linear(x, head_t)


def to_torch(per_layer, head):
    """[in, out] numpy weights -> contiguous [out, in] torch tensors."""
    import torch

    def t(w):
        return torch.from_numpy(np.array(w.T, order="C"))

    return [[t(w) for w in layer] for layer in per_layer], t(head)


def chain_runs(per_layer, head, x: np.ndarray, steps: int) -> dict:
    """{'jax', 'jax_weight_major', 'torch': fn}: each fn runs its chain `steps` times on x, waiting
    for each (the weights placed and the JAX chains jitted once, here)."""
    import functools

    import jax
    import jax.numpy as jnp
    import torch

    from mmr_jax.models import layers

    per_layer_t, head_t = to_torch(per_layer, head)
    weights_j = jax.tree.map(jnp.asarray, (per_layer, head))
    weights_t = jax.tree.map(jnp.asarray, transpose_weights(per_layer, head))
    chain = jax.jit(linear_chain_jax)
    chain_t = jax.jit(functools.partial(linear_chain_jax, matmul=layers.weight_major_matmul))
    xj, xt = jnp.asarray(x), torch.from_numpy(x)

    def run_jax():
        for _ in range(steps):
            chain(*weights_j, xj).block_until_ready()

    def run_jax_t():
        for _ in range(steps):
            chain_t(*weights_t, xj).block_until_ready()

    def run_torch():
        with torch.no_grad():
            for _ in range(steps):
                linear_chain_torch(per_layer_t, head_t, xt)

    return {"jax": run_jax, "jax_weight_major": run_jax_t, "torch": run_torch}
