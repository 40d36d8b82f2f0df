"""Problems -> prompts: loading (hub name or local JSONL/parquet), chat prompts, resumable order.

problems = data.load_problems("../shared/data/eval/math500.jsonl")
prompts, kept, dropped = data.build_prompts(tokenizer, problems, data.TRAIN_SYSTEM_PROMPT,
                                            max_prompt_length=512)
it = data.PromptIterator(kept, batch_size=8, seed=2025)
batch = next(it); saved = it.state(); ...; it.restore(saved)
"""

from __future__ import annotations

import dataclasses
import os
import random
from collections.abc import Sequence
from typing import Any

import numpy as np

from mmr_jax.infra import user_errors

# The paper's prompts (MMR-GRPO, Appendix "System Prompt"), verbatim.
TRAIN_SYSTEM_PROMPT = (
    "A conversation between User and Assistant. The user asks a question, and the Assistant "
    "solves it. The assistant first thinks about the reasoning process in the mind and then "
    "provides the user with the answer, and put your final answer within \\boxed{} . The "
    "reasoning process and answer are enclosed within <think> </think> and <answer> </answer> "
    "tags, respectively, i.e., <think> reasoning process here </think> <answer> answer here "
    "</answer>. Note that respond by English, NOT use other languages."
)
# The paper prints lighteval's MATH_QUERY_TEMPLATE source; this is the text the model sees after
# `.format`: `{{ANSWER}}` becomes `{ANSWER}` and the doubled backslash a single one.
EVAL_SYSTEM_PROMPT = (
    "Solve the following math problem efficiently and clearly.  The last line of your response "
    "should be of the following format: 'Therefore, the final answer is: $\\boxed{ANSWER}$. "
    "I hope it is correct' (without quotes) where ANSWER is just the final number or expression "
    "that solves the problem. Think step by step before answering.\n"
)

# What a problem file must hold, said with each error about one.
_NEEDS = (
    "a problem file holds one problem per row ({'problem': ..., 'answer': ...} per JSONL line); "
    "see docs/data.md"
)
_LOCAL_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
# The data folder (eval/ and train/ JSONL) is ../shared/data beside the checkout unless this is set.
DATA_ENV = "MMR_JAX_SHARED_DATA"


class DataNotFoundError(user_errors.UserError, FileNotFoundError):
    """A problem file or data folder that is not there; the message says how to get it."""


class DataFileError(user_errors.UserError, ValueError):
    """A problem file that holds no problems, or a row without a usable problem or answer."""


def missing_data_message(path: str | os.PathLike) -> str:
    """'<path> does not exist' and the two ways to get the data folder (docs/data.md)."""
    path = os.path.abspath(os.fspath(path))
    parts = path.split(os.sep)
    # .../<data folder>/{eval,train}[/<file>]: suggest building that very folder.
    kind = next((i for i in range(len(parts) - 1, 0, -1) if parts[i] in ("eval", "train")), None)
    out = (os.sep.join(parts[:kind]) or os.sep) if kind else "<folder>"
    return (
        f"{path} does not exist. Get the data: `python scripts/prepare_data.py --out={out}` "
        f"builds it from the public Hugging Face datasets, or place the offline data folder at "
        f"../shared/data beside the checkout (or set ${DATA_ENV} to it); see docs/data.md."
    )


@dataclasses.dataclass(frozen=True)
class Problem:
    """One problem: an id, the question text and the gold final answer (not normalised)."""

    id: str
    problem: str
    answer: str


def _load_rows(source: str, split: str):
    import datasets

    ext = os.path.splitext(source)[1].lower()
    if ext in _LOCAL_FORMATS:
        if not os.path.exists(source):
            raise DataNotFoundError(f"problem file: {missing_data_message(source)}")
        if _is_empty(source):  # the JSON loader's error for it is a bare StopIteration
            raise DataFileError(f"problem file {source} is empty: {_NEEDS}")
        return datasets.load_dataset(_LOCAL_FORMATS[ext], data_files=source, split="train")
    return datasets.load_dataset(source, split=split)


def _is_empty(path: str) -> bool:
    if os.path.getsize(path) > 4096:
        return False
    with open(path, "rb") as f:
        return not f.read().strip()


def _field(row: dict, name: str, source: str, index: int) -> str:
    value = row.get(name)
    if value is None:
        have = sorted(k for k, v in row.items() if v is not None)
        raise DataFileError(f"{source}: row {index}: missing field {name!r} (it has {have})")
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise DataFileError(f"{source}: row {index}: field {name!r} is {type(value).__name__}")
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    value = str(value)
    if not value.strip():
        raise DataFileError(f"{source}: row {index}: field {name!r} is empty")
    return value


def load_problems(
    source: str | os.PathLike,
    *,
    split: str = "train",
    problem_field: str = "problem",
    answer_field: str = "answer",
    id_field: str = "id",
) -> list[Problem]:
    """Loads problems from a hub dataset name or a local .jsonl/.json/.parquet file.

    Rows are numbered from 0 in file order. A missing or empty problem/answer raises ValueError
    naming the source, row and field; numeric answers (e.g. AIME integers) become strings. A row
    without `id_field` gets the id '<row index>'. A local file that is not there raises
    DataNotFoundError naming it and how to get the data.
    """
    source = os.fspath(source)
    rows = _load_rows(source, split)
    problems = []
    for i, row in enumerate(rows):
        problems.append(
            Problem(
                id=str(row[id_field]) if row.get(id_field) is not None else str(i),
                problem=_field(row, problem_field, source, i),
                answer=_field(row, answer_field, source, i),
            )
        )
    if not problems:
        raise DataFileError(f"{source} holds no rows: {_NEEDS}")
    return problems


