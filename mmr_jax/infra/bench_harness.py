"""What every benchmark in `benchmarks/` shares: a child process per config, timing, JSON, tables.

A benchmark file holds only its own work (what it builds and times) and its columns; this module
runs it. The pieces:

  load(name)        `benchmarks/<name>.py` as a module, its absl flags unregistered again (tests
                    call a benchmark's functions; two benchmarks may define the same flag).
  timed(fn, ...)    seconds of `fn()` calls: the first (compiles, allocates) apart, then the
                    median, min and every timed call after `warmup` untimed ones.
  run_child(argv)   a child process (dies with this one) that prints one `RESULT <json>` line
                    (`emit`): its dict, or {"error": ...} with its stderr's tail when it fails or
                    outruns `timeout_s`. A child per config: each one's device peak is its own,
                    and a crash or an out-of-memory ends one row, not the run.
  best_of(fn)       (best, median) seconds of repeated calls, for calls too short to time once.
  alternate(fns)    median seconds of each of several functions called in turns (ABAB...).
  step_summary      median, min and max of a run's step times after its warm-up steps.
  write_json        the rows, written whole (a file that exists is complete).
  format_table      rows as an aligned text table from (key, header, format) columns.
  parse_args        a benchmark's command line from a table of flags (name: default, help); a
                    bad flag or value ends it with one `FATAL:` line (`infra.user_errors`), as
                    any `ArgumentParser` of this module does.
  run(main)         `main()`, a `UserError` it raises (a config file that is not there, a
                    misspelt `--set` key) told in one `FATAL:` line, exit code 1.
  (compile_stats.ProgramSeconds and CacheLoads: JAX's compile events, XLA cache loads.)

No JAX or torch import at module level: a torch-only child imports this too.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import importlib.util
import json
import os
import pathlib
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from mmr_jax.infra import child_process, user_errors

REPO = pathlib.Path(__file__).resolve().parents[2]
BENCHMARKS = REPO / "benchmarks"
RESULT = "RESULT "  # a child's result line: this prefix, then one JSON object
GIB = 2.0**30


def load(name: str):
    """The module of `benchmarks/<name>.py` (not a package), for its functions.

    The absl flags the file defines at import are unregistered again, so that two benchmarks
    defining the same flag (`--model`) can share a process (tests).
    """
    path = BENCHMARKS / f"{name}.py"
    if str(BENCHMARKS) not in sys.path:  # benchmarks import their siblings by name
        sys.path.append(str(BENCHMARKS))
    if not path.is_file():
        raise FileNotFoundError(f"no benchmark {name!r}: {path} does not exist")
    return load_file(path, name)


def load_file(path, name: str):
    """The module of the file `path` (a script, not in a package) under `name`, the absl flags
    it defines at import unregistered again (its functions are wanted, not its `main`)."""
    from absl import flags

    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    before = set(flags.FLAGS)
    spec.loader.exec_module(module)
    for flag in set(flags.FLAGS) - before:
        delattr(flags.FLAGS, flag)
    return module


@dataclasses.dataclass(frozen=True)
class Timing:
    """Seconds of one timed function: the first call, then the `steps` timed calls."""

    first_s: float
    steps_s: tuple[float, ...]

    @property
    def median_s(self) -> float:
        return statistics.median(self.steps_s)

    @property
    def min_s(self) -> float:
        return min(self.steps_s)

    def as_dict(self) -> dict:
        return {
            "first_s": self.first_s,
            "median_s": self.median_s,
            "min_s": self.min_s,
            "steps_s": list(self.steps_s),
        }


def timed(fn: Callable[[], Any], *, steps: int, warmup: int = 0, clock=time.perf_counter):
    """Calls `fn` 1 + `warmup` + `steps` times; -> Timing (first call apart, warm-ups dropped).

    `fn` must wait for its own work (`jax.block_until_ready`, `torch.cuda.synchronize`).
    """
    if steps < 1 or warmup < 0:
        raise ValueError(f"steps must be >= 1 and warmup >= 0, got steps={steps} warmup={warmup}")
    t0 = clock()
    fn()
    first = clock() - t0
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(steps):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return Timing(first, tuple(times))


def best_of(fn: Callable[[], Any], *, min_total=0.3, min_reps=5, max_reps=1000, clock=None):
    """(best, median) seconds of `fn()` over repeats after one untimed call: at least `min_reps`,
    more until `min_total` seconds have passed (at most `max_reps`). On a shared CPU noise only
    adds time, so tables show the best; JSON keeps both."""
    clock = clock or time.perf_counter
    fn()
    times, start = [], clock()
    while len(times) < min_reps or (clock() - start < min_total and len(times) < max_reps):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return min(times), statistics.median(times)


def alternate(fns: Sequence[Callable[[], Any]], *, steps: int, clock=None) -> list[float]:
    """Median seconds of each of `fns` over `steps` calls made in turns, the order reversed every
    round (ABBA...), so drift on a shared machine falls on all; a first round is a warm-up."""
    clock = clock or time.perf_counter
    times: list[list[float]] = [[] for _ in fns]
    for i in range(steps + 1):
        order = range(len(fns)) if i % 2 == 0 else reversed(range(len(fns)))
        for k in order:
            t0 = clock()
            fns[k]()
            if i:
                times[k].append(clock() - t0)
    return [statistics.median(t) for t in times]


def step_summary(step_s: Sequence[float], warmup: int) -> dict:
    """Median, min, max of the steps after `warmup` (ValueError when none is left)."""
    kept = list(step_s)[warmup:]
    if not kept:
        raise ValueError(f"{len(step_s)} steps and {warmup} warm-up steps: nothing timed")
    return {
        "steps_timed": len(kept),
        "median_s": statistics.median(kept),
        "min_s": min(kept),
        "max_s": max(kept),
    }


def progress(message: str) -> None:
    """A time-stamped line on stderr (a child's stderr goes to the parent's)."""
    print(f"  [{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def emit(result: dict) -> None:
    """A child's answer: one `RESULT <json>` line on stdout."""
    print(RESULT + json.dumps(result), flush=True)


