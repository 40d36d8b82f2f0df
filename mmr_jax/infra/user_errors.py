"""Mistakes in what a person typed or pointed a script at, each told in one line with its fix.

A `UserError` (a wrong path, an empty data file, a config value of the wrong type, a workdir that
holds another run) ends a script with one line on stderr, `FATAL: <what is wrong>; <what to type
next>`, exit code 1; its traceback goes to the run's log file when `console.setup` opened one.
Absl flag errors (`--config.total_steps=abc`) and `app.UsageError` are told the same way. Any
other exception is a bug of the program and keeps its traceback.

    if __name__ == "__main__":
        user_errors.run(main, argv_checks=(command_line.check_argv,))

Error classes of the other parts derive from `UserError` beside their own base (`class
RunMismatchError(user_errors.UserError, ValueError)`), so that library callers still catch
`ValueError`.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Sequence

HELP = "--helpshort lists the flags"


class UserError(Exception):
    """A mistake in the input (a path, a file, a flag, a config value), not in the program: its
    message says what is wrong and what to type next."""


def fatal_line(err: BaseException, then: str = "") -> str:
    """'FATAL: <message>[. <then>]' on one line (the message's lines joined)."""
    text = " ".join(str(err).split()) or type(err).__name__
    return f"FATAL: {text}" + (f". {then}" if then else "")


def report(err: BaseException, *, then: str = "") -> str:
    """Logs `err` with its traceback to the log file (when one is open) and returns its one line
    (`then`: what to do next, when the caller knows better than the error)."""
    line = fatal_line(err, then)
    record = logging.LogRecord(__name__, logging.ERROR, __file__, 0, line, None, _exc_info(err))
    for handler in logging.getLogger().handlers:  # the file `console.setup` opened, not stderr
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)
    return line


def _exc_info(err: BaseException):
    return type(err), err, err.__traceback__


def _quiet_until_setup() -> None:
    """Keeps absl's INFO records (JAX's backend probe, ...) off stderr until `console.setup`
    routes them, unless `--verbosity` / `-v` was given."""
    from absl import flags
    from absl import logging as absl_logging

    if not flags.FLAGS["verbosity"].present:
        absl_logging.get_absl_handler().setLevel(logging.WARNING)


def show_info() -> None:
    """Puts absl's INFO records back on stderr: for a command that reports through them without a
    log file (`scripts/train.py --dry_run`)."""
    from absl import logging as absl_logging

    absl_logging.get_absl_handler().setLevel(logging.NOTSET)


def parse_flags(argv: Sequence[str], checks: Sequence[Callable[[Sequence[str]], None]] = ()):
    """absl's flag parsing, after `checks` (each raises a `UserError` for a bad argv); a flag
    error is raised as a `UserError`."""
    from absl import flags

    for check in checks:
        check(argv)
    try:
        return flags.FLAGS(list(argv))
    except flags.Error as e:
        raise UserError(f"{e} ({HELP})") from e


def run(main: Callable, *, argv_checks: Sequence[Callable[[Sequence[str]], None]] = ()) -> None:
    """`absl.app.run(main)`, telling user errors (of the flags, and raised by `main`) in one line.

    `argv_checks` run on the command line before absl parses it (e.g. config keys and values,
    `command_line.check_argv`)."""
    from absl import app

    def parser(argv):
        try:
            return parse_flags(argv, argv_checks)
        except UserError as e:
            sys.exit(fatal_line(e))

    def wrapped(argv):
        _quiet_until_setup()
        try:
            return main(argv)
        except app.UsageError as e:  # '--workdir is required': the whole usage text is noise
            sys.exit(fatal_line(UserError(f"{e} ({HELP})")))
        except UserError as e:
            sys.exit(report(e))

    app.run(wrapped, flags_parser=parser)
