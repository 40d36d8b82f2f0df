"""The benchmarks tell a mistake in their input in one line, as `scripts/` do: a bad flag value or
a file that is not there ends with exactly one stderr line, `FATAL: ...`, and exit code 1 (absl
benchmarks through `infra.user_errors.run`, argparse ones through `bench_harness`)."""

import os
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]


def _fatal_line(script: str, *args: str) -> str:
    """The one stderr line of `benchmarks/<script>` run with `args`, asserted to be all of it."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / script), *args],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    lines = out.stderr.splitlines()
    assert out.returncode == 1 and len(lines) == 1, (out.returncode, lines[-30:])
    assert lines[0].startswith("FATAL: "), lines
    return lines[0]


@pytest.mark.parametrize(
    "script,args,want",
    [
        ("bench_rollout.py", ["--batches=abc"], "flag --batches=abc: invalid literal for int()"),
        ("bench_decode_step.py", ["--prompts=8,x"], "--prompts takes whole numbers"),
        ("rl_step.py", ["--steps=abc"], "argument --steps: invalid int value: 'abc'"),
    ],
)
def test_a_bad_flag_value(script, args, want):
    line = _fatal_line(script, *args)
    assert want in line and "lists the flags" in line, line


def test_a_config_file_that_is_not_there():
    line = _fatal_line("bench_rollout.py", "--config=configs/nope.py")
    assert "config file 'configs/nope.py' not found" in line and "'grpo.py'" in line, line


def test_a_misspelt_override_section_names_the_valid_keys(tmp_path):
    line = _fatal_line("aot_vs_device.py", "--set=batchx.prompts=1", f"--json={tmp_path}/x.json")
    assert "unknown config key 'batchx.prompts'" in line and "'batch'" in line, line
    assert list(tmp_path.iterdir()) == []


def test_a_checkpoint_that_is_not_there(tmp_path):
    line = _fatal_line("bench_serve.py", f"--model={tmp_path}/nope", "--servers=ours")
    assert f"--model={tmp_path}/nope: no checkpoint there" in line, line