def parse_result(stdout: str) -> dict | None:
    """The last `RESULT` line's object in a child's stdout, or None."""
    found = [ln for ln in stdout.splitlines() if ln.startswith(RESULT)]
    return json.loads(found[-1][len(RESULT) :]) if found else None


def run_child(
    argv: Sequence[str],
    *,
    timeout_s: float | None = None,
    env: dict | None = None,
    echo_stderr: bool = True,
    tail_lines: int = 30,
) -> dict:
    """Runs `argv` (argv[0] a Python interpreter) as a child that dies with this process; -> its
    `RESULT` dict, or {"error": why} (exit status or timeout, and its stderr's last lines).

    The child's stderr (its progress, its traceback) is echoed as it comes when `echo_stderr`,
    so a log shows how far a child got before a time limit stopped it.
    """
    cmd = child_process.exec_argv(list(argv))
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    tail: collections.deque[str] = collections.deque(maxlen=tail_lines)
    out: list[str] = []

    def pump_stderr():
        for line in proc.stderr:
            tail.append(line.rstrip("\n"))
            if echo_stderr:
                sys.stderr.write(line)
                sys.stderr.flush()

    readers = [
        threading.Thread(target=pump_stderr, daemon=True),
        threading.Thread(target=lambda: out.extend(proc.stdout), daemon=True),
    ]
    for r in readers:
        r.start()
    try:
        proc.wait(timeout=timeout_s or None)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        for r in readers:
            r.join(timeout=5)
        return {"error": f"timed out after {timeout_s} s", "stderr_tail": "\n".join(tail)}
    for r in readers:
        r.join(timeout=30)
    stdout = "".join(out)
    result = parse_result(stdout)
    if proc.returncode == 0 and result is not None:
        return result
    why = f"exit status {proc.returncode}" if proc.returncode else "no RESULT line"
    return {"error": why, "stderr_tail": "\n".join(tail)}


def self_argv(script: str, *args: str) -> list[str]:
    """The command that runs the benchmark file `script` again (`__file__`) with `args`."""
    return [sys.executable, str(script), *args]


def write_json(path: str | os.PathLike | None, obj: Any) -> None:
    """Writes `obj` to `path` (nothing when path is None) via a temporary file, so a reader
    never sees half a file."""
    if not path:
        return
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1, default=str))
    os.replace(tmp, path)


def fmt(value: Any, spec: str = "") -> str:
    """`format(value, spec)`, '-' for None."""
    return "-" if value is None else format(value, spec)


