"""Tests for mmr_jax.problems.data_sources and scripts/prepare_data.py.

No hub here: each converter gets `datasets.Dataset` rows in its hub dataset's schema, rebuilt from
the offline folder's records, and must give back exactly those records (and file bytes).
"""

import json
import os
import subprocess
import sys

import datasets
import pytest

from mmr_jax.problems import data, data_sources

from support import testing


def _hub_math500(r):
    keys = ("problem", "solution", "answer", "subject", "level", "unique_id")
    return {k: r[k] for k in keys}


def _hub_aime24(r):
    return {k: r[k] for k in ("id", "problem", "solution", "answer", "url")} | {"year": "2024"}


def _hub_amc23(r):
    return {"id": r["id"], "problem": r["problem"], "answer": r["answer_raw"], "url": r["url"],
            "question": r["problem"]}  # fmt: skip


def _hub_minerva(r):
    meta = {"dataset": "minerva", "difficulty": "", "original_solution": r["solution"],
            "type": r["type"]}  # fmt: skip
    return {"question": r["problem"], "answer": r["answer"], "metadata": meta}


def _hub_olympiad(r):
    keys = ("id", "solution", "final_answer", "context", "is_multiple_answer", "unit",
            "answer_type", "error", "subfield")  # fmt: skip
    return {k: r[k] for k in keys} | {
        "question": r["problem"], "modality": "Text-only", "difficulty": "Competition",
        "question_type": "Open-ended", "subject": "Math", "language": "English",
    }  # fmt: skip


def _hub_gsm8k(r):
    return {"question": r["problem"], "answer": r["solution"] + "\n#### " + r["answer_raw"]}


HUB_ROWS = {
    "eval/math500.jsonl": _hub_math500,
    "eval/aime24.jsonl": _hub_aime24,
    "eval/amc23.jsonl": _hub_amc23,
    "eval/minerva_math.jsonl": _hub_minerva,
    "eval/olympiadbench.jsonl": _hub_olympiad,
    "train/gsm8k_train.jsonl": _hub_gsm8k,
}


def _lines(path):
    text = path.read_text(encoding="utf-8")
    assert text.endswith("\n")
    return text[:-1].split("\n")  # not splitlines: GSM8K text holds U+2028


class TestBuild:
    def test_every_hub_file_has_a_test(self):
        assert set(HUB_ROWS) == set(data_sources.SOURCES)

    @pytest.mark.parametrize("path", sorted(HUB_ROWS))
    def test_hub_schema_rows_give_the_offline_records(self, path, tmp_path):
        root = testing.require_shared_data(path)
        lines = _lines(root / path)
        shared = [json.loads(line) for line in lines]
        rows = datasets.Dataset.from_list([HUB_ROWS[path](r) for r in shared])
        records = data_sources.build(path, rows)
        for i, (got, want) in enumerate(zip(records, shared, strict=True)):
            assert list(got) == list(want), i  # same fields, same order
            for k in want:
                assert got[k] == want[k] and type(got[k]) is type(want[k]), (i, k)
        data_sources.write_jsonl(records, tmp_path / path)
        assert (tmp_path / path).read_bytes() == (root / path).read_bytes()
        assert [p.name for p in (tmp_path / path).parent.iterdir()] == [path.split("/")[1]]

    def test_gsm8k_row_by_hand(self):
        row = {"question": "How many?", "answer": "Add: <<1000+234=1234>>1234.\n#### 1,234"}
        assert data_sources.gsm8k(row, 7) == {
            "id": "gsm8k_train_7", "problem": "How many?", "answer": "1234",
            "solution": "Add: <<1000+234=1234>>1234.", "answer_raw": "1,234",
        }  # fmt: skip
        with pytest.raises(data_sources.SourceMismatchError, match="row 3: answer has no single"):
            data_sources.gsm8k({"question": "q", "answer": "no marker"}, 3)

    def test_olympiad_multiple_answer_and_amc_negative(self):
        row = {"id": 5, "question": "q", "final_answer": ["$69$,$84$"]}
        assert data_sources.olympiadbench(row, 0)["answer"] == "69$,$84"
        amc = {"id": 1, "problem": "p", "answer": -2.0, "url": "u"}
        assert data_sources.amc23(amc, 0)["answer"] == "-2"

    def test_wrong_count_and_missing_field(self):
        rows = [{"question": "q", "answer": "s\n#### 1"}]
        with pytest.raises(data_sources.SourceMismatchError, match="1 rows .* has 7473"):
            data_sources.build("train/gsm8k_train.jsonl", rows)
        with pytest.raises(data_sources.SourceMismatchError, match="row 0: no field 'url'"):
            data_sources.aime24({"id": 60, "problem": "p", "answer": "1", "solution": "s"}, 0)


