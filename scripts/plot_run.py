"""Training curves from `metrics.jsonl` to PNG; several runs overlaid for comparison.

    python scripts/plot_run.py runs/cpu_smollm2 --out=runs/cpu_smollm2/curves.png
    python scripts/plot_run.py runs/grpo_7b runs/mmr_grpo_7b --labels=GRPO,MMR-GRPO --out=cmp.png
    python scripts/plot_run.py runs/x --metrics=reward/mean,kl --smooth=0.6 --out=x.png
    python scripts/plot_run.py s/grpo_s1 s/grpo_s2 s/mmr_grpo_s1 s/mmr_grpo_s2 --bands \\
        --labels=GRPO,GRPO,MMR-GRPO,MMR-GRPO --metrics=eval/average/pass@1 --out=study.png

Each argument is a workdir (or a metrics.jsonl file). One panel per metric; each run one colour.
With --bands, runs sharing a label (seeds of one variant) become one mean curve over the steps
they all logged, with a min-max band; the legend gives the number of runs.
"""

from __future__ import annotations

import math
import os
import pathlib
import sys

from absl import app, flags

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from mmr_jax.infra import metrics as metrics_lib
from mmr_jax.infra import user_errors

_OUT = flags.DEFINE_string("out", "curves.png", "PNG file to write.")
_METRICS = flags.DEFINE_list("metrics", [], "Metrics to draw (default: the standard set present).")
_LABELS = flags.DEFINE_list("labels", [], "One legend label per run (default: folder names).")
_SMOOTH = flags.DEFINE_float("smooth", 0.0, "EMA smoothing in [0, 1) drawn over the raw curve.")
_BANDS = flags.DEFINE_bool("bands", False, "Mean curve + min-max band per label (seeds).")

DEFAULT_METRICS = (
    "reward/mean",
    "reward/*/mean",
    "reward/reweighted_mean",
    "mmr/lambda_mean",
    "groups/zero_variance_frac",
    "kl",
    "loss",
    "entropy",
    "clip/frac",
    "completion/length_mean",
    "completion/truncated_frac",
    "grad_norm",
    "lr",
    "time/step",
    "eval/average/pass@1",
)


class NoMetricsError(user_errors.UserError, FileNotFoundError):
    """A run folder (or file) without metrics."""


class PlotArgumentError(user_errors.UserError, ValueError):
    """--labels or --metrics that do not fit the runs."""


def _none_present(wanted, runs) -> str:
    present = sorted({k for rows in runs for row in rows for k in row if k != "step"})
    return (
        f"none of the metrics {list(wanted)} is in the runs; they log: {present} "
        "(--metrics=<name>,<name>)"
    )


def load_run(path) -> list[dict]:
    """Rows of a run's metrics (a workdir or a metrics.jsonl), the last row per step kept."""
    path = pathlib.Path(path)
    if path.is_dir():
        path = path / metrics_lib.METRICS_FILE
    if not path.exists():
        raise NoMetricsError(
            f"no metrics file at {path}; give a run folder (a --workdir) or its metrics.jsonl"
        )
    by_step = {}
    for row in metrics_lib.read_jsonl(path):
        by_step.setdefault(row["step"], {}).update(row)
    return [by_step[s] for s in sorted(by_step)]


def select_metrics(runs: list[list[dict]], wanted=DEFAULT_METRICS) -> list[str]:
    """Names in `wanted` present in any run, expanding 'a/*/b' patterns."""
    present = sorted({k for rows in runs for row in rows for k in row if k != "step"})
    out = []
    for pattern in wanted:
        if "*" in pattern:
            head, tail = pattern.split("*", 1)
            for k in present:
                middle = k[len(head) : len(k) - len(tail)]
                if k.startswith(head) and k.endswith(tail) and middle and "/" not in middle:
                    out.append(k)
        elif pattern in present:
            out.append(pattern)
    return list(dict.fromkeys(out))


def _ema(values: list[float], alpha: float) -> list[float]:
    out, acc = [], None
    for v in values:
        acc = v if acc is None or not math.isfinite(acc) else alpha * acc + (1 - alpha) * v
        out.append(acc)
    return out


