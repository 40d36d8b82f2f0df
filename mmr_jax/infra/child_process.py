"""Processes that die with the process that started them (Linux `PR_SET_PDEATHSIG`).

One helper for both kinds of children: a spawned Python child of ours calls `die_with_parent`
itself (a study's run, `own_process.train_in_child`); a program in another environment (the vLLM
server, in its own venv, without this package) is started through `exec_argv`, which runs the
same function's source in that interpreter, then execs the program: the death signal survives
exec. Not a `preexec_fn`: Python code between fork and exec in a multithreaded (JAX) process can
deadlock.
"""

from __future__ import annotations

import inspect
import os
import signal
import sys


def die_with_parent(parent_pid: int, sig: int) -> None:
    """Linux: the kernel sends `sig` to this process when its parent dies; exits at once when
    the parent `parent_pid` is gone already (it died before the request took effect)."""
    # Self-contained (imports inside, no defaults naming modules): `exec_argv` ships its source.
    import ctypes
    import os
    import sys

    if not sys.platform.startswith("linux"):
        return
    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(sig))
    if os.getppid() != parent_pid:
        sys.exit(f"parent process {parent_pid} exited before this child started")


_EXEC = "die_with_parent(int(sys.argv[1]), int(sys.argv[2]))\nos.execv(sys.argv[3], sys.argv[3:])\n"


def exec_argv(argv: list[str], sig: int = signal.SIGTERM) -> list[str]:
    """The command that runs `argv` (argv[0] a Python interpreter) so that it gets `sig` when
    this process dies: `python -c <die_with_parent; exec> <our pid> <sig> argv...`.

    Off Linux, `argv` itself.
    """
    if not sys.platform.startswith("linux"):
        return list(argv)
    code = "import os, sys\n" + inspect.getsource(die_with_parent) + _EXEC
    return [argv[0], "-c", code, str(os.getpid()), str(int(sig)), *argv]
