"""scripts/filter_prompts.py end to end on a tiny random checkpoint and three problems."""

import json
import pathlib
import subprocess
import sys

import pytest

from support import testing

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _run(tmp_path, ckpt, source, out, *extra):
    cmd = [
        sys.executable, str(ROOT / "scripts" / "filter_prompts.py"),
        f"--checkpoint={ckpt}", f"--source={source}", f"--out={out}",
        "--n=2", "--max_new_tokens=4", *extra,
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.slow
def test_counts_every_problem_and_keeps_those_in_the_band(tmp_path):
    ckpt = testing.make_tiny_checkpoint(tmp_path / "ckpt")
    source = tmp_path / "train.jsonl"
    problems = [
        {"id": f"p{i}", "problem": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(3)
    ]
    source.write_text("".join(json.dumps(p) + "\n" for p in problems))
    out = tmp_path / "kept.jsonl"
    _run(tmp_path, ckpt, source, out, "--low=0", "--high=2")  # the whole band: every problem
    counts = json.loads((tmp_path / "kept.jsonl.pass_counts.json").read_text())
    assert counts["n"] == 2
    assert sorted(counts["counts"]) == ["p0", "p1", "p2"]
    assert all(0 <= c <= 2 for c in counts["counts"].values())
    kept = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in kept] == ["p0", "p1", "p2"]  # source order, all fields carried
    assert [(r["problem"], r["answer"]) for r in kept] == [
        (p["problem"], p["answer"]) for p in problems
    ]
    assert [r["pass_count"] for r in kept] == [counts["counts"][r["id"]] for r in kept]
    # The same samples (seeded), a band that excludes what was seen: nothing is kept but the
    # problems whose count lies in it.
    seen = set(counts["counts"].values())
    empty_band = next(k for k in range(3) if k not in seen) if len(seen) < 3 else None
    if empty_band is not None:
        out2 = tmp_path / "none.jsonl"
        _run(tmp_path, ckpt, source, out2, f"--low={empty_band}", f"--high={empty_band}")
        assert out2.read_text() == ""
