"""A process that fails stops every process of the run, in bounded time, each with a named error.

An ordinary exception on one process (an unreachable server, a full disk) must not leave the
others waiting in a collective: JAX's exit barrier (`jax.distributed.shutdown`, run at exit)
would hold the failing process for minutes while its peers wait for its part of a gather. So a
failing process

  1. `announce`s its error in the coordination service's key-value store (where JAX's start-up
     keeps its own keys), so that its peers can name it;
  2. runs its local cleanup only (the trainer stops the vLLM servers it launched and closes its
     metric files; a checkpoint write in flight is abandoned, as Orbax's temporary folder of an
     unfinished step is never taken for a checkpoint);
  3. leaves with `exit_now`, skipping the exit barrier: its connections close, and each peer's
     next (or current) collective fails at once on gloo (CPU) with `PeerLostError`, whose message
     names the failed process's error (`announced`). On NCCL, where a collective does not notice a
     closed peer, JAX's heartbeat (`startup.Options.heartbeat_s`, 30 s) stops the peers.

The key-value store is reached through JAX's distributed client, which JAX does not export
(`jax._src.distributed.global_state.client`); `kv_client` is the one place that touches it, and
tests/distributed/failures_test.py fails if its name or methods change. Without it the run still
stops in bounded time; only the peers' messages lose the cause.
"""

from __future__ import annotations

import os
import sys

import jax

FAILED_KEY = "mmr_jax/failed/process"  # + <index>: "<ErrorType>: <message>"
EXIT_FAILED = 1  # the failing process
EXIT_PEER_LOST = 3  # a process whose peer failed or died
ASK_S = 5.0  # a key-value call waits this long at most (the coordinator may be the one that died)


def kv_client():
    """JAX's distributed runtime client (the coordination service's key-value store), or None
    with one process or before `jax.distributed.initialize`."""
    from jax._src import distributed as jax_distributed

    return getattr(jax_distributed.global_state, "client", None)


def describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e)[:500]}"


def announce(e: BaseException) -> None:
    """Records this process's failure for its peers (best effort: never raises, waits at most
    `ASK_S`)."""
    if jax.process_count() == 1:
        return
    text = describe(e)

    def tell():
        try:
            kv_client().key_value_set(f"{FAILED_KEY}{jax.process_index()}", text)
        except Exception:  # the coordinator itself may be gone: the peers then say less
            pass

    _bounded(tell)


def announced() -> str | None:
    """'process <i> failed: <ErrorType>: <message>' for the first other process that announced a
    failure, or None (best effort: never raises; None after `ASK_S` without an answer)."""
    if jax.process_count() == 1:
        return None
    found: list[str | None] = [None]
    _bounded(lambda: found.__setitem__(0, _ask()))
    return found[0]


def _bounded(fn) -> None:
    """Runs `fn` in a daemon thread joined for at most `ASK_S` (a call to a coordinator that
    died may not return)."""
    import threading

    thread = threading.Thread(target=fn, name="failures-kv", daemon=True)
    thread.start()
    thread.join(ASK_S)


def _ask() -> str | None:
    client = kv_client()
    for p in range(jax.process_count()):
        if p == jax.process_index():
            continue
        try:
            text = client.key_value_try_get(f"{FAILED_KEY}{p}")
        except Exception:  # not set (NOT_FOUND) or the coordinator is gone
            continue
        if text:
            return f"process {p} failed: {text}"
    return None


def exit_now(code: int, message: str) -> None:
    """Prints `message` to stderr, flushes, and ends the process without JAX's exit barrier."""
    from absl import logging

    logging.error("%s", message)
    logging.flush()
    print(message, file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(code)
