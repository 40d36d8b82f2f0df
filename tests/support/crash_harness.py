"""Crash-anywhere resume harness: run scripts/train.py, SIGKILL it, resume with the same command.

A chain is a list of `Kill`s run one after another on the same workdir, then one run without a
kill; each kill is either a crash point inside the process (`faults`, `MMR_JAX_KILL_AT`) or a
SIGKILL sent from outside at a seeded random moment. `differences` then compares the workdir with
an uninterrupted run of the same config: checkpointed state (parameters, optimiser state, RNG,
step), data position, per-step metrics and HF exports.

The runs' config file is `crash_harness_config.py`: a variant's smoke config on arithmetic
problems with a reward a tiny random model gets varied values of (the share of digits it writes,
`DIGIT_REWARD`), so every step has advantages and moves the weights.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import re
import signal
import subprocess
import sys
import threading
import time

import numpy as np

REPO = pathlib.Path(__file__).resolve().parents[2]
_PROGRESS = re.compile(r" step (\d+)/(\d+) \|")
# Metrics that measure the machine, not the run: they differ between any two runs.
TIMING_PREFIXES = ("time/", "throughput/tokens_per_s")


DIGIT_REWARD = "harness_digits"


def register_digit_reward() -> None:
    """Registers `DIGIT_REWARD`: the share of digit characters in each completion."""
    from mmr_jax import rewards

    if DIGIT_REWARD in rewards.REGISTRY:
        return

    @rewards.register(DIGIT_REWARD)
    def _digits(completions, answers, *, lengths=None):
        del answers, lengths
        return np.array([sum(c.isdigit() for c in t) / max(len(t), 1) for t in completions], "f4")


@dataclasses.dataclass(frozen=True)
class Kill:
    """One interrupted run: `hook` ('phase:step', see `faults`), or a SIGKILL from outside.

    The outside kill comes `fraction` of a step's time after the console shows step
    `after_step` (or the next one, when this process has not yet timed a step) done, or
    `fraction` of a second after the header when the run resumes past `after_step`. A step's
    time is that of the last step shown: when another step shows before the kill (the step
    timed was slower, e.g. it compiled), the kill is aimed again from that step."""

    hook: str | None = None
    after_step: int = 0
    fraction: float = 0.0


@dataclasses.dataclass
class Outcome:
    kill: Kill | None
    returncode: int
    killed: bool  # the process died of SIGKILL
    last_step_line: int  # last step whose progress line was printed (0: none)
    output: str


def train_command(workdir, algorithm: str, overrides: dict) -> list[str]:
    """`python scripts/train.py --config=crash_harness_config.py:<algorithm> --workdir=...
    --config.k=v ...`."""
    cmd = [
        sys.executable,
        str(REPO / "scripts" / "train.py"),
        f"--config={pathlib.Path(__file__).resolve().with_name('crash_harness_config.py')}:{algorithm}",
        f"--workdir={workdir}",
    ]
    return cmd + [f"--config.{k}={v}" for k, v in overrides.items()]


def subprocess_env(extra: dict | None = None) -> dict:
    """The environment of the runs: CPU JAX, every compile cached, the package importable."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", **(extra or {}))
    env.pop("MMR_JAX_KILL_AT", None)
    env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(REPO / "tests"), env.get("PYTHONPATH", "")])
    return env


def random_kills(rng: np.random.Generator, n: int, total_steps: int) -> list[Kill]:
    """`n` kills at seeded random moments: within a step after a random step (or after the
    header, when the run resumes past that step), always with two steps or more still to go."""
    return [
        Kill(after_step=int(rng.integers(0, total_steps - 3)), fraction=float(rng.uniform()))
        for _ in range(n)
    ]