def build_prompt(tokenizer, problem: Problem | str, system_prompt: str | None) -> list[int]:
    """Token ids of [system, user] rendered by the tokenizer's chat template, ready to generate.

    The template adds any BOS itself, so the text is tokenised without special tokens.
    """
    text = problem.problem if isinstance(problem, Problem) else problem
    messages = [{"role": "user", "content": text}]
    if system_prompt:
        messages.insert(0, {"role": "system", "content": system_prompt})
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer(rendered, add_special_tokens=False)["input_ids"])


def build_prompts(
    tokenizer,
    problems: Sequence[Problem],
    system_prompt: str | None,
    *,
    max_prompt_length: int | None = None,
) -> tuple[list[list[int]], list[Problem], int]:
    """Prompts for many problems; those over `max_prompt_length` tokens are dropped.

    Returns (prompt ids, the problems kept, in order, number dropped).
    """
    prompts, kept = [], []
    for p in problems:
        ids = build_prompt(tokenizer, p, system_prompt)
        if max_prompt_length is None or len(ids) <= max_prompt_length:
            prompts.append(ids)
            kept.append(p)
    return prompts, kept, len(problems) - len(kept)


class PromptIterator:
    """Endless seeded shuffle over `items`, in batches, with a position that can be saved.

    Epoch e visits the items in `np.random.default_rng([seed, e]).permutation(len(items))`, so
    every epoch has its own order and any (epoch, position) is reproducible. A batch that reaches
    the end of an epoch continues into the next one.
    """

    def __init__(self, items: Sequence[Any], batch_size: int, seed: int):
        if not items:
            raise ValueError("PromptIterator needs at least one item")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.items, self.batch_size, self.seed = list(items), batch_size, seed
        self.epoch, self.position = 0, 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.items))

    def __iter__(self):
        return self

    def __next__(self) -> list[Any]:
        batch = []
        while len(batch) < self.batch_size:
            if self.position == len(self.items):
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._permutation(self.epoch)
            batch.append(self.items[self._order[self.position]])
            self.position += 1
        return batch

    def state(self) -> dict:
        """{'epoch', 'position', 'seed', 'num_items'}: JSON-able, for checkpoints."""
        return dict(
            epoch=self.epoch, position=self.position, seed=self.seed, num_items=len(self.items)
        )

    def restore(self, state: dict) -> None:
        """Continues exactly where `state()` was taken (same items and seed required)."""
        if state.get("num_items", len(self.items)) != len(self.items):
            raise ValueError(f"state is for {state['num_items']} items, have {len(self.items)}")
        if state.get("seed", self.seed) != self.seed:
            raise ValueError(f"state is for seed {state['seed']}, iterator has {self.seed}")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._order = self._permutation(self.epoch)


def arithmetic_problems(
    n: int,
    seed: int,
    *,
    max_operand: int = 50,
    ops: Sequence[str] = ("+", "-", "*"),
    num_terms: int = 2,
) -> list[Problem]:
    """`n` easy integer problems such as 'What is 12 + 35?' (answer '47'), deterministic in `seed`.

    For the CPU default run: a 135M model solves some but not all, so rewards vary within groups.
    The right operand of a multiplication is at most 12, so products stay small.
    """
    rng = random.Random(seed)
    problems = []
    for i in range(n):
        expr = str(rng.randint(1, max_operand))
        for _ in range(num_terms - 1):
            op = rng.choice(list(ops))
            expr += f" {op} {rng.randint(1, 12 if op == '*' else max_operand)}"
        value = eval(expr, {"__builtins__": {}})  # our own string of integers and + - *
        problems.append(Problem(f"arith_{seed}_{i}", f"What is {expr}?", str(value)))
    return problems


def heldout_arithmetic(
    n: int, seed: int, *, max_operand: int = 50, ops: Sequence[str] = ("+", "-", "*")
) -> list[Problem]:
    """`n` distinct arithmetic problems of seed `seed`: the fixed held-out set of a study.

    Drawn as `arithmetic_problems` draws (same operand range and operators) until `n` distinct
    questions are found; `without` removes them from a training set. Raises ValueError when the
    range holds fewer than `n` distinct questions.
    """
    if n < 1:
        raise ValueError(f"held-out set size must be >= 1, got {n}")
    seen, out, tries = set(), [], 0
    while len(out) < n:
        tries += 1
        if tries > 100:
            raise ValueError(
                f"found only {len(out)} distinct problems of max_operand={max_operand}, "
                f"ops={tuple(ops)}; asked for {n}"
            )
        for p in arithmetic_problems(
            4 * n, seed + 7919 * (tries - 1), max_operand=max_operand, ops=ops
        ):
            if p.problem not in seen and len(out) < n:
                seen.add(p.problem)
                out.append(Problem(f"heldout_{seed}_{len(out)}", p.problem, p.answer))
    return out


def without(problems: Sequence[Problem], excluded: Sequence[Problem]) -> tuple[list[Problem], int]:
    """(`problems` whose question text is not among `excluded`'s, the number removed)."""
    banned = {p.problem for p in excluded}
    kept = [p for p in problems if p.problem not in banned]
    return kept, len(problems) - len(kept)
