"""What a person sees on the console, and where the rest of the logs go.

By default a script shows the lines the library writes through `info` (a run's header, one line
per step, checkpoints, evaluations) on stdout, and warnings and errors of every library on stderr.
Everything at INFO and above (Orbax, absl, JAX, transformers, this package) also goes to a log
file, normally `<workdir>/<name>.log` (in a bucket workdir, a local copy mirrored to it:
`run_paths`). `--verbosity=0` (or any explicit `-v`) restores absl's
INFO logs on stderr as well.

    console.setup("runs/x/train.log")   # once, after flags are parsed (inside app.run's main)
    console.info("step %d/%d ...", s, total)

Without `setup` (the library used from Python) `info` lines are ordinary log records.
"""

from __future__ import annotations

import copy
import logging
import os
import pathlib
import sys

NAME = "mmr_jax.infra.console"
_FORMAT = "%(asctime)s %(levelname).1s %(name)s %(filename)s:%(lineno)d] %(message)s"
_logger = logging.getLogger(NAME)


def info(msg: str, *args) -> None:
    """A line for the person watching the run (stdout after `setup`)."""
    _logger.info(msg, *args)


class _NotConsole(logging.Filter):
    """Keeps `info` lines off the stderr handler: they are already on stdout."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.name != NAME


class _Brief(logging.Formatter):
    """One line per record on the console; tracebacks and long messages stay in the log file."""

    def __init__(self, inner: logging.Formatter | None, log_file: pathlib.Path):
        super().__init__()
        self.inner, self.log_file = inner or logging.Formatter(), log_file

    def format(self, record: logging.LogRecord) -> str:
        brief = copy.copy(record)  # the file handler formats the original
        text = record.getMessage()
        first = text.splitlines()[0] if text else ""
        cut = record.exc_info is not None or len(first) > 400 or first != text
        brief.msg = first[:400] + (f" ... (full text in {self.log_file})" if cut else "")
        brief.args, brief.exc_info, brief.exc_text, brief.stack_info = None, None, None, None
        return self.inner.format(brief)


def verbosity_given() -> bool:
    from absl import flags

    try:
        return flags.FLAGS["verbosity"].present > 0
    except (KeyError, flags.UnparsedFlagAccessError):
        return False


def _is_basic_config_handler(h: logging.Handler) -> bool:
    """The stderr handler `logging.basicConfig()` adds. absl's `log()` calls basicConfig when it
    logs before its flags are parsed (Orbax does so while being imported), and that handler would
    print every INFO record of every library: `setup` routes the console itself."""
    return type(h) is logging.StreamHandler and h.stream in (sys.stderr, sys.__stderr__)


def setup(log_file, *, verbose: bool | None = None, stdout: bool = True) -> pathlib.Path:
    """Routes logs: `info` lines to stdout, warnings to stderr, everything to `log_file`.

    Args:
      log_file: file that receives every record at INFO and above (appended; parents created).
        A bucket path (gs://) is written as a local copy that `run_paths` mirrors to it.
      verbose: also show INFO of every library on stderr; default: whether `--verbosity` / `-v`
        was given on the command line.
      stdout: show `info` lines on stdout (False: the file only, as on every process of a
        multi-process run but process 0, which alone prints).
    Returns the path of the file written (the local copy, for a bucket).
    """
    from absl import logging as absl_logging

    from mmr_jax.infra import run_paths

    verbose = verbosity_given() if verbose is None else verbose
    if run_paths.is_remote(log_file):
        folder, name = os.fspath(log_file).rsplit("/", 1)
        log_file = run_paths.open_run(folder).appended(name)
    path = pathlib.Path(log_file).absolute()
    path.parent.mkdir(parents=True, exist_ok=True)
    root = logging.getLogger()
    for h in list(root.handlers):  # a second setup (tests) replaces the first
        if getattr(h, "_mmr_jax_console", False) or _is_basic_config_handler(h):
            root.removeHandler(h)
    for h in list(_logger.handlers):
        _logger.removeHandler(h)

    absl_handler = absl_logging.get_absl_handler()
    if absl_handler not in root.handlers:
        root.addHandler(absl_handler)
    absl_handler.addFilter(_NotConsole())
    absl_handler.setLevel(logging.NOTSET if verbose else logging.WARNING)
    current = absl_handler.python_handler.formatter  # absl's "I1125 12:00:00.0 file.py:1]" lines
    inner = current.inner if isinstance(current, _Brief) else current
    absl_handler.setFormatter(inner if verbose else _Brief(inner, path))
    if not verbose:  # the file gets INFO whatever absl's flag default set
        root.setLevel(logging.INFO)

    file_handler = logging.FileHandler(path, encoding="utf-8")
    file_handler.setFormatter(logging.Formatter(_FORMAT))
    file_handler.setLevel(logging.INFO)
    file_handler._mmr_jax_console = True
    root.addHandler(file_handler)

    if stdout:
        out = logging.StreamHandler(sys.stdout)
        out.setFormatter(logging.Formatter("%(asctime)s %(message)s", datefmt="%H:%M:%S"))
        _logger.addHandler(out)
    _logger.setLevel(logging.INFO)
    _logger.propagate = True  # to the file
    _quiet_libraries()
    return path


def _quiet_libraries() -> None:
    """Libraries that print on their own (not through the root logger) keep to warnings."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")  # XLA / TF C++ INFO lines
    try:
        import transformers

        transformers.utils.logging.set_verbosity_warning()
        transformers.utils.logging.disable_progress_bar()
    except ImportError:
        pass
