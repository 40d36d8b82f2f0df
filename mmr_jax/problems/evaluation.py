"""pass@k evaluation through any rollout engine, per benchmark and averaged; checkpoint sweeps.

pass@k (Chen et al. 2021, "Evaluating Large Language Models Trained on Code"), per problem with n
samples of which c are correct: 1 - C(n-c, k) / C(n, k), averaged over problems; pass@1 = avg@n.
Grading: math-verify through `rewards.grading` (time-bounded). A problem whose gold answer cannot
be parsed counts as unsolved (keeping the benchmark's denominator) and is counted in
`num_gold_invalid`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from mmr_jax import distributed
from mmr_jax.problems import data
from mmr_jax.rewards import functions, grading
from mmr_jax.rollout import base

BENCHMARKS = ("math500", "aime24", "amc23", "minerva_math", "olympiadbench")


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k = 1 - C(n-c, k) / C(n, k).

    Computed as 1 - prod_{i=n-c+1}^{n} (1 - k/i), which never forms the (huge) binomials.
    """
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"need 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


@dataclasses.dataclass
class EvalResult:
    """per_benchmark: name -> {'pass@k': float, 'num_problems', 'num_gold_invalid', ...};
    average: 'pass@k' -> mean over benchmarks (unweighted, as in the paper's "Avg.");
    records: one dict per problem (benchmark, id, answer, correct [n] bools, pass@k, ...)."""

    per_benchmark: dict[str, dict[str, float]]
    average: dict[str, float]
    records: list[dict]

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def _decode(tokenizer, batch: base.RolloutBatch) -> list[list[str]]:
    return [_decode_row(tokenizer, batch, b) for b in range(batch.tokens.shape[0])]


def _decode_row(tokenizer, batch: base.RolloutBatch, b: int) -> list[str]:
    return [
        tokenizer.decode(batch.completion_ids(b, i), skip_special_tokens=True)
        for i in range(batch.tokens.shape[1])
    ]


def evaluate(
    engine: base.RolloutEngine,
    tokenizer,
    problems_by_benchmark: Mapping[str, Sequence[data.Problem]],
    *,
    n: int = 16,
    temperature: float = 0.6,
    top_p: float = 0.95,
    max_new_tokens: int,
    ks: Sequence[int] = (1, 2, 4, 8, 16),
    system_prompt: str | None = data.EVAL_SYSTEM_PROMPT,
    seed: int = 0,
    prompt_batch_size: int = 32,
    grader: grading.Grader | None = None,
    keep_completions: bool = False,
    number_only: bool = False,
) -> EvalResult:
    """Samples n completions per problem, grades them, and reports pass@k per benchmark.

    Args:
      engine: any RolloutEngine; prompts go in `prompt_batch_size` at a time.
      tokenizer: builds chat prompts (`data.build_prompt`) and decodes completions; its EOS is the
        stop token.
      problems_by_benchmark: benchmark name -> problems.
      ks: the k of pass@k; those above n are left out.
      seed: the sampling seed of the first prompt batch (batch j uses seed + j).
      keep_completions: store the completion texts in the records (large for long generations).
      number_only: a correct sample must also state a plain number (as the training reward's
        `number_only`: on arithmetic, restating "3 + 9" is not an answer).
    """
    grader = grader or grading.default_grader()
    ks = [k for k in ks if k <= n]
    stop = () if tokenizer.eos_token_id is None else (int(tokenizer.eos_token_id),)
    per_benchmark, records, calls = {}, [], 0
    for name, problems in problems_by_benchmark.items():
        bench_records = []
        for start in range(0, len(problems), prompt_batch_size):
            params = base.SamplingParams(
                max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, n=n,
                stop_token_ids=stop, seed=seed + calls,
            )  # fmt: skip
            calls += 1
            chunk = list(problems[start : start + prompt_batch_size])
            prompts = [data.build_prompt(tokenizer, p, system_prompt) for p in chunk]
            bench_records += _sample_and_grade(
                engine, tokenizer, chunk, prompts, params, grader, ks, keep_completions,
                number_only,
            )  # fmt: skip
        for r in bench_records:
            r["benchmark"] = name
        per_benchmark[name] = _summarise(bench_records, ks)
        records += bench_records
    average = {
        f"pass@{k}": float(np.mean([m[f"pass@{k}"] for m in per_benchmark.values()])) for k in ks
    }
    return EvalResult(per_benchmark=per_benchmark, average=average, records=records)


