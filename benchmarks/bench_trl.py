"""Anchor benchmark: TRL's GRPOTrainer and our trainer on the same work, seconds per step.

    python benchmarks/bench_trl.py                              # trl, ours (MMR on), ours_nommr
    python benchmarks/bench_trl.py --sides=trl,ours_nommr --steps=8 --warmup=2 --json=bench_trl.json

Both sides run the config's job (default configs/cpu_smollm2.py, the CPU default) for --steps
steps, each in its own subprocess, back to back (--rounds > 1 interleaves them):
  ours        scripts/train.py on the config, as the README runs it (the trainer in this tree).
  ours_nommr  the same with mmr.enabled=False: exactly TRL's work (no encoder, no reweighting).
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

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from mmr_jax import config_types, rewards  # noqa: E402
from mmr_jax.problems import data  # noqa: E402
from mmr_jax.step import step_batch  # noqa: E402
from mmr_jax.training import build  # noqa: E402

SIDES = ("trl", "ours", "ours_nommr")
# Our loss aggregation -> TRL's loss_type; advantage estimator -> TRL's scale_rewards.
LOSS_TYPES = {
    "seq_mean_token_mean": "grpo",
    "token_mean": "dapo",
    "seq_mean_token_sum_norm": "dr_grpo",
}
SCALE_REWARDS = {"grpo": "group", "dr_grpo": "none"}
# Ours: the phases of `time/step` the trainer logs.
OUR_PHASES = ("rollout", "rewards", "embeddings", "reweighting", "train", "sync")
# TRL: its profiling contexts (names as it logs them).
TRL_PHASES = ("transformers.generate", "_calculate_rewards", "_prepare_inputs", "compute_loss")


def overrides(steps: int, mmr: bool, model_path: str | None = None) -> dict:
    """Config keys both sides change from the config file: length, no checkpoints, MMR on/off."""
    model = {"model.path": model_path} if model_path else {}
    return model | {
        "total_steps": steps,
        "checkpoint.every": 0,
        "logging.every": 1,
        "logging.tensorboard": False,
        "logging.samples": 0,
        "mmr.enabled": mmr,
    }


def load_config(path: str, over: dict) -> config_types.TrainConfig:
    """`path[:arg]`'s get_config(), dotted `over` keys set, converted as scripts/train.py does."""
    return config_types.from_config_dict(
        config_types.set_keys(config_types.load_config_file(path), over)
    )


def _problems(cfg: config_types.TrainConfig) -> list[data.Problem]:
    # build.load_prompts returns ids only; the texts come from the same source here, and
    # `step_batches` checks that they render to exactly those ids.
    d = cfg.data
    if d.source == build.ARITHMETIC:
        return data.arithmetic_problems(
            2_000, cfg.seed, max_operand=d.arithmetic_max_operand, ops=d.arithmetic_ops
        )
    return data.load_problems(
        d.source, split=d.split, problem_field=d.problem_field, answer_field=d.answer_field
    )


def messages(problem: data.Problem, system_prompt: str | None) -> list[dict]:
    """The chat `data.build_prompt` renders: [system,] user."""
    out = [{"role": "user", "content": problem.problem}]
    if system_prompt:
        out.insert(0, {"role": "system", "content": system_prompt})
    return out


def trl_prompt_ids(tokenizer, conversation: list[dict]) -> list[int]:
    """The ids GRPOTrainer generates from (its `_tokenize_prompts` call on a conversation)."""
    out = tokenizer.apply_chat_template(
        conversation=[conversation], add_generation_prompt=True, tokenize=True, return_dict=True
    )
    return list(out["input_ids"][0])


