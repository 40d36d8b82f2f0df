"""Public Hugging Face datasets -> the data folder's JSONL files (docs/data.md).

`SOURCES` names, for each file that can be built from the hub, the dataset (repo id, config,
split), the number of records the offline folder has, and the pure function that turns one hub
row into one record (the field mapping of the offline folder's README). `build` applies it;
`load_hub_rows`, `write_jsonl` and `check_folder` are the only functions that touch the hub or
files. Records are written as `json.dumps(record, ensure_ascii=False)` lines, the offline files'
own form, so a converted file can be compared with them byte for byte.

    rows = data_sources.load_hub_rows(data_sources.SOURCES["eval/math500.jsonl"])
    data_sources.write_jsonl(data_sources.build("eval/math500.jsonl", rows), out / "eval/...")
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import shutil
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from mmr_jax.infra import user_errors
from mmr_jax.problems import data

# Files of the offline folder that no public hub dataset reproduces (docs/data.md says why).
OFFLINE_ONLY = {
    "train/math_train.jsonl": 7470,
    "train/math_test4500.jsonl": 4499,
    "train/aime_1983_2023.jsonl": 968,
}


class SourceMismatchError(user_errors.UserError, ValueError):
    """A hub dataset or a folder's file does not have the rows or fields the data folder needs."""


