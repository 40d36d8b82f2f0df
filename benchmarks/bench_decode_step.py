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

The step rows' loop is `decode_steps.py`'s, the linear rows' chains `linear_floor.py`'s (both
beside this file). The SmolLM2 row needs checkpoints/smollm2-135m-instruct
(scripts/prepare_smollm2.py).
"""

from __future__ import annotations

import pathlib
import sys
import tempfile
from unittest import mock

import decode_steps  # benchmarks/, beside this file
import linear_floor
import numpy as np
from absl import app, flags

_REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(_REPO))
sys.path.insert(0, str(_REPO / "tests"))  # test tooling (`support`): tiny checkpoints, shared data
from mmr_jax.infra import bench_harness as harness  # noqa: E402
from mmr_jax.infra import user_errors  # noqa: E402

_MODEL = flags.DEFINE_enum("model", "smollm2", ["smollm2", "tiny"], "which model")
_SMOL = flags.DEFINE_string(
    "smollm2_path", str(_REPO / "checkpoints" / "smollm2-135m-instruct"), "SmolLM2 checkpoint"
)
_PROMPTS = flags.DEFINE_list("prompts", ["8"], "prompt counts")
harness.counts_flag("prompts")
_N = flags.DEFINE_integer("n", 4, "samples per prompt")
_PROMPT_SLOTS = flags.DEFINE_integer("prompt_slots", 192, "prompt cache slots (padded prompt)")
_PROMPT_FILL = flags.DEFINE_float("prompt_fill", 0.45, "fraction of prompt slots holding tokens")
_NEW_SLOTS = flags.DEFINE_integer("new_slots", 128, "each row's own cache slots (new tokens)")
_STEPS = flags.DEFINE_integer("steps", 16, "decode steps per timed run")
_REPEATS = flags.DEFINE_integer("repeats", 5, "timed runs (the median is reported)")
_THREADS = flags.DEFINE_integer("torch_threads", 0, "torch intra-op threads (0 = torch default)")
_JSON = flags.DEFINE_string("json", None, "also write the results to this JSON file")


def _median_ms_per_step(run, steps: int, repeats: int) -> float:
    """Median ms per decode step of `repeats` calls of `run` (`steps` steps each), after one."""
    return harness.timed(run, steps=repeats).median_s * 1e3 / steps


def bench_model(name: str, path: str) -> list[dict]:
    from mmr_jax import models
    from mmr_jax.kernels import decode_attention
    from mmr_jax.models import attention

    model = models.from_pretrained(path)
    per_layer, head = linear_floor.layer_weights(model)
    steps, repeats, n = _STEPS.value, _REPEATS.value, _N.value
    slots = (_PROMPT_SLOTS.value, _NEW_SLOTS.value)
    if steps >= slots[1]:
        raise app.UsageError(f"--steps ({steps}) must be below --new_slots ({slots[1]})")
    results = []
    for prompts in map(int, _PROMPTS.value):
        rows = prompts * n
        x = np.random.default_rng(0).standard_normal((rows, head.shape[0])).astype(np.float32)
        loop_args = (model, prompts, n, *slots, steps, _PROMPT_FILL.value)
        step_ms = _median_ms_per_step(decode_steps.decode_loop(*loop_args), steps, repeats)
        plain = decode_steps.decode_loop(*loop_args, weight_major=False)
        plain_ms = _median_ms_per_step(plain, steps, repeats)
        with mock.patch.object(decode_attention, "available", lambda: False):
            step_jax_ms = _median_ms_per_step(decode_steps.decode_loop(*loop_args), steps, repeats)
            with (
                mock.patch.object(attention, "attend_shared_prompt", decode_steps.pass_q_through),
                mock.patch.object(
                    attention, "attend_shared_prompt_step", decode_steps.pass_q_through
                ),
            ):
                no_attn = decode_steps.decode_loop(*loop_args)
                no_attn_ms = _median_ms_per_step(no_attn, steps, repeats)
        chains = linear_floor.chain_runs(per_layer, head, x, steps)
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
            linear_jax_ms=_median_ms_per_step(chains["jax"], steps, repeats),
            linear_jax_weight_major_ms=_median_ms_per_step(
                chains["jax_weight_major"], steps, repeats
            ),
            linear_torch_ms=_median_ms_per_step(chains["torch"], steps, repeats),
            linear_gflops=linear_floor.gflops(per_layer, head, rows),
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
    user_errors.run(main)
