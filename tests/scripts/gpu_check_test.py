"""`scripts/gpu_check.sh` (issue 45): its two device runs fit their 5 minutes, and its CPU smoke
runs every step of both at tiny shapes, so a broken import or flag shows here, before GPU time
is spent on it."""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "gpu_check.sh"
RUN_A = ("aot_vs_device", "gpu_tests", "peer_1024", "decode")
RUN_B = ("rl_step", "peer_3584", "lora_7b")
CALL_S, TOTAL_S = 300, 285  # the device call's timeout_s and the script's budget of it


def _device_limits() -> dict[str, object]:
    """The device branch's `L_*=...` and `TIMEOUTS_*=...` assignments (the line after `else`)."""
    text = SCRIPT.read_text()
    branch = text[text.index("  PEER=(--config=configs/grpo.py:1.5b") :]
    out: dict[str, object] = {}
    for line in branch.splitlines()[:10]:
        for key, value in re.findall(r'(L_\w+|TIMEOUTS_\w)=("[^"]*"|\S+)', line):
            value = value.strip('"')
            out[key] = (
                int(value) if value.isdigit() else dict(x.split("=") for x in value.split(","))
            )
    return out


def test_device_runs_fit_their_five_minutes_with_slack():
    limits = _device_limits()
    assert f'TOTAL_S="${{TOTAL_S:-{TOTAL_S}}}"' in SCRIPT.read_text()  # the device branch's
    run_a = limits["L_AOT"] + limits["L_TESTS"] + limits["L_PEER"] + limits["L_DECODE"]
    run_b = limits["L_RL"] + limits["L_PEER2"]  # lora_7b gets what these leave
    assert run_a <= TOTAL_S - 15 and run_b <= TOTAL_S - 15, limits  # the wheels' install
    # the peer's sides (and their process starts) fit its step's limit
    for peer, sides in (("L_PEER", "TIMEOUTS_A"), ("L_PEER2", "TIMEOUTS_B")):
        assert sum(float(s) for s in limits[sides].values()) <= limits[peer] - 10, limits
    assert TOTAL_S <= CALL_S - 10
    # the documented device commands are these runs at this timeout
    for run in "AB":
        assert f"bash scripts/gpu_check.sh --run={run}    # limit {CALL_S} s" in SCRIPT.read_text()


def test_fetch_wheels_names_only_what_the_image_lacks():
    text = SCRIPT.read_text()
    block = text[text.index("--fetch_wheels)") : text.index(";;", text.index("--fetch_wheels)"))]
    pins = re.findall(r"([A-Za-z0-9_.-]+)==", block)
    assert sorted(pins) == [
        "antlr4-python3-runtime",
        "latex2sympy2_extended",
        "math-verify",
        "ml_collections",
    ]


def test_no_run_chosen_is_an_error():
    proc = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, env=os.environ)
    assert proc.returncode == 2 and "--run=A" in proc.stderr


@pytest.mark.slow
def test_cpu_smoke_runs_every_step(tmp_path):
    """Both runs' steps at tiny shapes on CPU: each ends ok and leaves its JSON; the summary
    names every step, the versions and no GPU; the GPU tests are collected under -m gpu."""
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable}
    proc = subprocess.run(
        ["bash", str(SCRIPT), "--cpu_smoke"],
        capture_output=True,
        text=True,
        env=env,
        timeout=1200,
        cwd=REPO,
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["cpu_smoke"] is True and summary["runs"] == "AB"
    assert set(summary) >= {"gpu", "versions", "steps", "seconds"}
    assert summary["versions"]["jax"] and summary["versions"]["ml_collections"]
    assert list(summary["steps"]) == [*RUN_A, *RUN_B], summary
    for name, s in summary["steps"].items():
        assert s["status"] == "ok", (name, s, log[-4000:])
    for name in ("aot_vs_device",) + RUN_A[2:] + RUN_B:
        assert summary["steps"][name]["json"] == f"{name}.json"
    # what comes back from each run's call: at most 8 files
    files = {p.name for p in out.iterdir()}
    shared = {"gpu_check.log", "summary.json"}
    run_a = shared | {f"{n}.json" for n in RUN_A[:1] + RUN_A[2:]} | {"profile.json"}
    run_b = shared | {f"{n}.json" for n in RUN_B}
    assert files == run_a | run_b and len(run_a) <= 8 and len(run_b) <= 8, files
    # the deviceless comparison's path: here the CPU side only (no GPU, no spec to compare)
    aot = json.loads((out / "aot_vs_device.json").read_text())["rows"]
    assert [r["program"] for r in aot] == ["train", "decode"], aot
    assert all("error" not in r and r["peak"] > 0 for r in aot), aot
    # the cuDNN parity tests at our shapes are collected under -m gpu (the marker's placement)
    assert "CudnnAtOurShapesTest::test_equals_xla_cudnn_packed" in log
    assert "test_equals_xla_cudnn_maskfree_completions" in log
    peer = json.loads((out / "peer_1024.json").read_text())
    assert set(peer["sides"]) == {"torch", "ours"} and "profile" in peer["sides"]["ours"]
    assert all("error" not in r for r in peer["sides"].values()), peer["sides"]
    assert json.loads((out / "decode.json").read_text())[0]["decode"]["step_s"] > 0
    rl = json.loads((out / "rl_step.json").read_text())
    assert rl["exit"] == 0 and rl["summary"]["time/step"] > 0 and rl["summary"]["time/train"] > 0
    assert json.loads((out / "lora_7b.json").read_text())[0]["train"]["step_s"] > 0
    assert (out / "profile.json").exists()
