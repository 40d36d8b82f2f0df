"""The study-v2 task generators: counts, disjointness, answers, determinism, wiring."""

import operator
import os
import sys

import pytest

from mmr_jax.config import checks
from mmr_jax.problems import data, tasks
from mmr_jax.training import problem_sets

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "configs"))
import base


def _value(question: str) -> int:
    """Left-to-right value of 'What is 7 + 12 - 5?', parsed here, not by the generators."""
    assert question.startswith("What is ") and question.endswith("?")
    tokens = question[len("What is ") : -1].split(" ")
    ops = {"+": operator.add, "-": operator.sub, "*": operator.mul}
    value = int(tokens[0])
    for op, operand in zip(tokens[1::2], tokens[2::2], strict=True):
        assert value >= 0  # partial results stay non-negative
        value = ops[op](value, int(operand))
    return value


@pytest.mark.parametrize("name", sorted(tasks.TASKS))
def test_split_sizes_disjoint_distinct_and_correct(name):
    train, heldout = tasks.split(name)
    assert len(heldout) == tasks.HELDOUT_SIZE == 128
    assert tasks.MIN_TRAIN_SIZE <= len(train) <= tasks.TRAIN_SIZE
    questions = [p.problem for p in (*train, *heldout)]
    assert len(set(questions)) == len(questions)  # distinct, hence disjoint
    assert not {p.problem for p in train} & {p.problem for p in heldout}
    for p in (*train, *heldout):
        assert p.answer == str(_value(p.problem)) and int(p.answer) >= 0


def test_sizes_and_fixed_split():
    assert len(tasks.train_problems("mul_1d_2d")) == 720 - 128  # the whole space is used
    assert len(tasks.train_problems("add_2d")) == 1000
    # The split is part of the task: the same questions on every machine and in every run.
    golden = {"add_2d": "What is 32 + 30?", "add_sub_2d": "What is 60 - 14?",
              "chain3": "What is 9 + 15 + 4?", "mul_1d_2d": "What is 7 * 47?"}  # fmt: skip
    for name, first in golden.items():
        assert tasks.heldout_problems(name)[0].problem == first


def test_operand_ranges():
    ops = {
        name: {p.problem.split(" ")[3] for p in tasks.train_problems(name)} for name in tasks.TASKS
    }
    assert ops["add_2d"] == {"+"} and ops["add_sub_2d"] == {"+", "-"}
    assert ops["mul_1d_2d"] == {"*"}
    for p in tasks.train_problems("add_sub_2d"):
        a, b = (int(x) for x in p.problem[8:-1].split(" ")[::2])
        assert 10 <= a <= 99 and 10 <= b <= 99


def test_warmup_questions_are_in_no_task():
    # The warm-up trains on sums of two operands 1-9 ('arithmetic' source, max_operand 9).
    warmup = {p.problem for p in data.arithmetic_problems(2000, 1, max_operand=9, ops=("+",))}
    assert len(warmup) == 81
    for name in tasks.TASKS:
        train, heldout = tasks.split(name)
        assert not warmup & {p.problem for p in (*train, *heldout)}


def test_source_names_and_errors():
    assert tasks.task_name("task:chain3") == "chain3"
    assert tasks.task_name("arithmetic") is None
    with pytest.raises(ValueError, match="unknown task 'nope'"):
        tasks.task_name("task:nope")
    with pytest.raises(ValueError, match="unknown task"):
        tasks.split("nope")


def test_build_reads_the_task_from_the_config():
    c = base.get_config()
    c.data.source, c.eval.source = "task:add_sub_2d", "task"
    cfg = checks.from_config_dict(c)
    assert problem_sets.eval_problems(cfg)["heldout"] == tasks.heldout_problems("add_sub_2d")
    c.data.source = "arithmetic"
    with pytest.raises(ValueError, match="eval.source='task' needs data.source='task:<name>'"):
        problem_sets.eval_problems(checks.from_config_dict(c))


def test_training_prompts_are_the_task_training_set(tiny_llama_dir):
    import transformers

    c = base.get_config()
    c.data.source, c.eval.source, c.data.system_prompt = "task:chain3", "task", ""
    c.batch.max_prompt_len = 128
    tok = transformers.AutoTokenizer.from_pretrained(tiny_llama_dir)
    cfg = checks.from_config_dict(c)
    out = problem_sets.load_prompts(cfg, tok, {})  # a task's sets are disjoint already
    prompts, answers = out[0], out[1]
    want = tasks.train_problems("chain3")
    assert len(prompts) == len(want) == 1000
    assert answers == [p.answer for p in want]
    held = {tok.decode(data.build_prompt(tok, p, "")) for p in tasks.heldout_problems("chain3")}
    assert not held & {tok.decode(ids) for ids in prompts}
