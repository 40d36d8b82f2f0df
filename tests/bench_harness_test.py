"""`infra/bench_harness.py`: timing, child processes, JSON and tables shared by benchmarks/."""

import itertools
import json
import sys

import pytest
from absl import flags

from mmr_jax.infra import bench_harness as harness


def test_timed_keeps_the_first_call_apart_and_drops_warmups():
    ticks = itertools.count()
    durations = iter([50.0, 9.0, 3.0, 1.0, 2.0])  # first, one warm-up, three timed
    now = [0.0]

    def clock():
        next(ticks)
        return now[0]

    def fn():
        now[0] += next(durations)

    t = harness.timed(fn, steps=3, warmup=1, clock=clock)
    assert t.first_s == 50.0 and t.steps_s == (3.0, 1.0, 2.0)
    assert (t.median_s, t.min_s) == (2.0, 1.0)
    assert t.as_dict()["median_s"] == 2.0
    with pytest.raises(ValueError, match="steps must be >= 1"):
        harness.timed(fn, steps=0)


def test_child_result_error_and_timeout():
    ok = "import json; print('noise'); print('RESULT ' + json.dumps({'a': 1}))"
    assert harness.run_child([sys.executable, "-c", ok]) == {"a": 1}
    bad = "import sys; print('RESULT {}'); print('boom', file=sys.stderr); sys.exit(3)"
    r = harness.run_child([sys.executable, "-c", bad], echo_stderr=False)
    assert r == {"error": "exit status 3", "stderr_tail": "boom"}
    silent = "print('no result here')"
    assert harness.run_child([sys.executable, "-c", silent])["error"] == "no RESULT line"
    slow = "import sys, time; print('started', file=sys.stderr, flush=True); time.sleep(60)"
    r = harness.run_child([sys.executable, "-c", slow], timeout_s=3, echo_stderr=False)
    assert r["error"] == "timed out after 3 s" and r["stderr_tail"] == "started"


def test_parse_result_takes_the_last_line():
    assert harness.parse_result('RESULT {"a": 1}\nx\nRESULT {"a": 2}\n') == {"a": 2}
    assert harness.parse_result("nothing") is None


def test_write_json_whole_file_or_none(tmp_path):
    path = tmp_path / "sub" / "out.json"
    harness.write_json(path, {"rows": [1, 2]})
    assert json.loads(path.read_text()) == {"rows": [1, 2]}
    assert list(path.parent.iterdir()) == [path]  # no temporary left behind
    harness.write_json(None, {"ignored": True})  # no path: nothing written, no error


def test_format_table_aligns_and_shows_errors():
    cols = (("name", "name", ""), ("s", "step s", ".2f"), ("n", "n", "d"))
    text = harness.format_table(
        [{"name": "a", "s": 1.234, "n": 7}, {"name": "bb", "s": None}], cols
    )
    assert text.splitlines() == ["name  step s  n", "a       1.23  7", "bb         -  -"]
    text = harness.format_table([{"name": "c", "error": "timed out"}], cols)
    assert text.splitlines()[1] == "c     FAILED: timed out"


def test_load_unregisters_the_benchmark_s_flags():
    before = set(flags.FLAGS)
    module = harness.load("bench_gpu")
    assert callable(module.train_flops) and set(flags.FLAGS) == before
    harness.load("bench_gpu")  # a second load defines the same flags again without an error
    with pytest.raises(FileNotFoundError, match="no benchmark"):
        harness.load("bench_nothing")