def _sample_and_grade(
    engine, tokenizer, problems, prompts, params, grader, ks, keep_completions, number_only
) -> list[dict]:
    """The records of one prompt batch. With several processes (`engine` a
    `distributed.ShareEngine`) each process samples and grades its own share; the records are
    gathered (`_gather_records`)."""
    grade = lambda batch, part: _grade_batch(
        tokenizer, batch, problems[part], grader, ks, keep_completions, number_only
    )
    if not isinstance(engine, distributed.ShareEngine):
        return grade(engine.generate(prompts, params), slice(None))
    local = engine.generate_local(prompts, params)
    mine = distributed.share_slices(len(problems))[jax.process_index()]
    graded = None if local is None else grade(local, mine)
    return _gather_records(local, graded, problems, params, tokenizer, ks, keep_completions)


def _grade_batch(
    tokenizer, batch, problems, grader, ks, keep_completions, number_only=False
) -> list[dict]:
    """One record per problem of a generated batch [B, G, T]."""
    n = batch.tokens.shape[1]
    texts = _decode(tokenizer, batch)
    flat = [t for ts in texts for t in ts]
    grades = grader.grade(flat, [p.answer for p in problems for _ in range(n)])
    correct = [g.correct for g in grades]
    if number_only:
        correct = [c and functions.states_a_number(t) for c, t in zip(correct, flat, strict=True)]
    out = []
    for b, p in enumerate(problems):
        g = grades[b * n : (b + 1) * n]
        out.append(
            _record(
                p, correct[b * n : (b + 1) * n], g[0].gold_valid, grading.timeouts(g),
                batch.lengths[b].tolist(), list(batch.finish_reasons[b]), ks,
                texts[b] if keep_completions else None,
            )
        )  # fmt: skip
    return out


def _record(problem, correct, gold_valid, timeouts, lengths, finish_reasons, ks, texts) -> dict:
    """One problem's record: its grades, lengths and pass@k (and completions, when kept)."""
    rec = dict(
        id=problem.id, answer=problem.answer, correct=[bool(c) for c in correct],
        gold_valid=bool(gold_valid), timeouts=int(timeouts), lengths=[int(x) for x in lengths],
        finish_reasons=list(finish_reasons),
    )  # fmt: skip
    rec.update({f"pass@{k}": pass_at_k(len(correct), sum(rec["correct"]), k) for k in ks})
    if texts is not None:
        rec["completions"] = list(texts)
    return rec


def _gather_records(
    local, records, problems, params, tokenizer, ks, keep_completions
) -> list[dict]:
    """The records of every process's share of `problems`, in problem order, from this
    process's completions `local` and their `records` (None when its share is empty): each
    process graded its own share. Kept completions travel as token ids, decoded where needed."""
    n = params.n
    specs = {
        "correct": ((n,), np.bool_),
        "gold_valid": ((1,), np.bool_),
        "timeouts": ((1,), np.int32),
        "lengths": ((n,), np.int32),
        "truncated": ((n,), np.bool_),
    }
    if keep_completions:
        specs.update(distributed.shares.rollout_specs(n, params.max_new_tokens))
    fields = None
    if records is not None:
        fields = {
            "correct": np.array([r["correct"] for r in records]),
            "gold_valid": np.array([[r["gold_valid"]] for r in records]),
            "timeouts": np.array([[r["timeouts"]] for r in records], np.int32),
            "lengths": np.array([r["lengths"] for r in records], np.int32),
            "truncated": np.array(local.finish_reasons) == base.FINISH_LENGTH,
        }
        if keep_completions:
            fields.update(distributed.shares.rollout_fields(local, params.max_new_tokens))
    parts = distributed.share_slices(len(problems))
    rows = distributed.gather_rows(fields, sizes=[p.stop - p.start for p in parts], specs=specs)
    finish = np.where(rows["truncated"], base.FINISH_LENGTH, base.FINISH_STOP).tolist()
    mine = parts[jax.process_index()]
    texts = [None] * len(problems)
    if keep_completions:
        batch = distributed.shares.rollout_from_rows(rows)
        texts = [
            records[b - mine.start]["completions"]
            if mine.start <= b < mine.stop
            else _decode_row(tokenizer, batch, b)
            for b in range(len(problems))
        ]
    return [
        _record(p, rows["correct"][b], rows["gold_valid"][b, 0], rows["timeouts"][b, 0],
                rows["lengths"][b], finish[b], ks, texts[b])
        for b, p in enumerate(problems)
    ]  # fmt: skip