@dataclasses.dataclass(frozen=True)
class Source:
    """Where one data-folder file comes from on the hub, and how a row becomes a record."""

    path: str  # relative to the data folder, e.g. 'eval/math500.jsonl'
    hub: str  # dataset repo id on the Hugging Face hub
    config: str | None  # dataset config name (None: the default one)
    split: str
    rows: int  # records in the offline folder's file
    convert: Callable[[dict[str, Any], int], dict[str, Any]]  # (hub row, row index) -> record


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` in `text` (balanced braces), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i = start + len("\\boxed{")
    depth, begin = 1, i
    while i < len(text):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[begin:i]
        i += 1
    return None


def number_text(x: float | int) -> str:
    """A numeric answer as text: integral floats lose '.0' (27.0 -> '27'), others keep repr."""
    x = float(x)
    return str(int(x)) if x.is_integer() else repr(x)


def _need(row: dict, name: str, index: int) -> Any:
    if row.get(name) is None:
        raise SourceMismatchError(f"row {index}: no field {name!r} (has {sorted(row)})")
    return row[name]


def math500(row: dict, index: int) -> dict:
    """HuggingFaceH4/MATH-500: fields unchanged, `level` -> int, `id` = `unique_id`."""
    keys = ("problem", "answer", "solution", "subject")
    out = {"id": _need(row, "unique_id", index)} | {k: _need(row, k, index) for k in keys}
    return out | {"level": int(_need(row, "level", index)), "unique_id": row["unique_id"]}


def aime24(row: dict, index: int) -> dict:
    """HuggingFaceH4/aime_2024: `id` (60-89), problem, answer, solution, url; `year` dropped."""
    keys = ("id", "problem", "answer", "solution", "url")
    out = {k: _need(row, k, index) for k in keys}
    return out | {"answer": str(out["answer"])}


def amc23(row: dict, index: int) -> dict:
    """AMC 2023 (Qwen2.5-Math's file): float answer -> text, kept as `answer_raw`."""
    raw = _need(row, "answer", index)
    return {
        "id": _need(row, "id", index),
        "problem": _need(row, "problem", index),
        "answer": number_text(raw),
        "answer_raw": float(raw),
        "url": _need(row, "url", index),
    }


def minerva_math(row: dict, index: int) -> dict:
    """Minerva OCW: `answer` = last `\\boxed{}` of the solution; `idx` = `id` = row index.

    Hub rows: `question` and `metadata` {`original_solution`, `type`}."""
    meta = _need(row, "metadata", index)
    solution = _need(meta, "original_solution", index)
    answer = last_boxed(solution)
    if answer is None:
        raise SourceMismatchError(f"row {index}: no \\boxed{{}} in the solution")
    return {
        "id": index,
        "problem": _need(row, "question", index),
        "answer": answer,
        "solution": solution,
        "type": _need(meta, "type", index),
        "idx": index,
    }


def olympiadbench(row: dict, index: int) -> dict:
    """OlympiadBench OE_TO_maths_en_COMP: `answer` = final_answer[0].strip('$')."""
    final = _need(row, "final_answer", index)
    out = {
        "id": _need(row, "id", index),
        "problem": _need(row, "question", index),
        "answer": final[0].strip("$"),
    }
    kept = ("final_answer", "solution", "answer_type", "unit", "is_multiple_answer", "subfield")
    return out | {k: row.get(k) for k in (*kept, "context", "error")}


def gsm8k(row: dict, index: int) -> dict:
    """openai/gsm8k: `answer` 'steps #### 1,234' -> solution, answer '1234', answer_raw."""
    text = _need(row, "answer", index)
    if text.count("####") != 1:
        raise SourceMismatchError(f"row {index}: answer has no single '####': {text[-60:]!r}")
    solution, raw = (part.strip() for part in text.split("####"))
    return {
        "id": f"gsm8k_train_{index}",
        "problem": _need(row, "question", index),
        "answer": raw.replace(",", ""),
        "solution": solution,
        "answer_raw": raw,
    }


SOURCES = {
    s.path: s
    for s in (
        Source("eval/math500.jsonl", "HuggingFaceH4/MATH-500", None, "test", 500, math500),
        Source("eval/aime24.jsonl", "HuggingFaceH4/aime_2024", None, "train", 30, aime24),
        Source("eval/amc23.jsonl", "FlippyDora/amc23", None, "train", 40, amc23),
        Source(
            "eval/minerva_math.jsonl",
            "test-time-compute/test_minerva_math",
            None,
            "test",
            272,
            minerva_math,
        ),
        Source(
            "eval/olympiadbench.jsonl",
            "Hothan/OlympiadBench",
            "OE_TO_maths_en_COMP",
            "train",
            675,
            olympiadbench,
        ),
        Source("train/gsm8k_train.jsonl", "openai/gsm8k", "main", "train", 7473, gsm8k),
    )
}


def build(path: str, rows: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records of data-folder file `path` from its hub rows (`SOURCES[path].convert`).

    Raises SourceMismatchError when the count differs from the offline folder's."""
    source = SOURCES[path]
    records = [source.convert(dict(row), i) for i, row in enumerate(rows)]
    if len(records) != source.rows:
        raise SourceMismatchError(
            f"{source.hub}: {len(records)} rows for {path}, the data folder has {source.rows}"
        )
    return records


def load_hub_rows(source: Source):
    """The hub dataset of `source` through `datasets.load_dataset` (downloads; needs the hub)."""
    import datasets

    return datasets.load_dataset(source.hub, source.config, split=source.split)


def write_jsonl(records: Sequence[dict[str, Any]], path: str | os.PathLike) -> None:
    """Writes one JSON line per record, atomically (a temporary file, then a rename)."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w", encoding="utf-8", newline="\n") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


def expected_rows() -> dict[str, int]:
    """Every file of the data folder -> its number of records."""
    return {p: s.rows for p, s in SOURCES.items()} | OFFLINE_ONLY


def check_folder(folder: str | os.PathLike, paths: Sequence[str]) -> dict[str, int]:
    """Checks files of an offline data folder: each loads as problems with the expected count.

    Returns {path: records}; raises data.DataNotFoundError for a missing file and
    SourceMismatchError for a wrong count (malformed rows raise ValueError from `load_problems`).
    """
    counts = {}
    for p in paths:
        problems = data.load_problems(pathlib.Path(folder) / p)
        if len(problems) != expected_rows()[p]:
            raise SourceMismatchError(
                f"{folder}/{p}: {len(problems)} records, expected {expected_rows()[p]}"
            )
        counts[p] = len(problems)
    return counts


def copy_file(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """Copies `src` to `dst` atomically (a temporary file beside `dst`, then a rename)."""
    dst = pathlib.Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(f".{dst.name}.tmp{os.getpid()}")
    shutil.copyfile(src, tmp)
    os.replace(tmp, dst)