def step_batches(cfg: config_types.TrainConfig, tokenizer, steps: int) -> list[list[tuple]]:
    """Per step, the B (prompt ids, answer, messages) our trainer draws, in its order.

    Raises ValueError when the messages do not render (TRL's way) to the trainer's prompt ids.
    """
    ids, answers, _ = build.load_prompts(cfg, tokenizer)
    rebuilt, problems, _ = data.build_prompts(
        tokenizer,
        _problems(cfg),
        cfg.data.system_prompt,
        max_prompt_length=cfg.batch.max_prompt_len,
    )
    if rebuilt != ids or [p.answer for p in problems] != answers:
        raise ValueError("the problems rebuilt here are not the trainer's")
    chats = [messages(p, cfg.data.system_prompt) for p in problems]
    # The trainer's iterator (trainer.setup): the order depends on the count and seed only.
    it = data.PromptIterator(
        list(zip(ids, answers, chats, strict=True)), cfg.batch.prompts, cfg.seed
    )
    batches = [next(it) for _ in range(steps)]
    for batch in batches:
        for prompt_ids, _, chat in batch:
            if trl_prompt_ids(tokenizer, chat) != list(prompt_ids):
                raise ValueError(f"TRL would tokenise {chat!r} differently from the trainer")
    return batches


def make_reward_fn(cfg: config_types.TrainConfig, calls: list | None = None):
    """A TRL reward function scoring as our trainer does (rewards.score, the config's weights)."""
    weights, params = dict(cfg.rewards.weights), step_batch.reward_params(cfg)

    def accuracy(completions, answer, completion_ids, **kwargs):
        del kwargs
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        lengths = [len(c) for c in completion_ids]
        if calls is not None:
            calls.append(len(texts))
        return rewards.score(texts, list(answer), lengths, weights, params=params).total.tolist()

    return accuracy


def summarize(step_s: list[float], warmup: int) -> dict:
    """Median, min, max of the steps after `warmup` (ValueError when none is left)."""
    timed = step_s[warmup:]
    if not timed:
        raise ValueError(f"{len(step_s)} steps and {warmup} warm-up steps: nothing timed")
    return {
        "steps_timed": len(timed),
        "median_s": statistics.median(timed),
        "min_s": min(timed),
        "max_s": max(timed),
    }


def phase_medians(phases: list[dict], warmup: int) -> dict:
    keys = sorted({k for p in phases[warmup:] for k in p})
    return {k: statistics.median(p.get(k, 0.0) for p in phases[warmup:]) for k in keys}


def table(results: dict[str, dict], warmup: int) -> tuple[str, dict]:
    """The printed table and the summary per side; ratio = TRL median / side median."""
    summary = {side: summarize(r["step_s"], warmup) for side, r in results.items()}
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


# ----- the sides, each in its own process ---------------------------------------------------------


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


def trl_config(cfg: config_types.TrainConfig, steps: int, output_dir: str):
    """TRL's GRPOConfig for the config's job: B x G completions per optimiser update."""
    import trl

    b, g, mb = cfg.batch.prompts, cfg.batch.generations, cfg.loss.minibatches
    if (b * g) % mb:
        raise ValueError(f"{b} x {g} completions do not split into {mb} minibatches")
    o = cfg.optim
    return trl.GRPOConfig(
        output_dir=output_dir,
        max_steps=steps,
        per_device_train_batch_size=b * g // mb,
        gradient_accumulation_steps=mb,  # steps_per_generation follows: one generation per update
        num_generations=g,
        max_completion_length=cfg.batch.max_completion_len,
        temperature=cfg.rollout.temperature,
        top_p=cfg.rollout.top_p,
        top_k=cfg.rollout.top_k,
        beta=cfg.loss.beta,
        num_iterations=cfg.loss.iterations,
        epsilon=cfg.loss.eps_low,
        epsilon_high=cfg.loss.eps_high,
        loss_type=LOSS_TYPES[cfg.loss.aggregation],
        scale_rewards=SCALE_REWARDS[cfg.advantage.estimator],
        learning_rate=o.lr,
        lr_scheduler_type="cosine_with_min_lr",
        lr_scheduler_kwargs={"min_lr_rate": o.min_lr_ratio},
        warmup_steps=o.warmup_ratio,  # < 1: a fraction of max_steps
        adam_beta1=o.b1,
        adam_beta2=o.b2,
        adam_epsilon=o.eps,
        weight_decay=o.weight_decay,
        max_grad_norm=o.grad_clip,
        bf16=False,
        activation_checkpointing=cfg.model.remat != "none",
        use_cpu=True,
        shuffle_dataset=False,  # the dataset is already in our trainer's order
        seed=cfg.seed,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
    )


