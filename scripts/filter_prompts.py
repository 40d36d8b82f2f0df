"""Keeps the training prompts that the starting policy solves sometimes, but not always.

    python scripts/filter_prompts.py --checkpoint=deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B \\
        --source=../shared/data/train/math_train.jsonl --out=runs/study_v3/train_filtered.jsonl

Samples `--n` completions of every problem of `--source` with the embedded engine (temperature,
top-p and the training system prompt as training samples them), grades them with math-verify, and
writes the problems whose pass count lies in [--low, --high] to `--out` (JSONL: id, problem,
answer, pass_count, n), with every problem's count in `<out>.pass_counts.json`. Prompts that the
policy always or never solves give uniform groups, whose GRPO advantage is zero (study v3's plan,
docs/study_v3/plan.md).
"""

from __future__ import annotations

import json
import os
import pathlib
import sys

from absl import flags

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from mmr_jax.infra import compile_cache, console, run_paths, user_errors
from mmr_jax.problems import data, evaluation
from mmr_jax.studies import design

_CHECKPOINT = flags.DEFINE_string("checkpoint", None, "HF folder or hub id of the start policy.")
_SOURCE = flags.DEFINE_string("source", None, "Training problems (JSONL/parquet or hub name).")
_OUT = flags.DEFINE_string("out", None, "Filtered JSONL to write.")
_N = flags.DEFINE_integer("n", 8, "Samples per problem.")
_LOW = flags.DEFINE_integer("low", 1, "Smallest pass count kept.")
_HIGH = flags.DEFINE_integer("high", 7, "Largest pass count kept.")
_MAX_PROBLEMS = flags.DEFINE_integer("max_problems", 0, "First problems of the source (0 = all).")
_MAX_NEW_TOKENS = flags.DEFINE_integer("max_new_tokens", 1024, "Completion budget per sample.")
_TEMPERATURE = flags.DEFINE_float("temperature", 1.0, "Sampling temperature (training's).")
_TOP_P = flags.DEFINE_float("top_p", 1.0, "Nucleus sampling (training's).")
_SEED = flags.DEFINE_integer("seed", 0, "Sampling seed.")
flags.mark_flags_as_required(["checkpoint", "source", "out"])


def _write_jsonl_atomic(path: pathlib.Path, rows) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    os.replace(tmp, path)


def main(argv):
    del argv
    from mmr_jax.models import hub
    from mmr_jax.rollout import embedded

    out = pathlib.Path(_OUT.value)
    run_paths.check(out.parent if out.is_file() else out, "--out")  # a file there: replaced
    problems = data.load_problems(_SOURCE.value)  # the inputs before anything is written
    if _MAX_PROBLEMS.value:
        problems = problems[: _MAX_PROBLEMS.value]
    path = hub.resolve_checkpoint(_CHECKPOINT.value, "--checkpoint")
    out.parent.mkdir(parents=True, exist_ok=True)
    console.setup(str(out.parent / "filter_prompts.log"))
    compile_cache.enable()
    console.info("sampling %d x %d completions from %s", len(problems), _N.value, path)
    result = evaluation.evaluate(
        embedded.EmbeddedEngine.from_pretrained(path, seed=_SEED.value),
        hub.load_tokenizer(path, "--checkpoint"),
        {"train": problems},
        n=_N.value,
        ks=(1,),
        temperature=_TEMPERATURE.value,
        top_p=_TOP_P.value,
        max_new_tokens=_MAX_NEW_TOKENS.value,
        system_prompt=data.TRAIN_SYSTEM_PROMPT,
        seed=_SEED.value,
    )
    counts = design.pass_counts(result.records)
    keep = set(design.select_by_pass_rate(counts, n=_N.value, low=_LOW.value, high=_HIGH.value))
    rows = [
        {
            "id": p.id,
            "problem": p.problem,
            "answer": p.answer,
            "pass_count": counts[p.id],
            "n": _N.value,
        }
        for p in problems
        if p.id in keep
    ]
    _write_jsonl_atomic(out, rows)
    counts_path = out.with_name(out.name + ".pass_counts.json")
    counts_path.write_text(json.dumps({"n": _N.value, "counts": counts}, indent=1))
    hist = [sum(c == k for c in counts.values()) for k in range(_N.value + 1)]
    console.info(
        "kept %d of %d problems (pass count in [%d, %d]); counts 0..%d: %s; wrote %s",
        len(rows), len(problems), _LOW.value, _HIGH.value, _N.value, hist, out,
    )  # fmt: skip


if __name__ == "__main__":
    user_errors.run(main)
