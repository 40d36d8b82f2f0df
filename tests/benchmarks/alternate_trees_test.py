"""benchmarks/alternate_trees.py: the metric read from a benchmark's JSON, the paired statistics
on hand-worked ratios, and a whole alternation over real `git archive`s of this repo."""

import json
import math

import pytest

from mmr_jax.infra import bench_harness

alt = bench_harness.load("alternate_trees")


def test_pick_follows_the_dotted_path_and_names_what_is_there():
    obj = {"cpu_default": {"packed": {"ms_per_step": 2500}}}
    assert alt.pick(obj, "cpu_default.packed.ms_per_step") == 2500.0
    with pytest.raises(KeyError, match=r"no 'shared' \(there: \['packed'\]\)"):
        alt.pick(obj, "cpu_default.shared.ms_per_step")


def test_summary_of_equal_ratios_is_that_ratio_with_the_smallest_sign_flip_p():
    pairs = [{"old": 2.0, "new": 3.0} for _ in range(4)]
    s = alt.summarize(pairs)
    assert s["n"] == 4
    assert s["ratio"] == pytest.approx(1.5)
    assert s["ratio_low"] == pytest.approx(1.5) and s["ratio_high"] == pytest.approx(1.5)
    assert s["sign_flip_p"] == pytest.approx(2 / 16)  # all-plus and all-minus of 2^4 patterns


def test_summary_by_hand_for_two_opposite_pairs():
    # log ratios +ln 2 and -ln 2: mean 0 (ratio 1), sd = ln 2 * sqrt(2), t_{0.975, 1} = 12.706
    s = alt.summarize([{"old": 1.0, "new": 2.0}, {"old": 2.0, "new": 1.0}])
    assert s["ratio"] == pytest.approx(1.0)
    half = 12.7062047 * math.log(2) * math.sqrt(2) / math.sqrt(2)
    assert s["ratio_low"] == pytest.approx(math.exp(-half), rel=1e-6)
    assert s["ratio_high"] == pytest.approx(math.exp(half), rel=1e-6)
    assert s["sign_flip_p"] == 1.0  # every pattern's |mean| >= 0


def test_a_whole_alternation_over_two_archives_of_this_repo(tmp_path, capsys):
    # Each side runs in its own archive of HEAD; the command writes a number chosen by side.
    write = (
        "import sys, json, pathlib; "
        "pathlib.Path(sys.argv[-1][7:]).write_text(json.dumps({{'a': {{'b': {}}}}}))"
    )
    out = tmp_path / "out.json"
    alt.main([
        "--old=HEAD", "--new=HEAD", "--pairs=3", "--metric=a.b", f"--json={out}",
        f'--old_cmd=-c "{write.format(4)}"', f'--new_cmd=-c "{write.format(5)}"',
    ])  # fmt: skip
    result = json.loads(out.read_text())
    assert [p["ratio"] for p in result["pairs"]] == [1.25] * 3
    assert result["summary"]["ratio"] == pytest.approx(1.25)
    assert result["summary"]["sign_flip_p"] == pytest.approx(2 / 8)
    assert "new / old 1.2500" in capsys.readouterr().out


def test_a_failing_run_is_reported_with_its_output():
    with pytest.raises(RuntimeError, match="boom"):
        alt.main([
            "--old=HEAD", "--pairs=2", "--metric=a",
            "--old_cmd=-c \"raise SystemExit('boom')\"",
        ])  # fmt: skip
