"""Host-side collectives of a multi-process run, and who writes.

`allgather` (numpy in, numpy out, in process order) is the one primitive the rest build on:
decisions taken once (`primary_value`, `primary_first`), `barrier`, and metrics reduced over
processes (`reduce_metrics`); `weight_sync` builds whole process-local copies of global arrays on
it. A collective whose peer died raises `PeerLostError` (`peer_lost`), never hangs. With one
process each is a no-op.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

import jax
import numpy as np

from mmr_jax.distributed.errors import DistributedError, PeerLostError


def is_primary() -> bool:
    """Process 0 alone writes the console, metrics, TensorBoard and exports."""
    return jax.process_index() == 0


_COLLECTIVE_S = [0.0]  # host-side cross-process collectives since the last `collective_seconds`


def collective_seconds() -> float:
    """Seconds this process spent in host-side collectives (gathers, weight copies) since the
    last call; the train step's own collectives run inside its jit and are not counted."""
    spent, _COLLECTIVE_S[0] = _COLLECTIVE_S[0], 0.0
    return spent


def allgather(x: np.ndarray, *, timed: bool = True) -> np.ndarray:
    """[P, ...]: `x` (same shape and dtype on every process) of every process, in process order.

    `timed`: count the call in `collective_seconds` (a gather queued behind a train step in flight
    waits for it: not collective time)."""
    if jax.process_count() == 1:
        return np.asarray(x)[None]
    from jax.experimental import multihost_utils

    t0 = time.perf_counter()
    try:
        return np.asarray(multihost_utils.process_allgather(np.asarray(x), tiled=False))
    except Exception as e:  # a dead peer closes its gloo connections: a named error, not a hang
        raise _peer_error(e) from e
    finally:
        _COLLECTIVE_S[0] += (time.perf_counter() - t0) if timed else 0.0


_LOST_PEER = ("Gloo", "Connection closed", "Connection reset", "heartbeat", "Barrier failed")


def peer_lost(e: BaseException) -> PeerLostError | None:
    """A `PeerLostError` for an error raised by a collective whose peer process died, else None."""
    if isinstance(e, PeerLostError):
        return e
    text = str(e)
    if jax.process_count() == 1 or not any(s in text for s in _LOST_PEER):
        return None
    from mmr_jax.distributed import failures

    cause = failures.announced()  # a peer that raised says why; a killed one says nothing
    return PeerLostError(
        f"process {jax.process_index()}: a collective with the other processes failed "
        f"({text[:300]}); "
        + (f"{cause}. " if cause else "another process of the run has most likely died. ")
        + "Fix the cause and re-run the same command: the run resumes from its last checkpoint."
    )


def _peer_error(e: Exception) -> Exception:
    return peer_lost(e) or e


def primary_value(value: bool) -> bool:
    """Process 0's `value` on every process (a decision about shared files, taken once)."""
    return bool(allgather(np.array([int(value)], np.int32))[0, 0])


def primary_first(fn, what: str):
    """Runs `fn` on process 0 alone (shared files); the others wait, and fail with a named error
    when it failed. Returns `fn()` on process 0, None elsewhere."""
    if jax.process_count() == 1:
        return fn()
    result, error = None, None
    if is_primary():
        try:
            result = fn()
        except Exception as e:  # the others learn of it below; process 0 raises its own
            error = e
    if not primary_value(error is None):
        if error is not None:
            raise error
        raise DistributedError(f"process 0 failed {what}; its log says why")
    return result


def reduce_metrics(metrics: Mapping[str, float]) -> dict[str, float]:
    """Metrics of every process reduced to one value each: times (`time/*`) by max, the slowest
    process setting the pace; everything else by mean (batch metrics are equal on every process,
    as each holds the whole step's groups). Every process must call it with the same keys."""
    if jax.process_count() == 1:
        return dict(metrics)
    keys = sorted(metrics)
    exact = np.array([float(metrics[k]) for k in keys], np.float64).view(np.int32)  # no x64 cast
    values = allgather(exact, timed=False).view(np.float64)  # runs behind the next train step
    return {
        k: float(values[:, i].max() if k.startswith("time/") else values[:, i].mean())
        for i, k in enumerate(keys)
    }


def barrier() -> None:
    """Waits until every process gets here (a collective: PeerLostError if one has died)."""
    allgather(np.zeros((1,), np.int32))
