"""What a run trains and evaluates on, from its config: the training prompts that fit the
prompt budget (longer problems dropped and counted, never truncated) and the held-out problems.
"""

from __future__ import annotations

from typing import NamedTuple

from absl import logging

from mmr_jax.config import schema
from mmr_jax.problems import data, tasks

ARITHMETIC = "arithmetic"  # data.source for generated problems (`data.arithmetic_problems`)
TASK = (
    "task"  # eval.source: the held-out set of data.source='task:<name>' (`mmr_jax.problems.tasks`)
)


class TrainPrompts(NamedTuple):
    ids: list[list[int]]  # prompt token ids
    answers: list[str]  # gold answers
    dropped: int  # problems whose prompt exceeds batch.max_prompt_len (never truncated)


def load(cfg: schema.TrainConfig, tokenizer) -> tuple[TrainPrompts, dict[str, list[data.Problem]]]:
    """(training prompts, held-out problems by benchmark). The held-out problems are loaded once,
    here, when the run evaluates (`eval.every` > 0) or must keep them out of training
    (`eval.source='arithmetic'`); else none."""
    needed = cfg.eval.every > 0 or cfg.eval.source == ARITHMETIC
    heldout = eval_problems(cfg) if needed else {}
    return load_prompts(cfg, tokenizer, heldout), heldout


def load_prompts(
    cfg: schema.TrainConfig, tokenizer, heldout: dict[str, list[data.Problem]]
) -> TrainPrompts:
    """The training prompts that fit `batch.max_prompt_len`; longer ones are dropped, counted.
    With `eval.source='arithmetic'` the held-out problems (`eval_problems`) are never trained on."""
    d = cfg.data
    if tasks.task_name(d.source):  # 'task:<name>': its fixed training set (issue 26)
        problems = tasks.train_problems(tasks.task_name(d.source))
    elif d.source == ARITHMETIC:
        problems = data.arithmetic_problems(
            2_000, cfg.seed, max_operand=d.arithmetic_max_operand, ops=d.arithmetic_ops
        )
    else:
        problems = data.load_problems(
            d.source, split=d.split, problem_field=d.problem_field, answer_field=d.answer_field
        )
    if cfg.eval.source == ARITHMETIC:  # the held-out set is never trained on
        problems, removed = data.without(problems, heldout["heldout"])
        logging.info("data: %d training problems removed (in the held-out set)", removed)
    prompts, kept, dropped = data.build_prompts(
        tokenizer, problems, d.system_prompt, max_prompt_length=cfg.batch.max_prompt_len
    )
    if dropped:
        logging.info(
            "data: %d of %d problems longer than %d tokens dropped",
            dropped,
            len(problems),
            cfg.batch.max_prompt_len,
        )
    if not prompts:
        shortest = min(
            len(data.build_prompt(tokenizer, p, d.system_prompt)) for p in problems[:100]
        )
        raise schema.ConfigError(
            f"no training problem of {d.source} fits "
            f"batch.max_prompt_len={cfg.batch.max_prompt_len} "
            f"tokens (with the system prompt; shortest of the first 100: {shortest}); "
            f"raise it, e.g. --config.batch.max_prompt_len={shortest}"
        )
    return TrainPrompts(prompts, [p.answer for p in kept], dropped)


def eval_problems(cfg: schema.TrainConfig) -> dict[str, list[data.Problem]]:
    """Benchmark name -> problems of `cfg.eval`: benchmark files, or the held-out arithmetic set."""
    from mmr_jax.problems import evaluation

    e = cfg.eval
    if e.source == TASK:  # the held-out set of data.source's task, disjoint from its training set
        name = tasks.task_name(cfg.data.source)
        if name is None:
            raise ValueError(
                f"eval.source='task' needs data.source='task:<name>', got {cfg.data.source!r}"
            )
        return {"heldout": tasks.heldout_problems(name)}
    if e.source != ARITHMETIC:
        return evaluation.load_benchmarks(e.data_dir, e.benchmarks, max_problems=e.max_problems)
    heldout = data.heldout_arithmetic(
        e.arithmetic_problems,
        e.arithmetic_seed,
        max_operand=cfg.data.arithmetic_max_operand,
        ops=cfg.data.arithmetic_ops,
    )
    return {"heldout": heldout}