def format_table(rows: Sequence[dict], columns: Sequence[tuple[str, str, str]]) -> str:
    """Rows (dicts) as a table: one column per (key, header, format spec); missing keys show '-'.
    A row with an 'error' shows its first column then the error."""
    cells = [[h for _, h, _ in columns]]
    errors = {}
    for i, row in enumerate(rows):
        if "error" in row:
            errors[i + 1] = row["error"]
            cells.append([fmt(row.get(columns[0][0]))] + [""] * (len(columns) - 1))
        else:
            cells.append([fmt(row.get(k), spec) for k, _, spec in columns])
    widths = [max(len(r[j]) for r in cells) for j in range(len(columns))]
    lines = []
    for i, r in enumerate(cells):
        pairs = enumerate(zip(r, widths, strict=True))
        text = "  ".join(c.ljust(w) if j == 0 else c.rjust(w) for j, (c, w) in pairs)
        if i in errors:
            text = f"{r[0].ljust(widths[0])}  FAILED: {errors[i]}"
        lines.append(text.rstrip())
    return "\n".join(lines)


# ----- JAX programs (imports inside: a torch-only child never loads JAX) --------------------------


def steady_calls(compiled, args, *, steps: int, donated: tuple[int, int] | None = None) -> Timing:
    """Seconds of `steps` calls of a compiled JAX program after one warm-up call (autotuning,
    allocation); the donated argument is replaced by the call's matching output after each call
    (`donated`: argument index, output index; `dry_run_programs.DONATED`)."""
    import jax

    args = list(args)

    def call():
        out = jax.block_until_ready(compiled(*args))
        if donated is not None:
            args[donated[0]] = out[donated[1]]

    return timed(call, steps=steps)


def random_on_device(args, seed: int = 0):
    """Concrete arrays of abstract arguments' shapes, dtypes and shardings, drawn on the device
    (a 7B model's weights drawn on the host would take minutes and tens of GB): floats N(0, 0.02),
    booleans True, integers 0."""
    import jax
    import jax.numpy as jnp

    leaves, treedef = jax.tree.flatten(args)
    made = []
    for i, x in enumerate(leaves):
        key = jax.random.fold_in(jax.random.key(seed), i)

        def make(key, x=x):
            if jnp.issubdtype(x.dtype, jnp.floating):
                return (0.02 * jax.random.normal(key, x.shape, jnp.float32)).astype(x.dtype)
            if x.dtype == jnp.bool_:
                return jnp.ones(x.shape, bool)
            return jnp.zeros(x.shape, x.dtype)

        sharding = getattr(x, "sharding", None)
        made.append(jax.jit(make, out_shardings=sharding)(key))
    return jax.tree.unflatten(treedef, made)


def jax_peak_bytes() -> int | None:
    """The first local device's peak bytes in use (None where the backend keeps no count: CPU)."""
    import jax

    stats = jax.local_devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser whose errors (an unknown flag, a value of the wrong type or outside its
    choices) are one `FATAL:` line and exit code 1, not the usage text and exit code 2."""

    def error(self, message):
        then = f"{self.prog} --help lists the flags"
        sys.exit(user_errors.fatal_line(user_errors.UserError(message), then))


def parse_args(doc: str, flags: dict[str, tuple], argv=None):
    """(args, parser) of a command line given as {name: (default, help[, choices])}: the type is
    the default's (False: a switch; None: a string; a list: repeatable, each use appended),
    `--json` (a path to write) always there. A bad flag or value exits with one `FATAL:` line."""
    ap = ArgumentParser(description=doc, formatter_class=argparse.RawTextHelpFormatter)
    flags = {"json": (None, "write the results here"), **flags}
    for name, (default, text, *choices) in flags.items():
        if default is False:
            ap.add_argument(f"--{name}", action="store_true", help=text)
            continue
        if isinstance(default, list):
            ap.add_argument(f"--{name}", action="append", default=list(default), help=text)
            continue
        kind = str if default is None else type(default)
        choices = choices[0] if choices else None
        ap.add_argument(f"--{name}", type=kind, default=default, help=text, choices=choices)
    return ap.parse_args(argv), ap


def counts_flag(name: str, flag_values=None) -> None:
    """Makes the absl list flag `name` (`--prompts=8,32`) take only whole numbers: another value
    is refused when the flags are parsed, in one line (`user_errors.run`)."""
    from absl import flags

    message = f"--{name} takes whole numbers, comma-separated"
    valid = lambda v: all(x.isdigit() for x in v or ())
    flags.register_validator(name, valid, message, flag_values=flag_values or flags.FLAGS)


def run(main: Callable[[], Any]) -> None:
    """Runs a benchmark's `main()`; a `UserError` (a config file that is not there, a misspelt
    `--set` key, a value of the wrong type) ends it with one `FATAL:` line and exit code 1, the
    way `scripts/` tell them. Any other exception is a bug and keeps its traceback."""
    try:
        main()
    except user_errors.UserError as e:
        sys.exit(user_errors.fatal_line(e))
