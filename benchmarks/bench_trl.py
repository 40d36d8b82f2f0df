"""Anchor benchmark: TRL's GRPOTrainer and our trainer on the same work, seconds per step.

    python benchmarks/bench_trl.py                              # trl, ours (MMR on), ours_nommr
    python benchmarks/bench_trl.py --sides=trl,ours_nommr --steps=8 --warmup=2 --json=bench_trl.json

Both sides run the config's job (default configs/cpu_smollm2.py, the CPU default) for --steps
steps, each in its own subprocess, back to back (--rounds > 1 interleaves them):
  ours        scripts/train.py on the config, as the README runs it (the trainer in this tree).
  ours_nommr  the same with reweight.method=none: exactly TRL's work (no encoder, no reweighting).
  trl         trl.GRPOTrainer (pip install -e .[bench]) on the same HF checkpoint (fp32), the same
              prompts in the same order (our arithmetic generator, system prompt, chat template and
              PromptIterator, fed as a datasets.Dataset of messages, unshuffled), B prompts x G
              completions per optimiser update (per_device_train_batch_size = B*G / minibatches,
              gradient_accumulation_steps = minibatches, so one generation of B*G per update, as
              our loss.minibatches), the same max new tokens, temperature, top_p/top_k, beta, lr,
              warmup and cosine-to-min schedule, clip and loss aggregation, and our reward function
              (mmr_jax.rewards.score with the config's accuracy parameters) as its reward.
TRL keeps its generation defaults (transformers `generate`, dynamic KV cache, no
`cache_implementation`, no compile); bf16 is off (TRL's default is on) and gradient checkpointing
follows model.remat (TRL's default is on), so both sides do fp32 work without recomputation.
torch runs --threads threads; JAX its defaults on the same cores. Checkpoints are off on both sides.

Seconds per step: ours the trainer's own `time/step` (metrics.jsonl); TRL the wall time between
optimiser updates (a TrainerCallback). The figure is the median over the steps after --warmup
(compilation, first-call overheads), with TRL's per-phase split from its own profiling contexts
(`transformers.generate`, `_calculate_rewards`, `_prepare_inputs`, `compute_loss` = the forward)
and ours from `time/*`. The ratio column is TRL's median over the side's median.
"""

from __future__ import annotations

import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import trl_job  # noqa: E402  (benchmarks/, beside this file: the job and TRL's side)

from mmr_jax.infra import bench_harness as harness  # noqa: E402

SIDES = ("trl", "ours", "ours_nommr")
# Ours: the phases of `time/step` the trainer logs.
OUR_PHASES = ("rollout", "rewards", "embeddings", "reweighting", "train", "sync")
FLAGS = {
    "config": ("configs/cpu_smollm2.py", "the job's config file"),
    "sides": (",".join(SIDES), f"comma-separated of {SIDES}"),
    "steps": (6, "steps per side and round"),
    "warmup": (2, "first steps of each run left untimed"),
    "rounds": (1, "runs of every side, interleaved"),
    "threads": (2, "torch threads (TRL)"),
    "model_path": (None, "instead of the config's model.path"),
    "workdir": (None, "keep the runs here (default: a temp dir)"),
    "worker": (None, "internal: run one side here (trl)"),
    "worker_out": (None, "internal: the worker's JSON"),
}


def phase_medians(phases: list[dict], warmup: int) -> dict:
    keys = sorted({k for p in phases[warmup:] for k in p})
    return {k: statistics.median(p.get(k, 0.0) for p in phases[warmup:]) for k in keys}


def table(results: dict[str, dict], warmup: int) -> tuple[str, dict]:
    """The printed table and the summary per side; ratio = TRL median / side median."""
    summary = {side: harness.step_summary(r["step_s"], warmup) for side, r in results.items()}
    for side, r in results.items():
        summary[side]["phases"] = phase_medians(r["phases"], warmup)
        summary[side]["completion_len_mean"] = statistics.mean(r["completion_len"][warmup:])
    trl = summary.get("trl", {}).get("median_s")
    for s in summary.values():
        s["trl_over_side"] = trl / s["median_s"] if trl else None
    head = f"{'side':<11} {'timed':>5} {'median s':>9} {'min':>7} {'max':>7} {'len':>5}"
    lines = [f"{head} {'TRL/side':>9}"]
    for side, s in summary.items():
        ratio = f"{s['trl_over_side']:9.2f}" if s["trl_over_side"] else f"{'-':>9}"
        lines.append(
            f"{side:<11} {s['steps_timed']:>5} {s['median_s']:9.2f} {s['min_s']:7.2f} "
            f"{s['max_s']:7.2f} {s['completion_len_mean']:5.1f} {ratio}"
        )
    for side, s in summary.items():
        split = ", ".join(f"{k} {v:.2f}" for k, v in s["phases"].items())
        lines.append(f"  {side} phases (median s): {split}")
    return "\n".join(lines), summary