def trl_worker(args) -> None:
    """TRL's GRPOTrainer for --steps steps; writes per-step times, phases and logs as JSON."""
    import datasets
    import torch
    import transformers
    import trl
    from trl.extras import profiling

    torch.set_num_threads(args.threads)
    cfg = load_config(args.config, overrides(args.steps, mmr=False, model_path=args.model_path))
    b, g = cfg.batch.prompts, cfg.batch.generations
    tokenizer = transformers.AutoTokenizer.from_pretrained(cfg.model.path)
    batches = step_batches(cfg, tokenizer, args.steps)
    dataset = datasets.Dataset.from_list(
        [{"prompt": chat, "answer": answer} for batch in batches for _, answer, chat in batch]
    )
    model = transformers.AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=torch.float32)
    config = trl_config(cfg, args.steps, os.path.dirname(args.worker_out))
    calls, phases, marks, logged = [], [{}], [], []
    log_metrics = profiling.ProfilingContext._log_metrics

    def record(self, duration):
        name = self.name.split(".", 1)[-1]  # "GRPOTrainer.transformers.generate" -> phase
        phases[-1][name] = phases[-1].get(name, 0.0) + duration
        log_metrics(self, duration)

    profiling.ProfilingContext._log_metrics = record

    class Clock(transformers.TrainerCallback):
        def on_train_begin(self, *a, **k):
            marks.append(time.perf_counter())

        def on_step_end(self, *a, **k):
            marks.append(time.perf_counter())
            phases.append({})

        def on_log(self, _args, _state, _control, logs=None, **k):
            logged.append(dict(logs or {}))

    trainer_ = trl.GRPOTrainer(
        model=model,
        reward_funcs=make_reward_fn(cfg, calls),
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[Clock()],
    )
    trainer_.train()
    step_logs = [x for x in logged if "completions/mean_length" in x]
    if calls != [b * g] * args.steps:
        raise RuntimeError(f"expected one reward call of {b * g} per step, got {calls}")
    result = {
        "step_s": [t1 - t0 for t0, t1 in zip(marks[:-1], marks[1:], strict=True)],
        "phases": [{k: p[k] for k in TRL_PHASES if k in p} for p in phases[: args.steps]],
        "completion_len": [float(x["completions/mean_length"]) for x in step_logs],
        "reward_mean": [float(x["reward"]) for x in step_logs],
        "trl_step_time": [float(x["step_time"]) for x in step_logs if "step_time" in x],
        "versions": {"trl": trl.__version__, "torch": torch.__version__},
        "torch_threads": torch.get_num_threads(),
        "generation_kwargs": {k: str(v) for k, v in trainer_.generation_kwargs.items()},
    }
    with open(args.worker_out, "w", encoding="utf-8") as f:
        json.dump(result, f)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--config", default="configs/cpu_smollm2.py")
    p.add_argument("--sides", default=",".join(SIDES), help=f"comma-separated of {SIDES}")
    p.add_argument("--steps", type=int, default=6, help="steps per side and round")
    p.add_argument("--warmup", type=int, default=2, help="first steps of each run left untimed")
    p.add_argument("--rounds", type=int, default=1, help="runs of every side, interleaved")
    p.add_argument("--threads", type=int, default=2, help="torch threads (TRL)")
    p.add_argument("--model_path", default=None, help="instead of the config's model.path")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--workdir", default=None, help="keep the runs here (default: a temp dir)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--worker_out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker == "trl":
        trl_worker(args)
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
                        over = overrides(args.steps, mmr=side == "ours", model_path=args.model_path)
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
            if args.json:  # after every run, so that an interrupted benchmark keeps what it has
                with open(args.json, "w", encoding="utf-8") as f:
                    json.dump({"args": vars(args), "results": results}, f, indent=1)
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
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"args": vars(args), "summary": summary, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
