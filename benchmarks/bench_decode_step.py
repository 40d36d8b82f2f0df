"""Where a decode step's time goes: one KV-cache decode step of the sampler's model, taken apart.

    python benchmarks/bench_decode_step.py                    # SmolLM2-135M, 8 prompts x 4 samples
    python benchmarks/bench_decode_step.py --prompts=8,32 --json=out.json
    python benchmarks/bench_decode_step.py --model=tiny

`bench_sampler.py` says how fast the sampler is; this says why, one row per part of a step, all
in one process (ms per decode step, median of --repeats runs of --steps steps):

  step            what each turn of the sampler's while loop runs: one token per row (rows =
                  prompts x n) through `forward_cached_shared_prompt`, against the prompts'
                  shared cache (--prompt_slots, of which --prompt_fill hold tokens, the rest left
                  padding) and the rows' own (--new_slots, half written: the average over a
                  generation), then the sampler's draw at temperature 0.7. The defaults are
                  bench_sampler.py's SmolLM2 buckets (8 GSM8K prompts of 57..137 tokens, 45% of
                  192 slots; 128 new tokens). On CPU the attention is the C++ kernel and the
                  matmuls weight-major (W @ x^T on kernels transposed once), as in the sampler.
  step (x @ W)    the same with the plain matmuls (what other platforms run).
  step (pure JAX) the same with the pure-JAX attention (`attention.attend_shared_prompt_step`, what
                  other platforms run), which reads and masks every slot.
  no attention    the same step with the attention over the cache replaced by passing q through;
                  projections, MLP, norms, LM head and sampling unchanged. step - this = the
                  attention and its cache traffic.
  linear (jax)    only the step's matmuls (q, k, v, o, gate, up, down of every layer, then the LM
                  head) at M = rows on the model's weights, chained as in the model, as x @ W.
  linear (W @ x^T) the same matmuls weight-major, on [out, in] copies of the weights.
  linear (torch)  the same matmuls in torch (`F.linear` on [out, in] weights, as transformers runs
                  them) with --torch_threads threads: the floor under transformers' decode step.

The SmolLM2 row needs checkpoints/smollm2-135m-instruct (scripts/prepare_smollm2.py).
"""

from __future__ import annotations

import functools
import pathlib
import sys
import tempfile
from unittest import mock

import numpy as np
from absl import app, flags

_REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(_REPO))
sys.path.insert(0, str(_REPO / "tests"))  # test tooling (`support`): tiny checkpoints, shared data
from mmr_jax.infra import bench_harness as harness  # noqa: E402

_MODEL = flags.DEFINE_enum("model", "smollm2", ["smollm2", "tiny"], "which model")
_SMOL = flags.DEFINE_string(
    "smollm2_path", str(_REPO / "checkpoints" / "smollm2-135m-instruct"), "SmolLM2 checkpoint"
)
_PROMPTS = flags.DEFINE_list("prompts", ["8"], "prompt counts")
_N = flags.DEFINE_integer("n", 4, "samples per prompt")
_PROMPT_SLOTS = flags.DEFINE_integer("prompt_slots", 192, "prompt cache slots (padded prompt)")
_PROMPT_FILL = flags.DEFINE_float("prompt_fill", 0.45, "fraction of prompt slots holding tokens")
_NEW_SLOTS = flags.DEFINE_integer("new_slots", 128, "each row's own cache slots (new tokens)")
_STEPS = flags.DEFINE_integer("steps", 16, "decode steps per timed run")
_REPEATS = flags.DEFINE_integer("repeats", 5, "timed runs (the median is reported)")
_THREADS = flags.DEFINE_integer("torch_threads", 0, "torch intra-op threads (0 = torch default)")
_JSON = flags.DEFINE_string("json", None, "also write the results to this JSON file")


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


def _median_ms_per_step(run, steps: int, repeats: int) -> float:
    """Median ms per decode step of `repeats` calls of `run` (`steps` steps each), after one."""
    return harness.timed(run, steps=repeats).median_s * 1e3 / steps