def _summarise(records: list[dict], ks: Sequence[int]) -> dict[str, float]:
    out = {f"pass@{k}": float(np.mean([r[f"pass@{k}"] for r in records])) for k in ks}
    out["num_problems"] = len(records)
    out["num_gold_invalid"] = sum(not r["gold_valid"] for r in records)
    out["num_timeouts"] = sum(r["timeouts"] for r in records)
    out["mean_length"] = float(np.mean([np.mean(r["lengths"]) for r in records]))
    return out


def format_table(result: EvalResult) -> str:
    """A fixed-width table: one row per benchmark and the average, one column per pass@k (in %)."""
    keys = list(result.average)
    lines = [f"{'benchmark':<16}{'problems':>9}" + "".join(f"{k:>10}" for k in keys)]
    for name, m in result.per_benchmark.items():
        cells = "".join(f"{100 * m[k]:>10.2f}" for k in keys)
        lines.append(f"{name:<16}{m['num_problems']:>9d}{cells}")
    total = sum(m["num_problems"] for m in result.per_benchmark.values())
    lines.append(
        f"{'average':<16}{total:>9d}" + "".join(f"{100 * result.average[k]:>10.2f}" for k in keys)
    )
    return "\n".join(lines)


def write_json(result: EvalResult, path: str | os.PathLike, **metadata) -> None:
    """Writes {'metadata', 'per_benchmark', 'average', 'records'} as JSON."""
    os.makedirs(os.path.dirname(os.fspath(path)) or ".", exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"metadata": metadata, **result.to_json()}, f, indent=1)


def load_benchmarks(
    data_dir: str | os.PathLike, names: Sequence[str] = BENCHMARKS, *, max_problems: int = 0
) -> dict[str, list[data.Problem]]:
    """`<data_dir>/<name>.jsonl` for each name; the first `max_problems` of each (0 = all).

    A missing folder or file raises `data.DataNotFoundError` saying how to get the data.
    """
    if not os.path.isdir(data_dir):
        raise data.DataNotFoundError(f"benchmark folder: {data.missing_data_message(data_dir)}")
    out = {}
    for name in names:
        problems = data.load_problems(os.path.join(os.fspath(data_dir), f"{name}.jsonl"))
        out[name] = problems[:max_problems] if max_problems else problems
    return out


def find_checkpoints(run_dir: str | os.PathLike) -> list[tuple[int, str]]:
    """(step, path) of every `step_N` folder under `run_dir` holding a config.json, by step."""
    found = []
    for entry in os.listdir(run_dir):
        m = re.fullmatch(r"step_(\d+)", entry)
        path = os.path.join(os.fspath(run_dir), entry)
        if m and os.path.isfile(os.path.join(path, "config.json")):
            found.append((int(m.group(1)), path))
    return sorted(found)


def evaluate_run(
    checkpoints: Sequence[tuple[int, Any]],
    evaluate_checkpoint: Callable[[int, Any], EvalResult],
) -> tuple[list[tuple[int, EvalResult]], int]:
    """Evaluates each (step, checkpoint) of a run (`find_checkpoints`, or any source the callable
    reads: scripts/evaluate.py also passes Orbax steps); returns ([(step, result)], peak step by
    average pass@1). Ties go to the earliest step (the paper's "steps to peak")."""
    results = [(step, evaluate_checkpoint(step, source)) for step, source in checkpoints]
    if not results:
        raise FileNotFoundError("no checkpoint to evaluate")
    peak = max(results, key=lambda sr: (sr[1].average["pass@1"], -sr[0]))[0]
    return results, peak


def plot_curve(
    results: Sequence[tuple[int, EvalResult]], path: str | os.PathLike, *, title: str = ""
) -> None:
    """pass@1 against step, one line per benchmark plus the average (bold), peak starred."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    steps = [s for s, _ in results]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in results[0][1].per_benchmark:
        ax.plot(
            steps,
            [100 * r.per_benchmark[name]["pass@1"] for _, r in results],
            "o-",
            label=name,
            alpha=0.6,
        )
    avg = [100 * r.average["pass@1"] for _, r in results]
    ax.plot(steps, avg, "k-o", lw=2.5, label="average")
    best = int(np.argmax(avg))
    ax.plot([steps[best]], [avg[best]], "r*", ms=16, label=f"peak: step {steps[best]}")
    ax.set_xlabel("training step")
    ax.set_ylabel("pass@1 (%)")
    ax.set_title(title or "pass@1 vs step")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
