"""What scripts/train.py shows a person (console.py): the run's lines on stdout, library INFO logs
only in <workdir>/train.log, all of them back on the console with --verbosity=0."""

import json
import re
import subprocess
import sys

import pytest

from support import crash_harness, testing


@pytest.fixture(autouse=True, scope="module")
def _xla_cache():
    """XLA's persistent cache for this module's tests and the processes they start."""
    with testing.persistent_xla_cache():
        yield


ABSL_INFO = re.compile(r"^I\d{4} ")  # absl's INFO line prefix, e.g. "I1125 01:23:59.53 ..."


def _bench(tmp_path):
    bench = tmp_path / "bench"
    bench.mkdir()
    rows = [{"id": str(i), "problem": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(2)]
    (bench / "tiny.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {
        "eval.every": 2,
        "eval.data_dir": bench,
        "eval.benchmarks": "('tiny',)",
        "eval.n": 2,
        "eval.max_new_tokens": 8,
        "eval.system_prompt": "",
    }


def test_setup_after_a_basic_config_keeps_library_info_off_the_console(tmp_path):
    """An import that logs through absl before flags are parsed (Orbax does) leaves a
    basicConfig stderr handler; setup after it still keeps INFO to the file."""
    code = (
        "import logging, sys\n"
        "from absl import logging as absl_logging\n"
        "absl_logging.info('before setup')  # absl calls logging.basicConfig() here\n"
        "assert logging.getLogger().handlers, 'absl no longer adds the handler: drop this test'\n"
        "from mmr_jax.infra import console\n"
        f"console.setup({str(tmp_path / 'x.log')!r}, verbose=False)\n"
        "logging.getLogger('orbax').info('library info')\n"
        "absl_logging.info('absl info')\n"
        "console.info('a console line')\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert "library info" not in res.stderr and "absl info" not in res.stderr, res.stderr
    assert "a console line" in res.stdout and "a console line" not in res.stderr
    log = (tmp_path / "x.log").read_text()
    assert "library info" in log and "absl info" in log


@pytest.mark.slow
class TestTrainConsole:
    def test_quiet_by_default_and_verbose_on_request(self, tmp_path, tiny_llama_dir):
        run = tmp_path / "run"
        overrides = {"model.path": tiny_llama_dir, "reweight.method": "mmr", **_bench(tmp_path)}
        env = crash_harness.subprocess_env()

        def train(steps, *flags):
            cmd = crash_harness.train_command(run, "grpo", {**overrides, "total_steps": steps})
            res = subprocess.run([*cmd, *flags], env=env, capture_output=True, text=True)
            assert res.returncode == 0, res.stderr[-3000:]
            return res.stdout.splitlines(), res.stderr.splitlines()

        out, err = train(2)
        # A header and its method line, one line per step, one per checkpoint and evaluation.
        assert len(out) == 7, out
        header = out[0]
        assert "method: reweighting MMR (group scope" in out[1], out[1]
        for part in ("grpo:smoke", f"model {tiny_llama_dir}", "1 cpu device(s)", f"workdir {run}"):
            assert part in header, header
        assert header.endswith("new run")
        steps = [line for line in out if re.search(r" step \d/2 \| reward [-\d.e]+ \|", line)]
        assert len(steps) == 2 and all(
            "lambda" in s and "took" in s and "s/step avg" in s and "ETA" in s for s in steps
        )
        assert sum(
            f"checkpoint step {s} -> {run}/checkpoints/{s}" in x for x in out for s in (1, 2)
        )
        assert [x for x in out if "eval step 2: tiny/pass@1=" in x], out
        assert [x for x in err if ABSL_INFO.match(x) or "orbax" in x.lower()] == [], err[:20]

        log = (run / "train.log").read_text()
        assert "checkpoint_manager.py" in log and "Finished saving checkpoint" in log  # Orbax
        assert all(line.split(" ", 1)[1] in log for line in out)  # the console lines too

        out, err = train(3, "--verbosity=0")
        # Header, method line, step 3, its evaluation (the last step's) and checkpoint.
        assert out[0].endswith("resuming from step 2") and len(out) == 5, out
        assert any(ABSL_INFO.match(x) and "checkpoint_manager.py" in x for x in err), err[:20]
        assert not any("step 3/3 |" in x for x in err)  # not twice on the console
