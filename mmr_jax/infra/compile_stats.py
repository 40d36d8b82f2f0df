"""Seconds JAX spends compiling, from its own `jax.monitoring` duration events.

JAX records three durations for every program it builds: tracing to a jaxpr, lowering to an MLIR
module, and the backend (XLA) compile. `CompileClock` sums them as they are reported, so a
training loop can log how much of each step went to compilation (`time/compile`) and a benchmark
can compare compilation against the steps it delays. A program loaded from the
persistent cache is reported as a backend compile too, with the load's duration (JAX emits the
event around the load; `tests/benchmarks/bench_compile_test.py` checks it in a subprocess): with a
warm cache `backend` is mostly load time, and tracing and lowering are paid either way.
"""

from __future__ import annotations

import re
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


class ProgramSeconds:
    """JAX's compile events of this process summed per program (the `fun_name` JAX reports with
    each event: `train_step`, `_decode_loop`, or the op name of an eager call such as
    `convert_element_type`), so a run's compilation can be traced to what built it. JAX's
    listeners cannot be removed: one is registered, and callers take differences (`since`)."""

    def __init__(self):
        self.seconds: dict[str, dict[str, float]] = {}
        self._parts = EVENTS
        monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, event: str, duration: float, fun_name: str = "?", **_) -> None:
        part = self._parts.get(event)
        if part is not None:
            # JAX names the trace `f` and the lowering and backend compile `jit(f)`: one program.
            name = re.sub(r"^(?:jit|pjit)\((.*)\)$", r"\1", fun_name)
            row = self.seconds.setdefault(name, {"trace": 0.0, "lower": 0.0, "backend": 0.0})
            row[part] += duration
            if part == "backend":
                row["builds"] = row.get("builds", 0) + 1

    def snapshot(self) -> dict[str, dict[str, float]]:
        return {k: dict(v) for k, v in self.seconds.items()}

    def since(self, before: dict[str, dict[str, float]]) -> list[dict]:
        """Per program since `before`: name, builds, trace/lower/backend/total seconds,
        largest total first."""
        rows = []
        for name, now in self.seconds.items():
            was = before.get(name, {})
            row = {k: now.get(k, 0.0) - was.get(k, 0.0) for k in ("trace", "lower", "backend")}
            row["total"] = sum(row.values())
            row["builds"] = int(now.get("builds", 0) - was.get("builds", 0))
            if row["total"] > 0:
                rows.append({"program": name, **row})
        return sorted(rows, key=lambda r: -r["total"])


class CacheLoads:
    """Programs loaded from XLA's on-disk cache, and the seconds the loads took. JAX reports a
    load both as its own event (counted here) and as the program's backend compile event (so
    the compile totals already include it); a loaded program still costs its trace and
    lowering."""

    EVENT = "/jax/compilation_cache/cache_retrieval_time_sec"

    def __init__(self):
        self.seconds, self.loads = 0.0, 0
        monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, event: str, duration: float, **_) -> None:
        if event == self.EVENT:
            self.seconds += duration
            self.loads += 1
