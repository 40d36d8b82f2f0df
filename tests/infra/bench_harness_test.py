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
    assert callable(module.run_config) and set(flags.FLAGS) == before
    harness.load("bench_gpu")  # a second load defines the same flags again without an error
    with pytest.raises(FileNotFoundError, match="no benchmark"):
        harness.load("bench_nothing")


def _fake_clock(durations):
    """(clock, fn): each fn() call advances the clock by the next of `durations`."""
    durations, now = iter(durations), [0.0]
    return (lambda: now[0]), (lambda: now.__setitem__(0, now[0] + next(durations)))


def test_best_of_skips_the_first_call_and_repeats_until_enough():
    clock, fn = _fake_clock([100.0, 3.0, 1.0, 2.0, 5.0])
    assert harness.best_of(fn, min_total=0.0, min_reps=3, clock=clock) == (1.0, 2.0)
    clock, fn = _fake_clock([100.0] + [0.1] * 50)  # min_total: more than min_reps short calls
    best, median = harness.best_of(fn, min_total=1.0, min_reps=2, clock=clock)
    assert (best, median) == pytest.approx((0.1, 0.1))


def test_alternate_reverses_the_order_each_round_and_drops_the_first():
    calls, now = [], [0.0]

    def fn(name, seconds):
        def call():
            calls.append(name)
            now[0] += seconds

        return call

    medians = harness.alternate([fn("a", 1.0), fn("b", 3.0)], steps=3, clock=lambda: now[0])
    assert calls == ["a", "b", "b", "a", "a", "b", "b", "a"]
    assert medians == [1.0, 3.0]


def test_step_summary_after_warmup():
    assert harness.step_summary([9.0, 3.0, 1.0, 2.0], warmup=1) == {
        "steps_timed": 3,
        "median_s": 2.0,
        "min_s": 1.0,
        "max_s": 3.0,
    }
    with pytest.raises(ValueError, match="nothing timed"):
        harness.step_summary([1.0], warmup=1)


def test_parse_args_types_from_defaults():
    flags_ = {"steps": (5, "n"), "quick": (False, "switch"), "path": (None, "p"),
              "mode": ("off", "m", ("off", "warm"))}  # fmt: skip
    args, _ = harness.parse_args("doc", flags_, ["--steps=7", "--quick", "--mode=warm"])
    assert (args.steps, args.quick, args.path, args.mode, args.json) == (
        7,
        True,
        None,
        "warm",
        None,
    )
    with pytest.raises(SystemExit):
        harness.parse_args("doc", flags_, ["--mode=hot"])


class TestUserErrors:
    """A benchmark fed a bad flag or a missing file ends in one `FATAL:` line, exit code 1."""

    @pytest.mark.parametrize(
        "argv,want",
        [
            (["--steps=abc"], "FATAL: argument --steps: invalid int value: 'abc'. "),
            (["--mode=hot"], "FATAL: argument --mode: invalid choice: 'hot'"),
            (["--stpes=3"], "FATAL: unrecognized arguments: --stpes=3. "),
        ],
    )
    def test_a_bad_flag_is_one_line(self, argv, want, capsys):
        flags_ = {"steps": (5, "n"), "mode": ("off", "m", ("off", "warm"))}
        with pytest.raises(SystemExit) as exit_:
            harness.parse_args("doc", flags_, argv)
        line = exit_.value.code  # sys.exit(str): Python prints it to stderr, exit code 1
        assert isinstance(line, str) and "\n" not in line, line
        assert line.startswith(want) and line.endswith("--help lists the flags"), line
        assert capsys.readouterr().err == ""  # no usage text

    def test_run_tells_a_user_error_in_one_line_and_keeps_a_bugs_traceback(self):
        from mmr_jax.config import command_line

        def missing_config():
            command_line.load_config_file("configs/nope.py")

        with pytest.raises(SystemExit) as exit_:
            harness.run(missing_config)
        assert exit_.value.code.startswith("FATAL: config file 'configs/nope.py' not found")

        def bug():
            raise ZeroDivisionError("a bug")

        with pytest.raises(ZeroDivisionError):
            harness.run(bug)

    def test_counts_flag_refuses_what_is_not_a_whole_number(self):
        values = flags.FlagValues()
        flags.DEFINE_list("prompts", ["8"], "prompt counts", flag_values=values)
        harness.counts_flag("prompts", flag_values=values)
        values(["bench", "--prompts=8,32"])
        assert values.prompts == ["8", "32"]
        with pytest.raises(flags.IllegalFlagValueError, match="takes whole numbers"):
            values(["bench", "--prompts=8,x"])


def test_parse_args_list_default_is_a_repeatable_flag():
    flags_ = {"set": ([], "key=value")}
    args, _ = harness.parse_args("doc", flags_, ["--set=a=1", "--set", "b=2"])
    assert args.set == ["a=1", "b=2"]
    assert harness.parse_args("doc", flags_, [])[0].set == [] == flags_["set"][0]