def whole_run(results: dict[str, dict]) -> dict[str, dict]:
    """Per side, the mean step over whole runs (first steps, compilation, included), pooled over
    rounds, and TRL's over it: what a user's short experiment sees."""
    out = {}
    for side, r in results.items():
        steps = [t for run in r["rounds"] for t in run["step_s"]]
        out[side] = {"whole_run_mean_s": statistics.mean(steps)}
    trl = out.get("trl", {}).get("whole_run_mean_s")
    for w in out.values():
        w["trl_over_side_whole_run"] = trl / w["whole_run_mean_s"] if trl else None
    return out


def format_whole_run(whole: dict[str, dict]) -> str:
    lines = ["whole runs, every step counted (mean s/step, TRL/side):"]
    for side, w in whole.items():
        ratio = w["trl_over_side_whole_run"]
        shown = f"{ratio:.2f}x" if ratio else "-"
        lines.append(f"  {side:<11} {w['whole_run_mean_s']:8.2f} {shown:>8}")
    return "\n".join(lines)


def read_our_metrics(workdir: str) -> dict:
    """Per-step seconds, phases, completion lengths and rewards from a run's metrics.jsonl."""
    with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
        rows = sorted((json.loads(line) for line in f if line.strip()), key=lambda r: r["step"])
    if [r["step"] for r in rows] != list(range(1, len(rows) + 1)):
        raise ValueError(f"{workdir}: steps {[r['step'] for r in rows]}, expected 1, 2, ...")
    return {
        "step_s": [r["time/step"] for r in rows],
        "phases": [{k: r[f"time/{k}"] for k in OUR_PHASES if f"time/{k}" in r} for r in rows],
        "completion_len": [r["completion/length_mean"] for r in rows],
        "reward_mean": [r["reward/mean"] for r in rows],
    }


def run_ours(config: str, over: dict, workdir: str, log) -> dict:
    """scripts/train.py on `config` with `over`; per-step figures from its metrics.jsonl."""
    cmd = [sys.executable, str(ROOT / "scripts" / "train.py"), f"--config={config}"]
    cmd += [f"--workdir={workdir}"] + [f"--config.{k}={v}" for k, v in over.items()]
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    return read_our_metrics(workdir)


def run_trl(args, workdir: str, log) -> dict:
    out = os.path.join(workdir, "trl.json")
    cmd = [sys.executable, __file__, "--worker=trl", f"--worker_out={out}"]
    cmd += [f"--config={args.config}", f"--steps={args.steps}", f"--threads={args.threads}"]
    cmd += [f"--model_path={args.model_path}"] if args.model_path else []
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
    with open(out, encoding="utf-8") as f:
        return json.load(f)


def main(argv=None) -> None:
    args, p = harness.parse_args(__doc__, FLAGS, argv)
    if args.worker == "trl":
        trl_job.trl_worker(args)
        return
    sides = [s for s in args.sides.split(",") if s]
    unknown = set(sides) - set(SIDES)
    if unknown or not sides:
        p.error(f"--sides: unknown {sorted(unknown)}; choose from {SIDES}")
    if args.steps <= args.warmup:
        p.error(f"--steps ({args.steps}) must exceed --warmup ({args.warmup})")
    root = args.workdir or tempfile.mkdtemp(prefix="bench_trl_")
    results = {s: {"step_s": [], "phases": [], "completion_len": [], "rounds": []} for s in sides}
    for round_ in range(args.rounds):
        for side in sides:
            workdir = os.path.join(root, f"{side}_{round_}")
            os.makedirs(workdir, exist_ok=True)
            print(f"round {round_} {side}: log {workdir}/log.txt", flush=True)
            load_before = os.getloadavg()[0]
            try:
                with open(os.path.join(workdir, "log.txt"), "w") as log:
                    if side == "trl":
                        r = run_trl(args, workdir, log)
                    else:
                        over = trl_job.overrides(
                            args.steps, mmr=side == "ours", model_path=args.model_path
                        )
                        r = run_ours(args.config, over, workdir, log)
            except subprocess.CalledProcessError as e:  # e.g. killed for memory: go on, say so
                print(f"  {side} FAILED ({e}); see {workdir}/log.txt", flush=True)
                results[side].setdefault("failed", []).append(str(e))
                continue
            r["load_1min"] = (load_before, os.getloadavg()[0])  # the machine may be shared
            # Warm-up steps are dropped per run, then the rounds' timed steps are pooled.
            results[side]["rounds"].append(r)
            for k in ("step_s", "phases", "completion_len"):
                results[side][k] += r[k][args.warmup :]
            steps_s = " ".join(f"{t:.1f}" for t in r["step_s"])
            print(f"  {side}: s/step {steps_s}; load {r['load_1min']}", flush=True)
            # After every run, so that an interrupted benchmark keeps what it has.
            harness.write_json(args.json, {"args": vars(args), "results": results})
    done = {side: r for side, r in results.items() if r["step_s"]}
    if not done:
        sys.exit("no side completed a run")
    text, summary = table(done, warmup=0)
    whole = whole_run(done)
    for side, w in whole.items():
        summary[side].update(w)
    print(
        f"\n{args.config}, {args.steps} steps x {args.rounds} rounds, first {args.warmup} "
        f"of each untimed; load {os.getloadavg()}\n{text}\n{format_whole_run(whole)}"
    )
    harness.write_json(args.json, {"args": vars(args), "summary": summary, "results": results})


if __name__ == "__main__":
    harness.run(main)
