"""Metric writers (JSONL + TensorBoard), the console progress line, and periodic actions.

`<workdir>/metrics.jsonl` holds one JSON object per logged step: {"step": s, "<name>": value, ...};
`scripts/plot_run.py` draws it. TensorBoard event files go to `<workdir>/tb`. A bucket workdir
(gs://) gets both through a local staging copy (`run_paths.RunDir`).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping

import numpy as np
from etils import epath

from mmr_jax.infra import run_paths

METRICS_FILE = "metrics.jsonl"


def _scalar(value) -> float | None:
    try:
        value = float(np.asarray(value))
    except (TypeError, ValueError):
        return None
    return value


class MetricWriter:
    """Appends scalar metrics per step to `metrics.jsonl` and (optionally) TensorBoard.

    Args:
      workdir: run folder (local, or a bucket: the files are appended to a local copy, which
        `run_paths` mirrors to it).
      tensorboard: also write TensorBoard events under `<workdir>/tb`.
      resume_step: drop lines of steps after this one (written after the last checkpoint of an
        interrupted run, and about to be recomputed); None keeps the file as it is.
    """

    def __init__(self, workdir, *, tensorboard: bool = True, resume_step: int | None = None):
        run = run_paths.open_run(workdir)
        self.path = run.appended(METRICS_FILE)  # the workdir's file, or its local copy
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step is not None and self.path.exists():
            kept = [r for r in read_jsonl(self.path) if r.get("step", 0) <= resume_step]
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
            tmp.replace(self.path)
        self._file = open(self.path, "a", encoding="utf-8")
        self._tb = None
        if tensorboard:
            import tensorboardX

            self._tb = tensorboardX.SummaryWriter(str(run.appended_dir("tb")))

    def write(self, step: int, metrics: Mapping[str, object]) -> dict[str, float]:
        """Writes the scalar entries of `metrics` (non-scalars are skipped); returns them."""
        scalars = {}
        for name, value in metrics.items():
            value = _scalar(value)
            if value is not None:
                scalars[name] = value
        record = {
            "step": int(step),
            **{k: (v if math.isfinite(v) else str(v)) for k, v in scalars.items()},
        }
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tb is not None:
            for name, value in scalars.items():
                self._tb.add_scalar(name, value, int(step))
            self._tb.flush()
        return scalars

    def write_text(self, step: int, name: str, text: str) -> None:
        """A text entry (sample completions) for TensorBoard; not written to JSONL."""
        if self._tb is not None:
            self._tb.add_text(name, text, int(step))

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()


def read_jsonl(path) -> list[dict]:
    """Rows of a metrics file (local or in a bucket); a torn last line (killed writer) is
    skipped."""
    rows = []
    with epath.Path(path).open("r", encoding="utf-8") as f:
        for line in f:
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows


class NullWriter:
    """`MetricWriter`'s interface, writing nothing: the writer of every process but process 0."""

    def write(self, step: int, metrics: Mapping[str, object]) -> dict[str, float]:
        del step
        return {k: v for k, v in ((k, _scalar(v)) for k, v in metrics.items()) if v is not None}

    def write_text(self, step: int, name: str, text: str) -> None:
        del step, name, text

    def close(self) -> None:
        pass


class Periodic:
    """`every` steps (and at `last`, when given): `periodic(step)` is True on those steps.

    `every <= 0` never fires, except at `last` when `at_last`.
    """

    def __init__(self, every: int, *, last: int | None = None, at_last: bool = True):
        self.every, self.last, self.at_last = every, last, at_last

    def __call__(self, step: int) -> bool:
        if self.at_last and self.last is not None and step == self.last:
            return True
        return self.every > 0 and step % self.every == 0


def format_duration(seconds: float) -> str:
    """3725 -> '1h02m05s'."""
    seconds = max(0, int(round(seconds)))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s" if m else f"{s}s"


# (label, metric) pairs of the progress line, shown when the step has them.
PROGRESS_KEYS = (
    ("reward", "reward/mean"),
    ("acc", "reward/accuracy/mean"),
    ("lambda", "mmr/lambda_mean"),
    ("loss", "loss"),
    ("kl", "kl"),
)


class Progress:
    """The console's line per step: its metrics, the step's own time ('took', `time/step`), the
    wall time per step since this process started ('s/step avg') and the ETA from it.

    Args:
      total: last step of the run.
      start_step: step the process started at (a resumed run counts only its own steps).
      keys: (label, metric name) pairs shown on the line, when present.
    """

    def __init__(self, total: int, start_step: int = 0, keys=PROGRESS_KEYS):
        self.total, self.start_step, self.keys = total, start_step, tuple(keys)
        self._t0 = time.monotonic()

    def line(self, step: int, metrics: Mapping[str, float]) -> str:
        done = step - self.start_step
        elapsed = time.monotonic() - self._t0
        eta = elapsed / done * (self.total - step) if done > 0 else float("nan")
        parts = [f"step {step}/{self.total}"]
        parts += [f"{label} {metrics[k]:.4g}" for label, k in self.keys if k in metrics]
        # The step's own time (rollout to update, `time/step`) and the wall time per step since
        # this process started (what the ETA uses). They differ: a line is printed while the
        # next step runs, and evaluations and checkpoints fall between steps.
        took = metrics.get("time/step", float("nan"))
        average = elapsed / done if done > 0 else float("nan")
        eta_text = format_duration(eta) if math.isfinite(eta) else "?"
        parts += [
            f"took {took:.1f}s" if math.isfinite(took) else "",
            f"{average:.1f}s/step avg" if math.isfinite(average) else "",
            f"ETA {eta_text}",
        ]
        return " | ".join(p for p in parts if p)