def decode_loop(
    model,
    prompts: int,
    n: int,
    prompt_slots: int,
    new_slots: int,
    steps: int,
    fill: float,
    weight_major: bool = True,
):
    """A jitted run of `steps` decode steps as the sampler runs them (+ a draw at T = 0.7).

    `weight_major`: the linear layers on kernels transposed outside the jit, as the sampler does
    on CPU (`sampler.weight_major`); False: plain x @ W.

    The own cache is donated and handed back, so no call copies it (the sampler makes it inside
    its jit); the timed steps write own slots from the middle of the cache on.
    """
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from mmr_jax.models import kv_cache
    from mmr_jax.rollout import sampler, sampling

    rows = prompts * n
    graphdef, state = nnx.split(model)
    # Non-zero keys, so the softmax is a real one.
    prompt_cache = jax.tree.map(
        lambda a: a + 0.01, kv_cache.split(model.init_cache(prompts, prompt_slots))
    )
    cache = jax.tree.map(lambda a: a + 0.01, kv_cache.split(model.init_cache(rows, new_slots)))
    start = (new_slots - steps) // 2  # own slots written: about half, on average over the steps
    filled = max(1, round(fill * prompt_slots))
    prompt_mask = np.arange(prompt_slots)[None, :] >= prompt_slots - filled
    prompt_mask = np.repeat(prompt_mask & (np.arange(prompt_slots) < prompt_slots - 1), prompts, 0)

    kernels_t = sampler._weight_major_kernels(graphdef, state) if weight_major else None

    @functools.partial(jax.jit, donate_argnums=2)
    def loop(state, prompt_cache, cache, kernels_t):
        m = nnx.merge(graphdef, state)
        keys = jax.random.split(jax.random.key(0), rows)

        def body(t, carry):
            cache, tok = carry
            pos = jnp.full((rows, 1), prompt_slots + start, jnp.int32) + t
            logits, cache = m.forward_cached_shared_prompt(
                tok,
                pos,
                prompt_cache,
                cache,
                write_index=start + t,
                prompt_mask_BxP=prompt_mask,
                kernels_t=kernels_t,
            )
            nxt, _ = sampling.sample_step(
                logits[:, 0], keys, 0.7, 0, 1.0, greedy=False, use_filter=False
            )
            return cache, nxt[:, None]

        init = (cache, jnp.ones((rows, 1), jnp.int32))
        return jax.lax.fori_loop(0, steps, body, init)

    carry = [cache]

    def run():
        carry[0], tok = loop(state, prompt_cache, carry[0], kernels_t)
        tok.block_until_ready()

    return run


def _pass_q_through(q_RxTxNxD, *unused):
    del unused
    return q_RxTxNxD.reshape(q_RxTxNxD.shape[0], q_RxTxNxD.shape[1], -1)


def bench_model(name: str, path: str) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import torch

    from mmr_jax import models
    from mmr_jax.kernels import decode_attention
    from mmr_jax.models import attention

    model = models.from_pretrained(path)
    per_layer, head = layer_weights(model)
    per_layer_t, head_t = to_torch(per_layer, head)
    from mmr_jax.models import layers

    weights_j = jax.tree.map(jnp.asarray, (per_layer, head))
    weights_t = jax.tree.map(jnp.asarray, transpose_weights(per_layer, head))
    chain = jax.jit(linear_chain_jax)
    chain_t = jax.jit(functools.partial(linear_chain_jax, matmul=layers.weight_major_matmul))
    steps, repeats, n = _STEPS.value, _REPEATS.value, _N.value
    slots = (_PROMPT_SLOTS.value, _NEW_SLOTS.value)
    if steps >= slots[1]:
        raise app.UsageError(f"--steps ({steps}) must be below --new_slots ({slots[1]})")
    results = []
    for prompts in map(int, _PROMPTS.value):
        rows = prompts * n
        x = np.random.default_rng(0).standard_normal((rows, head.shape[0])).astype(np.float32)
        xj, xt = jnp.asarray(x), torch.from_numpy(x)
        loop_args = (model, prompts, n, *slots, steps, _PROMPT_FILL.value)
        step_ms = _median_ms_per_step(decode_loop(*loop_args), steps, repeats)
        plain_ms = _median_ms_per_step(decode_loop(*loop_args, weight_major=False), steps, repeats)
        with mock.patch.object(decode_attention, "available", lambda: False):
            step_jax_ms = _median_ms_per_step(decode_loop(*loop_args), steps, repeats)
            with (
                mock.patch.object(attention, "attend_shared_prompt", _pass_q_through),
                mock.patch.object(attention, "attend_shared_prompt_step", _pass_q_through),
            ):
                no_attn_ms = _median_ms_per_step(decode_loop(*loop_args), steps, repeats)

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

        jax_ms = _median_ms_per_step(run_jax, steps, repeats)
        jax_t_ms = _median_ms_per_step(run_jax_t, steps, repeats)
        torch_ms = _median_ms_per_step(run_torch, steps, repeats)
        row = dict(
            model=name,
            prompts=prompts,
            n=n,
            prompt_slots=slots[0],
            prompt_fill=_PROMPT_FILL.value,
            new_slots=slots[1],
            cpu_kernel=decode_attention.available(),
            step_ms=step_ms,
            step_plain_matmul_ms=plain_ms,
            step_pure_jax_ms=step_jax_ms,
            no_attention_ms=no_attn_ms,
            attention_ms=step_ms - no_attn_ms,
            linear_jax_ms=jax_ms,
            linear_jax_weight_major_ms=jax_t_ms,
            linear_torch_ms=torch_ms,
            linear_gflops=2
            * rows
            * (sum(w.size for ws in per_layer for w in ws) + head.size)
            / 1e9,
        )
        print(_fmt(row), flush=True)
        results.append(row)
    return results