def run_once(cmd, env, kill: Kill | None, timeout: float = 600) -> Outcome:
    """Runs `cmd` to its end, or until `kill` fires."""
    if kill is not None and kill.hook:
        env = dict(env, MMR_JAX_KILL_AT=kill.hook)
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
    )
    # dt: the time between the last two progress lines (None until two were seen).
    lines, seen = [], {"step": 0, "t": None, "dt": None}
    fired = threading.Event()
    timer: list[threading.Timer] = []  # the armed kill

    def reader():
        for line in proc.stdout:
            lines.append(line)
            m, now = _PROGRESS.search(line), time.monotonic()
            if m:
                seen["dt"] = None if seen["t"] is None else now - seen["t"]
                seen["step"], seen["t"] = int(m.group(1)), now
            elif " | workdir " in line:  # the header: the run resumes after this step
                seen["step"] = _resumed(line)
            else:
                continue
            if kill is None or kill.hook or seen["step"] < kill.after_step:
                continue
            if m and seen["dt"] is None:
                continue  # the first step's time is mostly compiling: wait for the next line
            if fired.is_set():
                if not m:
                    continue
                # Another step ended before the kill: the step timed was slower than this one
                # (it compiled, on a cold cache or a busy machine), so a delay from it can
                # outlast the run. Aim again, from this step's time.
                timer.pop().cancel()
            fired.set()
            # After the header, the first step compiles for well over a second.
            delay = kill.fraction * (seen["dt"] if m else 1.0)
            timer.append(threading.Timer(delay, _kill, (proc,)))
            timer[-1].start()

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    try:
        proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
    t.join(timeout=10)
    return Outcome(
        kill,
        proc.returncode,
        proc.returncode == -signal.SIGKILL,
        seen["step"],
        "".join(lines),
    )


def _resumed(header: str) -> int:
    return int(header.rsplit("resuming from step ", 1)[1]) if "resuming from" in header else 0


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)


def run_chain(cmd, kills: list[Kill], env: dict, timeout: float = 600) -> list[Outcome]:
    """Each kill in turn on the same command, then one run to the end (which must succeed)."""
    outcomes = [run_once(cmd, env, k, timeout) for k in kills]
    final = run_once(cmd, env, None, timeout)
    if final.returncode != 0:
        raise RuntimeError(f"the final resume failed ({final.returncode}):\n{final.output[-4000:]}")
    return [*outcomes, final]


def comparable_metrics(rows: list[dict]) -> list[dict]:
    """Metric rows without the timing entries."""
    return [{k: v for k, v in r.items() if not k.startswith(TIMING_PREFIXES)} for r in rows]


def differences(ref_workdir, workdir, restore) -> list[str]:
    """What differs between two workdirs of the same config ([] when nothing does).

    `restore(workdir)` returns (checkpoint tree, meta) of the latest checkpoint.
    """
    from mmr_jax.infra import metrics

    ref_workdir, workdir = pathlib.Path(ref_workdir), pathlib.Path(workdir)
    out = []
    (tree_a, meta_a), (tree_b, meta_b) = restore(ref_workdir), restore(workdir)
    if meta_a != meta_b:
        out.append(f"checkpoint meta (step, data position): {meta_a} != {meta_b}")
    flat_a, flat_b = _flatten(tree_a), _flatten(tree_b)
    if flat_a.keys() != flat_b.keys():
        out.append(f"checkpoint trees differ: {sorted(flat_a.keys() ^ flat_b.keys())[:5]}")
    for key in sorted(flat_a.keys() & flat_b.keys()):
        if not np.array_equal(flat_a[key], flat_b[key]):
            out.append(f"checkpoint {key} differs")
    rows_a = comparable_metrics(metrics.read_jsonl(ref_workdir / metrics.METRICS_FILE))
    rows_b = comparable_metrics(metrics.read_jsonl(workdir / metrics.METRICS_FILE))
    steps_a, steps_b = [r["step"] for r in rows_a], [r["step"] for r in rows_b]
    if steps_a != steps_b:
        out.append(f"metric steps {steps_b} != {steps_a}")
    for a, b in zip(rows_a, rows_b, strict=False):
        if a != b:
            keys = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
            out.append(f"metrics of step {a['step']} differ in {keys[:8]}")
    exports_a = sorted(p.name for p in ref_workdir.glob("step_*"))
    exports_b = sorted(p.name for p in workdir.glob("step_*"))
    if exports_a != exports_b:
        out.append(f"HF exports {exports_b} != {exports_a}")
    for name in sorted(set(exports_a) & set(exports_b)):
        for f in sorted((ref_workdir / name).rglob("*.safetensors")):
            other = workdir / name / f.relative_to(ref_workdir / name)
            if not other.exists() or other.read_bytes() != f.read_bytes():
                out.append(f"export {name}/{f.name} differs")
    return out


def _flatten(tree) -> dict[str, np.ndarray]:
    import jax

    return {
        jax.tree_util.keystr(path): np.asarray(leaf)
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree)
    }
