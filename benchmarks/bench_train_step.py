"""The jitted train step, full rows vs shared prompts vs packed, in one process, interleaved.

    python benchmarks/bench_train_step.py                      # SmolLM2-135M: CPU default + long
    python benchmarks/bench_train_step.py --shapes=cpu_default --rounds=5 --json=out.json
    python benchmarks/bench_train_step.py --model=tiny

The paths run `train_step.train_step` on the same ragged groups, laid out three ways:

  full rows      `batch_layout.pack(layout='full')` as the CPU default packed before (one bucket:
                 every row [prompt padded to max_prompt_len, completion to max_completion_len]).
  shared prompt  `batch_layout.pack`: each prompt once per group, prompts and completions trimmed
                 to the batch's longest rounded up to a bucket (`batch.min_bucket_len`), LM head
                 only where a completion token is predicted (`batch.pack_max_len=0`).
  packed         the shared prompts with each group's completions packed into one row
                 (`batch_layout.pack_completions`, the default): no work on completion padding.

Shapes (token lengths drawn with a fixed seed):
  cpu_default    configs/cpu_smollm2.py: 4 prompts x 8 completions, prompts 38..44 tokens (the
                 arithmetic prompts with the system prompt), completions mean ~9 tokens, one row
                 truncated at 32 in the worst case (--long_row), beta 0, minibatches 2.
  long           2 prompts x 4 completions, prompts ~100 tokens (max 128), completions 300..512
                 (max 512): little padding and prompts small next to completions, so little gain.

Reported per path: ms per step (median of --rounds), completion tokens per second, and the ratio
to full rows.
The step config (loss, minibatches, optimiser) is configs/cpu_smollm2.py's for every shape.
The groups, that config and each path's batch are built by `train_step_batches.py`, beside
this file.
"""

from __future__ import annotations

import pathlib
import sys
import time
import typing

import numpy as np
import train_step_batches  # benchmarks/, beside this file
from absl import flags

_REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(_REPO))
sys.path.insert(0, str(_REPO / "tests"))  # test tooling (`support`): tiny checkpoints, shared data
from mmr_jax.infra import bench_harness as harness  # noqa: E402
from mmr_jax.infra import user_errors  # noqa: E402

_MODEL = flags.DEFINE_enum("model", "smollm2", ["smollm2", "tiny"], "which model")
_SMOL = flags.DEFINE_string(
    "smollm2_path", str(_REPO / "checkpoints" / "smollm2-135m-instruct"), "SmolLM2 checkpoint"
)
_SHAPES = flags.DEFINE_list("shapes", ["cpu_default", "long"], "shapes to run")
_ROUNDS = flags.DEFINE_integer("rounds", 3, "timed rounds per path (interleaved)")
_LONG_ROW = flags.DEFINE_bool("long_row", False, "cpu_default: one completion truncated at 32")
_JSON = flags.DEFINE_string("json", None, "also write the results to this JSON file")
_PATHS = flags.DEFINE_list("paths", None, "time only these paths (default: all; x needs full rows)")

# path name -> (batch.shared_prompt, batch.pack_max_len)
PATHS = {"full rows": (False, 0), "shared prompt": (True, 0), "packed": (True, 1 << 20)}


class Shape(typing.NamedTuple):  # not a dataclass: tests load this script outside sys.modules
    prompts: int
    generations: int
    max_prompt_len: int
    max_completion_len: int
    prompt_lens: tuple[int, int]  # drawn uniformly in [lo, hi]
    completion_lens: tuple[int, int, int]  # (mean, lo, hi): Poisson(mean) clipped to [lo, hi]


SHAPES = {
    "cpu_default": Shape(4, 8, 64, 32, (38, 44), (9, 4, 20)),
    "long": Shape(2, 4, 128, 512, (90, 110), (420, 300, 512)),
    "tiny": Shape(2, 4, 16, 16, (5, 12), (5, 1, 12)),
}