class TestHelpers:
    @pytest.mark.parametrize(
        "text,expected",
        [("so \\boxed{4}", "4"), ("\\boxed{1} then \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
         ("\\boxed{\\{1,2\\}}", "\\{1,2\\}"), ("no box", None), ("\\boxed{open", None),
         ("\\boxed{a}{b}", "a")],
    )  # fmt: skip
    def test_last_boxed(self, text, expected):
        assert data_sources.last_boxed(text) == expected

    @pytest.mark.parametrize("x,text", [(27.0, "27"), (-3.0, "-3"), (2.5, "2.5"), (7, "7")])
    def test_number_text(self, x, text):
        assert data_sources.number_text(x) == text

    def test_write_jsonl_replaces_atomically(self, tmp_path):
        path = tmp_path / "a" / "f.jsonl"
        data_sources.write_jsonl([{"id": 1, "problem": "é"}], path)
        data_sources.write_jsonl([{"id": 2, "problem": "x"}], path)
        assert path.read_text(encoding="utf-8") == '{"id": 2, "problem": "x"}\n'
        assert [p.name for p in path.parent.iterdir()] == ["f.jsonl"]


def _prepare(*args, env=None):
    cmd = [sys.executable, str(testing.REPO / "scripts" / "prepare_data.py"), *args]
    env = dict(os.environ, **(env or {}))
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)


class TestPrepareDataScript:
    def test_from_dir_copies_checked_files(self, tmp_path):
        root = testing.require_shared_data("eval/aime24.jsonl", "eval/amc23.jsonl")
        files = "eval/aime24.jsonl,eval/amc23.jsonl"
        proc = _prepare(f"--from_dir={root}", f"--out={tmp_path}", f"--files={files}")
        assert proc.returncode == 0, proc.stderr[-2000:]
        for i, f in enumerate(files.split(","), 1):
            assert (tmp_path / f).read_bytes() == (root / f).read_bytes()
            assert f"[{i}/2] {tmp_path / f}: " in proc.stdout
        assert "30 records" in proc.stdout and "40 records" in proc.stdout

    def test_from_dir_refuses_missing_and_short_files(self, tmp_path):
        src = tmp_path / "src"
        proc = _prepare(f"--from_dir={src}", f"--out={tmp_path / 'out'}")
        assert proc.returncode != 0
        assert proc.stderr.startswith("FATAL: problem file: ") and f"{src / 'eval'}" in proc.stderr
        assert len(proc.stderr.splitlines()) == 1, proc.stderr
        data_sources.write_jsonl(
            [{"id": 1, "problem": "p", "answer": "1"}], src / "eval/amc23.jsonl"
        )
        proc = _prepare(
            f"--from_dir={src}", f"--out={tmp_path / 'out'}", "--files=eval/amc23.jsonl"
        )
        want = f"FATAL: {src}/eval/amc23.jsonl: 1 records, expected 40"
        assert proc.stderr.splitlines() == [want], proc.stderr
        assert not (tmp_path / "out").exists()

    def test_no_hub_says_so(self, tmp_path):
        hf = str(tmp_path / "hf")  # an empty cache: nothing to fall back on
        env = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": hf,
               "HF_DATASETS_CACHE": hf}  # fmt: skip
        proc = _prepare(f"--out={tmp_path}", "--files=eval/aime24.jsonl", env=env)
        assert proc.returncode == 1, proc.stderr[-2000:]
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1, lines
        assert lines[0].startswith("FATAL: Couldn't reach 'HuggingFaceH4/aime_2024'")
        assert lines[0].endswith("--from_dir=<folder>") and not (tmp_path / "eval").exists()

    def test_unknown_file(self, tmp_path):
        proc = _prepare(f"--out={tmp_path}", "--files=eval/nope.jsonl")
        assert proc.returncode != 0 and "unknown files ['eval/nope.jsonl']" in proc.stderr


def test_check_folder_counts(tmp_path):
    root = testing.require_shared_data("eval/math500.jsonl")
    assert data_sources.check_folder(root, ["eval/math500.jsonl"]) == {"eval/math500.jsonl": 500}
    with pytest.raises(data.DataNotFoundError, match="prepare_data.py"):
        data_sources.check_folder(tmp_path, ["eval/math500.jsonl"])
