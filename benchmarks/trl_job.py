"""The job `bench_trl.py` runs on both sides, and TRL's side of it.

The job: the config file's run with `overrides` (length, no checkpoints, MMR on or off), the
prompts our trainer draws in its order (`step_batches`, checked to render through TRL's chat
template to the trainer's ids), and our reward function as a TRL reward (`make_reward_fn`).
TRL's side: `trl_config` (GRPOConfig of the same batch, lengths, sampling, loss and optimiser)
and `trl_worker`, GRPOTrainer for --steps steps in its own process, timed per update.
"""

from __future__ import annotations

import os
import time

from mmr_jax import rewards
from mmr_jax.config import command_line, schema
from mmr_jax.infra import bench_harness as harness
from mmr_jax.problems import data
from mmr_jax.step import pipeline
from mmr_jax.training import problem_sets

# Our loss aggregation -> TRL's loss_type; advantage estimator -> TRL's scale_rewards.
LOSS_TYPES = {
    "seq_mean_token_mean": "grpo",
    "token_mean": "dapo",
    "seq_mean_token_sum_norm": "dr_grpo",
}
SCALE_REWARDS = {"grpo": "group", "dr_grpo": "none"}
# TRL: its profiling contexts (names as it logs them).
TRL_PHASES = ("transformers.generate", "_calculate_rewards", "_prepare_inputs", "compute_loss")


def overrides(steps: int, mmr: bool, model_path: str | None = None) -> dict:
    """Config keys both sides change from the config file: length, no checkpoints or evaluation,
    MMR on/off."""
    model = {"model.path": model_path} if model_path else {}
    return model | {
        "total_steps": steps,
        "checkpoint.every": 0,
        "eval.every": 0,  # the CPU default evaluates before and after (issue 55): not timed here
        "logging.every": 1,
        "logging.tensorboard": False,
        "logging.samples": 0,
        "reweight.method": "mmr" if mmr else "none",
    }


def _problems(cfg: schema.TrainConfig) -> list[data.Problem]:
    # problem_sets.load_prompts returns ids only; the texts come from the same source here, and
    # `step_batches` checks that they render to exactly those ids.
    d = cfg.data
    if d.source == problem_sets.ARITHMETIC:
        problems = data.arithmetic_problems(
            2_000, cfg.seed, max_operand=d.arithmetic_max_operand, ops=d.arithmetic_ops
        )
        if cfg.eval.source == problem_sets.ARITHMETIC:  # as the trainer: the held-out set removed
            problems, _ = data.without(problems, problem_sets.eval_problems(cfg)["heldout"])
        return problems
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


def step_batches(cfg: schema.TrainConfig, tokenizer, steps: int) -> list[list[tuple]]:
    """Per step, the B (prompt ids, answer, messages) our trainer draws, in its order.

    Raises ValueError when the messages do not render (TRL's way) to the trainer's prompt ids.
    """
    ids, answers, _ = problem_sets.load(cfg, tokenizer)[0]
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


def make_reward_fn(cfg: schema.TrainConfig, calls: list | None = None):
    """A TRL reward function scoring as our trainer does (rewards.score, the config's weights)."""
    weights, params = dict(cfg.rewards.weights), pipeline.reward_params(cfg)

    def accuracy(completions, answer, completion_ids, **kwargs):
        del kwargs
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        lengths = [len(c) for c in completion_ids]
        if calls is not None:
            calls.append(len(texts))
        return rewards.score(texts, list(answer), lengths, weights, params=params).total.tolist()

    return accuracy


def trl_config(cfg: schema.TrainConfig, steps: int, output_dir: str):
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
    cfg = command_line.load_config(
        args.config, overrides(args.steps, mmr=False, model_path=args.model_path)
    )
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
    harness.write_json(args.worker_out, result)