def run_shape(
    model_path: str,
    shape: Shape,
    rounds: int,
    long_row: bool = False,
    same_state: bool = False,
    paths=None,
) -> dict:
    """Times the paths on one shape; returns per-path ms and tokens/s, first-step metrics.

    `same_state`: every path's first (compiling) step from a copy of the initial state, so their
    metrics compare; costs a second copy of the weights and optimiser state (off for SmolLM2).
    """
    import jax

    from mmr_jax.step import train_step
    from mmr_jax.training import build

    cfg = train_step_batches.train_config(shape, model_path)
    policy = build.load_policy(cfg)
    optimizer, schedule = train_step.make_optimizer(cfg.optim, total_updates=cfg.total_updates)
    state = train_step.init_state(policy.params, optimizer, seed=cfg.seed, loss=cfg.loss)
    groups, adv = train_step_batches.make_groups(
        shape, policy.model().config.vocab_size, long_row=long_row
    )
    step = train_step.jit_train_step(
        graphdef=train_step.step_graphdef(policy, cfg.loss, cfg.lora.dropout),
        optimizer=optimizer,
        schedule=schedule,
        cfg=train_step.StepConfig.from_config(cfg),
    )
    bs = train_step_batches.batches(cfg, groups, adv, PATHS)
    tokens = float(bs["full rows"].completion_mask.sum())
    bs = {name: b for name, b in bs.items() if paths is None or name in paths}
    res = {name: {"ms": [], "compile_s": 0.0} for name in bs}
    first = {}
    for name, batch in bs.items():  # compile, and the first step's metrics
        t0 = time.perf_counter()
        if same_state:
            start = jax.tree.map(lambda x: x.copy(), state)
            _, metrics = step(start, batch, policy.frozen, policy.rest)
        else:
            state, metrics = step(state, batch, policy.frozen, policy.rest)
        first[name] = {k: float(v) for k, v in metrics.items()}
        res[name]["compile_s"] = time.perf_counter() - t0
        print(f"  {name}: first step (compile) {res[name]['compile_s']:.1f} s", flush=True)
    for _ in range(rounds):  # interleaved: one state runs through both paths in turn
        for name, batch in bs.items():
            t0 = time.perf_counter()
            state, metrics = step(state, batch, policy.frozen, policy.rest)
            jax.block_until_ready(metrics)
            res[name]["ms"].append(1e3 * (time.perf_counter() - t0))
            print(f"  {name}: {res[name]['ms'][-1]:.0f} ms", flush=True)
    out = {
        "completion_tokens": tokens,
        "completion_lengths": groups.mask.sum(-1).reshape(-1).tolist(),
        "shapes": {},
        "first_step": first,
    }
    for name, batch in bs.items():
        ms = float(np.median(res[name]["ms"]))
        p = 0 if batch.prompt_tokens is None else batch.prompt_tokens.shape[1]
        packed_len = 0 if batch.packed is None else batch.packed.inputs.shape[1]
        out[name] = {
            "ms_per_step": ms,
            "ms_rounds": res[name]["ms"],
            "tokens_per_s": tokens / (ms / 1e3),
            "compile_s": res[name]["compile_s"],
        }
        out["shapes"][name] = {
            "tokens": list(batch.tokens.shape),
            "prompt_len": p,
            "packed_len": packed_len,
        }
        out[name]["speedup"] = out["full rows"]["ms_per_step"] / ms if "full rows" in out else 0.0
    return out


def _table(results: dict) -> str:
    lines = [
        f"{'shape':<12} {'path':<14} {'layout':<22} {'ms/step':>9} {'tok/s':>8} {'x':>6}",
    ]
    for shape, r in results.items():
        for name in (n for n in PATHS if n in r):
            x, dims = r[name], r["shapes"][name]
            layout = "x".join(str(d) for d in dims["tokens"])
            if dims["prompt_len"]:
                layout += f" P{dims['prompt_len']}"
            if dims["packed_len"]:
                layout = f"{dims['tokens'][0]} in L{dims['packed_len']} P{dims['prompt_len']}"
            lines.append(
                f"{shape:<12} {name:<14} {layout:<22} {x['ms_per_step']:>9.0f} "
                f"{x['tokens_per_s']:>8.1f} {x['speedup']:>6.2f}"
            )
    return "\n".join(lines)


def main(argv):
    del argv
    import tempfile

    from support import testing

    if _MODEL.value == "tiny":
        path = testing.make_tiny_checkpoint(tempfile.mkdtemp(), tokenizer=False, vocab_size=300)
        shapes = {"tiny": SHAPES["tiny"]}
    else:
        path = _SMOL.value
        shapes = {s: SHAPES[s] for s in _SHAPES.value}
    results = {}
    for name, shape in shapes.items():
        results[name] = run_shape(
            str(path), shape, _ROUNDS.value, long_row=_LONG_ROW.value, paths=_PATHS.value
        )
        print(f"{name}: {results[name]['completion_tokens']:.0f} completion tokens", flush=True)
    print(_table(results))
    if _JSON.value:
        harness.write_json(_JSON.value, results)


if __name__ == "__main__":
    user_errors.run(main)
