"""Our train step against its PyTorch peer on the same RL batch, on this host's accelerator.

    python benchmarks/peer_step.py --config=configs/grpo.py:1.5b \\
        --set=batch.max_completion_len=1024 --json=peer_1024.json
    python benchmarks/peer_step.py --config=configs/grpo.py:1.5b --sides=ours \\
        --set=batch.max_completion_len=1024 --profile=/tmp/trace --profile_json=profile.json
    python benchmarks/peer_step.py --cpu_smoke          # a tiny model on CPU, same weights

Sides, each in its own child process (its peak memory is its own):
  ours        the trainer's jitted train step (`peer_ours.py`): prompts shared per group, the
              config's dtypes, remat, minibatches, loss and AdamW.
  torch_ckpt  transformers + torch eager the way TRL computes the step (`peer_torch.py`): every
              row holds its prompt, SDPA, fp32 master weights + bf16 autocast, gradient
              accumulation over the config's minibatches, clip, AdamW (fused on CUDA), with
              gradient checkpointing.
  torch       the same without gradient checkpointing.
Both compute the batch of `peer_batch.make_batch` at the config's largest shapes (B prompts x G
completions, prompt P, completion T, every token valid), on random weights of the config's
architecture (third_party/hf_configs; `--weights=same`: one random checkpoint, written here
first, that both sides load, so their losses and gradient norms must agree). What the torch side
reads of the config, and that checkpoint, come from `peer_job.py`.

Reported per side: seconds per step (median of --steps after --warmup untimed ones and a first
call that compiles), the ratio to ours (> 1: ours is faster), the device's peak memory
(torch.cuda.max_memory_allocated; JAX memory_stats' peak_bytes_in_use; '-' on CPU), the tokens
each computes per step, and the first step's loss, gradient norm, entropy and KL.
`--profile=DIR`: ours also traces --profile_steps steps with `jax.profiler` into DIR and the
per-kernel device time by category (`kernel_profile.py`) is printed and written (--profile_json).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tempfile

_HERE = pathlib.Path(__file__).resolve().parent
sys.path[:0] = [str(_HERE.parent), str(_HERE)]
from mmr_jax.infra import bench_harness as harness  # noqa: E402

SIDES = ("ours", "torch_ckpt", "torch")
# --cpu_smoke: a tiny Qwen2 on CPU, fp32 (the parity's dtype), shapes that run in seconds.
SMOKE_CONFIG = "configs/grpo.py:1.5b"
SMOKE_SET = [
    "batch.prompts=2",
    "batch.generations=2",
    "batch.max_prompt_len=16",
    "batch.max_completion_len=16",
    "loss.minibatches=2",
    "model.dtype='float32'",
    "model.remat='none'",
]
TINY_ARCH = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)


def run_side(side: str, job: dict) -> dict:
    """One side, in this process (a child's body)."""
    if side == "ours":
        import peer_ours

        cfg = peer_ours.load_config(job["config"], job["overrides"])
        return peer_ours.run(
            cfg,
            checkpoint=job["torch"]["checkpoint"],
            steps=job["steps"],
            warmup=job["warmup"],
            profile_dir=job.get("profile"),
            profile_steps=job.get("profile_steps", 2),
        )
    import peer_torch

    return peer_torch.run(
        job["torch"], checkpointing=side == "torch_ckpt", steps=job["steps"], warmup=job["warmup"]
    )


def summarize(results: dict[str, dict]) -> dict:
    """Ratios to ours (side seconds / ours seconds: > 1 means ours is faster) and, when both
    ran, the first step's metric differences (absolute and relative to ours)."""
    ours = results.get("ours", {})
    out = {"ratio_to_ours": {}, "metric_diff": {}}
    for side, r in results.items():
        if "error" in r or "error" in ours or not ours:
            continue
        out["ratio_to_ours"][side] = r["step_s"] / ours["step_s"]
        if side != "ours":
            out["metric_diff"][side] = {
                k: {
                    "abs": abs(r["metrics"][k] - v),
                    "rel": abs(r["metrics"][k] - v) / max(abs(v), 1e-30),
                }
                for k, v in ours["metrics"].items()
            }
    return out


COLUMNS = (
    ("side", "side", ""),
    ("step_s", "step s", ".3f"),
    ("ratio", "side/ours", ".2f"),
    ("peak_gib", "peak GiB", ".2f"),
    ("tokens", "tokens", "d"),
    ("tokens_per_s", "tokens/s", ".0f"),
    ("loss", "loss", ".6g"),
    ("grad_norm", "grad norm", ".6g"),
)


def table_rows(results: dict[str, dict], summary: dict) -> list[dict]:
    rows = []
    for side, r in results.items():
        if "error" in r:
            rows.append({"side": side, "error": r["error"]})
            continue
        rows.append(
            {
                "side": side,
                "step_s": r["step_s"],
                "ratio": summary["ratio_to_ours"].get(side),
                "peak_gib": r.get("peak_gib"),
                "tokens": r["tokens"],
                "tokens_per_s": r["tokens"] / r["step_s"],
                "loss": r["metrics"]["loss"],
                "grad_norm": r["metrics"]["grad_norm"],
            }
        )
    return rows


def side_timeouts(spec: str, default: float) -> dict[str, float]:
    """'torch=40,ours=115' -> {side: seconds}; sides not named get `default` (0: none)."""
    out = {side: default for side in SIDES}
    for item in filter(None, spec.split(",")):
        side, sep, secs = item.partition("=")
        if not sep or side not in SIDES:
            raise SystemExit(f"--side_timeouts: side=seconds with a side of {SIDES}, got {item!r}")
        out[side] = float(secs)
    return out


def parse_args(argv):
    p = harness.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--config", default="configs/grpo.py:1.5b", help="config file (path[:arg])")
    p.add_argument("--set", action="append", default=[], help="dotted override key=value")
    p.add_argument("--sides", default=",".join(SIDES), help=f"comma-separated of {SIDES}")
    p.add_argument("--steps", type=int, default=3, help="timed steps per side (median)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps after the first call")
    p.add_argument("--weights", choices=("random", "same"), default="random")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the results here (after every side)")
    p.add_argument("--profile", default=None, help="trace ours into this folder")
    p.add_argument("--profile_steps", type=int, default=2)
    p.add_argument("--profile_json", default=None, help="write the kernel table here")
    p.add_argument("--side_timeout_s", type=float, default=0, help="per side (0: none)")
    p.add_argument(
        "--side_timeouts", default="", help="side=seconds,... (overrides --side_timeout_s)"
    )
    p.add_argument("--cpu_smoke", action="store_true", help="tiny model and shapes, same weights")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--job", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.child:
        harness.emit(run_side(args.child, json.loads(pathlib.Path(args.job).read_text())))
        return
    sides = [s for s in args.sides.split(",") if s]
    if not sides or set(sides) - set(SIDES):
        raise SystemExit(f"--sides: choose from {SIDES}, got {args.sides!r}")
    timeouts = side_timeouts(args.side_timeouts, args.side_timeout_s)
    import peer_job
    import peer_ours

    work = pathlib.Path(tempfile.mkdtemp(prefix="peer_step_"))
    config, overrides = args.config, list(args.set)
    checkpoint = None
    if args.cpu_smoke:
        config, overrides = SMOKE_CONFIG, SMOKE_SET + overrides
        base = str(harness.REPO / "third_party/hf_configs/deepseek_r1_distill_qwen_1_5b.json")
        checkpoint = peer_job.write_checkpoint(base, work / "ckpt", args.seed, **TINY_ARCH)
    cfg = peer_ours.load_config(config, overrides)
    if args.weights == "same" and checkpoint is None:
        checkpoint = peer_job.write_checkpoint(
            str(peer_ours.hf_config_path(cfg)), work / "ckpt", args.seed
        )
    job = {
        "config": config,
        "overrides": overrides,
        "steps": args.steps,
        "warmup": args.warmup,
        "profile": args.profile,
        "profile_steps": args.profile_steps,
        "torch": peer_job.torch_job(cfg, checkpoint=checkpoint, seed=args.seed),
    }
    job_path = work / "job.json"
    job_path.write_text(json.dumps(job))
    shape = job["torch"]["shape"]
    print(f"{config} {' '.join(overrides)}: {shape}, {cfg.loss.minibatches} minibatches")
    results: dict[str, dict] = {}
    report = {"config": config, "overrides": overrides, "job": job, "sides": results}
    for side in sides:
        print(f"running {side} ...", flush=True)
        argv_ = harness.self_argv(__file__, f"--child={side}", f"--job={job_path}")
        results[side] = harness.run_child(argv_, timeout_s=timeouts.get(side))
        report["summary"] = summarize(results)
        harness.write_json(args.json, report)
    summary = report["summary"]
    print(harness.format_table(table_rows(results, summary), COLUMNS), flush=True)
    for side, diff in summary["metric_diff"].items():
        worst = ", ".join(f"{k} {v['abs']:.2e} ({v['rel']:.1e})" for k, v in diff.items())
        print(f"  {side} - ours, first step: {worst}")
    prof = results.get("ours", {}).get("profile")
    if prof:
        import kernel_profile

        print(kernel_profile.format_table(prof))
        harness.write_json(args.profile_json, {"config": config, "overrides": overrides, **prof})
    if any("error" in r for r in results.values()):
        sys.exit(1)


if __name__ == "__main__":
    harness.run(main)