def _fmt(r: dict) -> str:
    gf = r["linear_gflops"]
    return "\n".join(
        [
            f"{r['model']}: {r['prompts']} prompts x {r['n']} (prompt cache {r['prompt_slots']} "
            f"slots, {r['prompt_fill']:.0%} filled; own cache {r['new_slots']}, half written)",
            f"  {'step':<16}{r['step_ms']:>9.1f} ms"
            f"   (attention: {'C++ kernel' if r['cpu_kernel'] else 'pure JAX, no kernel'})",
            f"  {'step (x @ W)':<16}{r['step_plain_matmul_ms']:>9.1f} ms",
            f"  {'step (pure JAX)':<16}{r['step_pure_jax_ms']:>9.1f} ms",
            f"  {'no attention':<16}{r['no_attention_ms']:>9.1f} ms"
            f"   (attention + its cache traffic: {r['attention_ms']:.1f} ms in the step, "
            f"{r['step_pure_jax_ms'] - r['no_attention_ms']:.1f} ms in pure JAX)",
            f"  {'linear (jax)':<16}{r['linear_jax_ms']:>9.1f} ms"
            f"   ({gf:.2f} GFLOP: {1e3 * gf / r['linear_jax_ms']:.0f} GFLOP/s)",
            f"  {'linear (W @ x^T)':<16}{r['linear_jax_weight_major_ms']:>9.1f} ms"
            f"   ({1e3 * gf / r['linear_jax_weight_major_ms']:.0f} GFLOP/s)",
            f"  {'linear (torch)':<16}{r['linear_torch_ms']:>9.1f} ms"
            f"   ({1e3 * gf / r['linear_torch_ms']:.0f} GFLOP/s)",
        ]
    )


def main(argv):
    del argv
    import jax
    import torch

    from support import testing

    if _THREADS.value:
        torch.set_num_threads(_THREADS.value)
    print(
        f"jax {jax.__version__} ({jax.devices()[0].platform}), torch {torch.__version__} "
        f"({torch.get_num_threads()} threads); ms per decode step, median of "
        f"{_REPEATS.value} runs of {_STEPS.value} steps",
        flush=True,
    )
    if _MODEL.value == "tiny":
        with tempfile.TemporaryDirectory() as tmp:
            results = bench_model("tiny", str(testing.make_tiny_checkpoint(tmp)))
    else:
        if not (pathlib.Path(_SMOL.value) / "config.json").exists():
            raise app.UsageError(
                f"no checkpoint at {_SMOL.value}: run scripts/prepare_smollm2.py or --model=tiny"
            )
        results = bench_model("smollm2", _SMOL.value)
    if _JSON.value:
        harness.write_json(_JSON.value, results)


if __name__ == "__main__":
    app.run(main)
