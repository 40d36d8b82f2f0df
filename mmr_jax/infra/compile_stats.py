"""Seconds JAX spends compiling, from its own `jax.monitoring` duration events.

JAX records three durations for every program it builds: tracing to a jaxpr, lowering to an MLIR
module, and the backend (XLA) compile. `CompileClock` sums them as they are reported, so a
training loop can log how much of each step went to compilation (`time/compile`) and a benchmark
can compare compilation against the steps it delays. A program loaded from the
persistent cache is reported as a backend compile too, with the load's duration (JAX emits the
event around the load; `tests/bench_compile_test.py` checks it in a subprocess): with a warm cache
`backend` is mostly load time, and tracing and lowering are paid either way.
"""

from __future__ import annotations

import threading

from jax import monitoring

EVENTS = {
    "/jax/core/compile/jaxpr_trace_duration": "trace",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
    "/jax/core/compile/backend_compile_duration": "backend",
}


class CompileClock:
    """Running totals (seconds) of JAX's trace, lower and backend-compile events.

    JAX's listeners cannot be removed, so the clock registers one listener on its first use and
    keeps counting; callers read differences (`lap`).
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._totals = dict.fromkeys(EVENTS.values(), 0.0)
        self._registered = False
        self._last = dict(self._totals)

    def start(self) -> CompileClock:
        with self._lock:
            if not self._registered:
                monitoring.register_event_duration_secs_listener(self._on_event)
                self._registered = True
        return self

    def _on_event(self, event: str, duration: float, **_) -> None:
        part = EVENTS.get(event)
        if part is not None:
            with self._lock:
                self._totals[part] += duration

    def totals(self) -> dict[str, float]:
        with self._lock:
            return dict(self._totals)

    def lap(self) -> dict[str, float]:
        """Seconds per part (and 'total') since the previous lap (or since `start`)."""
        now = self.totals()
        out = {k: now[k] - self._last[k] for k in now}
        self._last = now
        out["total"] = sum(out.values())
        return out


CLOCK = CompileClock()  # one per process: JAX's listeners are process-wide