def _step_axis(ax) -> None:
    """Steps are whole numbers: ticks only at integers (a 4-step run otherwise shows 1.5, 2.5)."""
    from matplotlib import ticker

    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(ticker.MaxNLocator(integer=True))


def plot(run_paths, out, *, metrics=(), labels=(), smooth: float = 0.0) -> list[str]:
    """Draws the runs' curves into `out` (PNG); returns the metric names drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [load_run(p) for p in run_paths]
    labels = list(labels) or [os.path.basename(os.path.normpath(str(p))) for p in run_paths]
    if len(labels) != len(runs):
        raise PlotArgumentError(
            f"--labels gives {len(labels)} labels for {len(runs)} runs; give one per run"
        )
    names = select_metrics(runs, metrics or DEFAULT_METRICS)
    if not names:
        raise PlotArgumentError(_none_present(metrics or DEFAULT_METRICS, runs))
    cols = min(3, len(names))
    rows = math.ceil(len(names) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.2 * rows), squeeze=False)
    for ax, name in zip(axes.flat, names, strict=False):
        for i, (rows_, label) in enumerate(zip(runs, labels, strict=True)):
            pts = [
                (r["step"], float(r[name])) for r in rows_ if isinstance(r.get(name), int | float)
            ]
            if not pts:
                continue
            xs, ys = zip(*pts, strict=True)
            color = f"C{i}"
            if smooth > 0:
                ax.plot(xs, ys, color=color, alpha=0.3, linewidth=1)
                ax.plot(xs, _ema(list(ys), smooth), color=color, label=label, linewidth=1.8)
            else:
                ax.plot(xs, ys, color=color, label=label, marker="." if len(xs) < 40 else None)
        ax.set_title(name, fontsize=10)
        _step_axis(ax)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(names) :]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=8)
    fig.tight_layout()
    pathlib.Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return names


def mean_band(runs: list[list[dict]], name: str) -> tuple[list[int], list[float], list, list]:
    """(steps logged by every run, mean, min, max over the runs) of metric `name`."""
    series = [
        {r["step"]: float(r[name]) for r in rows if isinstance(r.get(name), int | float)}
        for rows in runs
    ]
    steps = sorted(set.intersection(*(set(s) for s in series))) if series else []
    cols = [[s[step] for s in series] for step in steps]
    return steps, [sum(c) / len(c) for c in cols], [min(c) for c in cols], [max(c) for c in cols]


def plot_bands(run_paths, labels, out, *, metrics=("eval/average/pass@1",)) -> list[str]:
    """One mean curve with a min-max band per distinct label (runs of a label: its seeds)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if len(labels) != len(run_paths):
        raise PlotArgumentError(
            f"--labels gives {len(labels)} labels for {len(run_paths)} runs; give one per run"
        )
    groups: dict[str, list] = {}
    for path, label in zip(run_paths, labels, strict=True):
        groups.setdefault(label, []).append(load_run(path))
    names = select_metrics([r for g in groups.values() for r in g], metrics)
    if not names:
        raise PlotArgumentError(_none_present(metrics, [r for g in groups.values() for r in g]))
    fig, axes = plt.subplots(1, len(names), figsize=(6 * len(names), 4), squeeze=False)
    for ax, name in zip(axes.flat, names, strict=True):
        for i, (label, runs) in enumerate(groups.items()):
            steps, mean, lo, hi = mean_band(runs, name)
            if not steps:
                continue
            ax.plot(steps, mean, color=f"C{i}", marker=".", label=f"{label} (n={len(runs)})")
            ax.fill_between(steps, lo, hi, color=f"C{i}", alpha=0.2, linewidth=0)
        ax.set_title(f"{name}: mean, band min-max", fontsize=10)
        _step_axis(ax)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    pathlib.Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return names


def main(argv):
    if len(argv) < 2:
        raise app.UsageError("give one or more run folders (or metrics.jsonl files)")
    if _BANDS.value:
        names = plot_bands(
            argv[1:], _LABELS.value, _OUT.value, metrics=_METRICS.value or ("eval/average/pass@1",)
        )
    else:
        names = plot(
            argv[1:], _OUT.value, metrics=_METRICS.value, labels=_LABELS.value, smooth=_SMOOTH.value
        )
    print(f"wrote {_OUT.value}: {', '.join(names)}")


if __name__ == "__main__":
    user_errors.run(main)
