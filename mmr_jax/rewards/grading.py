"""Answer grading with math-verify, bounded in time.

A completion is graded against a gold answer string (the dataset's `answer` field, not normalised):
the gold is wrapped as `\\boxed{answer}` and parsed with math-verify's LaTeX and expression
extractors (every gold answer of the five evaluation benchmarks parses this way); the completion is
parsed with boxed answers tried first (`boxed_match_priority=0`), then the other LaTeX anchors
("final answer is $...$"), then plain anchored expressions; `verify` decides equivalence.

Time bounds. math-verify's own timeouts use `signal.alarm`, which only works on the main thread and
cannot interrupt a C-level computation (a huge sympy power). `Grader(workers>0)` therefore grades
in worker subprocesses (`python -m mmr_jax.rewards._worker`: fresh interpreters, so a multithreaded
JAX parent is never forked and no user `__main__` is re-imported), and kills and replaces a worker
whose row passes `hard_timeout_s`; the row is reported as timed out (reward 0, counted).
`Grader(workers=0)` grades in-process with math-verify's signal timeouts when on the main thread
(used by tests and small scripts), and without any bound elsewhere (a warning says so).
`default_grader()`, the one training and evaluation use, has min(2, CPUs) workers, or the count in
`MMR_JAX_GRADER_WORKERS`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import multiprocessing.connection
import os
import pathlib
import re
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

CORRECT, WRONG, GOLD_INVALID, TIMEOUT = "correct", "wrong", "gold_invalid", "timeout"


class GradingWorkerError(RuntimeError):
    """A grading worker subprocess could not be started (or restarted)."""


@dataclasses.dataclass(frozen=True)
class Grade:
    """The verdict on one (completion, gold) pair: one of CORRECT, WRONG, GOLD_INVALID, TIMEOUT."""

    status: str

    @property
    def correct(self) -> bool:
        return self.status == CORRECT

    @property
    def gold_valid(self) -> bool:
        return self.status != GOLD_INVALID


@functools.cache
def _configs():
    import math_verify
    from latex2sympy2_extended import NormalizationConfig

    gold = (math_verify.LatexExtractionConfig(), math_verify.ExprExtractionConfig())
    pred = (
        math_verify.LatexExtractionConfig(
            normalization_config=NormalizationConfig(
                nits=False, malformed_operators=True, basic_latex=True, boxed="all", units=True
            ),
            boxed_match_priority=0,  # boxed answers first
            try_extract_without_anchor=False,
        ),
        math_verify.ExprExtractionConfig(try_extract_without_anchor=False),
    )
    return gold, pred


def _parse(text: str, config, timeout_s: int):
    """math-verify parse; raises math_verify.errors.TimeoutException on timeout."""
    import math_verify

    try:
        return math_verify.parse(
            text,
            list(config),
            extraction_mode="first_match",
            parsing_timeout=timeout_s,
            raise_on_error=True,
        )
    except Exception:  # malformed LaTeX: nothing extracted (TimeoutException passes)
        return []


_E_NOTATION = re.compile(r"\s*(-?\d+(?:\.\d*)?)\s*[eE]\s*([+-]?\d+)\s*")


@functools.lru_cache(maxsize=4096)
def _parse_gold(answer: str, timeout_s: int):
    if not answer.strip():
        return []
    gold = _parse("\\boxed{" + answer + "}", _configs()[0], timeout_s)
    # Minerva golds such as '4.5e33': LaTeX reads 'e' as a symbol, so also accept 4.5\times10^{33}
    # (verify() matches when any gold candidate equals any predicted one).
    m = _E_NOTATION.fullmatch(answer)
    if gold and m:
        gold = gold + _parse(f"\\boxed{{{m[1]}\\times10^{{{m[2]}}}}}", _configs()[0], timeout_s)
    return gold


def grade_one(completion: str, answer: str, *, timeout_s: int | None = 5) -> Grade:
    """Grades one completion in this thread (math-verify signal timeouts when `timeout_s`)."""
    import math_verify
    from math_verify.errors import TimeoutException

    try:
        gold = _parse_gold(answer, timeout_s)
        if not gold:
            return Grade(GOLD_INVALID)
        pred = _parse(completion, _configs()[1], timeout_s)
        if not pred:
            return Grade(WRONG)
        try:
            ok = math_verify.verify(gold, pred, timeout_seconds=timeout_s, raise_on_error=True)
        except Exception:  # sympy failure on a comparison: not equivalent
            ok = False
        return Grade(CORRECT if ok else WRONG)
    except TimeoutException:
        return Grade(TIMEOUT)


def serve(timeout_s: int | None) -> None:
    """Worker process main: JSON lines [completion, answer] on stdin -> a status line on stdout."""
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    grade_one("\\boxed{1}", "1", timeout_s=timeout_s)  # import and warm up before the clock runs
    out = sys.stdout
    out.write("ready\n")
    out.flush()
    for line in sys.stdin:
        completion, answer = json.loads(line)
        out.write(grade_one(completion, answer, timeout_s=timeout_s).status + "\n")
        out.flush()


class _Worker:
    """A `python -m mmr_jax.rewards._worker` subprocess (never a fork of a threaded parent)."""

    def __init__(self, timeout_s: int):
        root = str(pathlib.Path(__file__).resolve().parents[2])
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mmr_jax.rewards._worker", str(timeout_s)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True, encoding="utf-8",
        )  # fmt: skip
        self.task: int | None = None  # index of the row being graded
        self.started = 0.0

    def fileno(self) -> int:
        return self.proc.stdout.fileno()

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        ready = multiprocessing.connection.wait([self], timeout=timeout_s)
        if not ready or self.proc.stdout.readline().strip() != "ready":
            self.kill()
            raise GradingWorkerError(
                f"grading worker did not start within {timeout_s} s (exit code "
                f"{self.proc.returncode})"
            )

    def alive(self) -> bool:
        return self.proc.poll() is None

    def send(self, completion: str, answer: str) -> None:
        self.proc.stdin.write(json.dumps([completion, answer]) + "\n")
        self.proc.stdin.flush()

    def recv(self) -> str:
        line = self.proc.stdout.readline().strip()
        if line not in (CORRECT, WRONG, GOLD_INVALID, TIMEOUT):
            raise EOFError(f"grading worker exited ({self.proc.poll()})")
        return line

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self.proc.stdin.close()
        self.proc.stdout.close()


class Grader:
    """Grades batches of (completion, gold answer) pairs with a per-row time bound.

    Args:
      workers: worker processes; 0 grades in-process (see the module docstring).
      timeout_s: math-verify's per-parse / per-comparison timeout, whole seconds.
      hard_timeout_s: wall-clock bound per row in a worker, after which the worker is killed
        (default 4 * timeout_s + 5: a gold parse, a completion parse and a few comparisons).
    """

    def __init__(
        self, *, workers: int = 2, timeout_s: int = 5, hard_timeout_s: float | None = None
    ):
        self.workers = workers
        self.timeout_s = int(timeout_s)
        self.hard_timeout_s = hard_timeout_s or 4 * self.timeout_s + 5
        self._pool: list[_Worker] = []

    def grade(self, completions: Sequence[str], answers: Sequence[str]) -> list[Grade]:
        """Returns one Grade per row; `completions` and `answers` have the same length N."""
        if len(completions) != len(answers):
            raise ValueError(f"{len(completions)} completions but {len(answers)} answers")
        if self.workers <= 0:
            timeout = self.timeout_s
            if threading.current_thread() is not threading.main_thread():
                logging.warning("Grader(workers=0) off the main thread: no time bound")
                timeout = None
            pairs = zip(completions, answers, strict=True)
            return [grade_one(c, a, timeout_s=timeout) for c, a in pairs]
        return [Grade(s) for s in self._grade_in_workers(list(completions), list(answers))]

    def _restart(self, i: int, why: str) -> None:
        """Replaces worker i (killed first) by a fresh one."""
        old = self._pool[i]
        code = old.proc.poll()
        logging.warning("grading worker %d %s (exit code %s); restarting it", i, why, code)
        old.kill()
        self._pool[i] = _Worker(self.timeout_s)
        self._pool[i].wait_ready()

    def _grade_in_workers(self, completions: list[str], answers: list[str]) -> list[str]:
        new = [_Worker(self.timeout_s) for _ in range(self.workers - len(self._pool))]
        for w in new:
            w.wait_ready()
        self._pool += new
        for i, w in enumerate(self._pool):  # one that died between batches (killed, OOM)
            if not w.alive():
                self._restart(i, "exited while idle")
        results: list[str | None] = [None] * len(completions)
        todo = list(range(len(completions)))[::-1]
        while todo or any(w.task is not None for w in self._pool):
            for i, w in enumerate(self._pool):
                if w.task is None and todo:
                    task = todo.pop()
                    try:
                        w.send(completions[task], answers[task])
                    except (BrokenPipeError, ConnectionResetError):  # it died just now
                        todo.append(task)  # the row goes to the fresh worker
                        self._restart(i, "exited before taking a row")
                        continue
                    w.task, w.started = task, time.monotonic()
            busy = [w for w in self._pool if w.task is not None]
            if not busy:  # a restarted worker takes the row on the next pass
                continue
            wait = max(0.0, min(w.started for w in busy) + self.hard_timeout_s - time.monotonic())
            ready = multiprocessing.connection.wait(busy, timeout=wait)
            for i, w in enumerate(self._pool):
                if w in ready:
                    try:
                        results[w.task] = w.recv()
                        w.task = None
                        continue
                    except EOFError:  # the worker died (e.g. out of memory): count as timeout
                        pass
                elif w.task is None or time.monotonic() - w.started < self.hard_timeout_s:
                    continue
                results[w.task] = TIMEOUT
                w.kill()
                self._pool[i] = _Worker(self.timeout_s)
                self._pool[i].wait_ready()
        return results

    def close(self) -> None:
        """Stops the worker processes."""
        for w in self._pool:
            w.kill()
        self._pool = []

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown
            pass


_DEFAULT: Grader | None = None
# The default grader's worker count: a whole number >= 0 (0 grades in-process, with the limits
# above); unset, min(2, CPUs). A host with many cores and long completions may want more; the
# tests set 1 (tests/conftest.py): each worker is a fresh interpreter importing math-verify
# (0.75 s of CPU), started by every training process the tests launch.
WORKERS_ENV = "MMR_JAX_GRADER_WORKERS"


def default_workers() -> int:
    """The default grader's worker count (`WORKERS_ENV`, else min(2, CPUs))."""
    text = os.environ.get(WORKERS_ENV, "").strip()
    if not text:
        return max(1, min(2, os.cpu_count() or 1))
    if not text.isdigit():
        raise ValueError(
            f"{WORKERS_ENV}={text!r}: expected a whole number >= 0 of grading worker processes "
            "(0 grades in-process)"
        )
    return int(text)


def default_grader() -> Grader:
    """A process-wide Grader with `default_workers()` workers, created on first use."""
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = Grader(workers=default_workers())
    return _DEFAULT


def timeouts(grades: Sequence[Grade]) -> int:
    return sum(g.status == TIMEOUT for g in grades)
