"""Is a change slower? The same benchmark run from two commits of this repo, alternately.

    python benchmarks/alternate_trees.py --old=f70c7c1 --new=HEAD --pairs=13 \\
        --old_cmd="scripts/bench_train_step.py --shapes=cpu_default --rounds=5" \\
        --new_cmd="benchmarks/bench_train_step.py --shapes=cpu_default --rounds=5 --paths=packed" \\
        --metric=cpu_default.packed.ms_per_step --json=out.json

On a shared machine one run of a tree spreads wider than the few percent a change may cost, so
a single old-then-new pair says little. This runs old, new, old, new, ... (`--pairs` pairs), each
run a fresh process in its own `git archive` of its commit (the working tree is never used:
uncommitted edits are not measured), reads one number per run from the `--json` the benchmark
writes (`--metric`, a dotted path into it), and reports per pair new / old and over the pairs
the geometric-mean ratio with a t interval on the log ratios and the exact sign-flip p-value
(`studies.paired_stats`). Each side's `checkpoints/` is a link to this checkout's. The load
average is printed before each run: runs taken under load measure the load.

Both commands run with this interpreter; `--json=<file>` is appended to each.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import shlex
import subprocess
import sys
import tempfile

_REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(_REPO))
from mmr_jax.infra import bench_harness as harness  # noqa: E402
from mmr_jax.studies import paired_stats  # noqa: E402

FLAGS = {
    "old": ("", "the baseline commit (any git revision)"),
    "new": ("HEAD", "the commit measured against it"),
    "old_cmd": ("", "the benchmark and its flags in the old tree (a path relative to its root)"),
    "new_cmd": ("", "the same in the new tree (default: --old_cmd)"),
    "metric": ("", "dotted path of the number to compare in the benchmark's JSON"),
    "pairs": (5, "old/new pairs, run alternately"),
    "timeout_s": (1800.0, "stop a run after this long (its pair is then an error)"),
}
COLUMNS = [
    ("pair", "pair", ""),
    ("old", "old", ",.1f"),
    ("new", "new", ",.1f"),
    ("ratio", "new / old", ".3f"),
    ("load", "load (old, new)", ""),
]


def archive(rev: str, into: pathlib.Path) -> pathlib.Path:
    """`git archive` of `rev` unpacked under `into`, with this checkout's checkpoints linked."""
    sha = subprocess.run(
        ["git", "rev-parse", "--verify", f"{rev}^{{commit}}"],
        cwd=_REPO, capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    root = into / sha[:12]
    if not root.exists():
        root.mkdir(parents=True)
        tar = subprocess.Popen(["git", "archive", sha], cwd=_REPO, stdout=subprocess.PIPE)
        subprocess.run(["tar", "-x", "-C", str(root)], stdin=tar.stdout, check=True)
        if tar.wait():
            raise RuntimeError(f"git archive {sha} failed")
        if (_REPO / "checkpoints").exists():
            (root / "checkpoints").symlink_to((_REPO / "checkpoints").resolve())
    return root


def pick(obj, dotted: str) -> float:
    """The number at `dotted` ('a.b.c') in a JSON object; a clear error naming what is there."""
    for part in dotted.split("."):
        if not isinstance(obj, dict) or part not in obj:
            have = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
            raise KeyError(f"--metric {dotted}: no {part!r} (there: {have})")
        obj = obj[part]
    return float(obj)


def run_once(root: pathlib.Path, cmd: str, metric: str, timeout_s: float) -> float:
    """Runs `cmd` in `root` with --json to a temporary file; returns the metric's value."""
    with tempfile.TemporaryDirectory() as tmp:
        out = pathlib.Path(tmp) / "out.json"
        argv = [sys.executable, *shlex.split(cmd), f"--json={out}"]
        proc = subprocess.run(argv, cwd=root, capture_output=True, text=True, timeout=timeout_s)
        if proc.returncode or not out.exists():
            tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-15:])
            raise RuntimeError(f"{' '.join(argv)} in {root} exited {proc.returncode}:\n{tail}")
        return pick(json.loads(out.read_text()), metric)


def summarize(pairs: list[dict]) -> dict:
    """Geometric-mean new/old ratio, its t interval and the exact sign-flip p (on log ratios)."""
    logs = [math.log(p["new"] / p["old"]) for p in pairs]
    out = {"n": len(logs), "ratio": math.exp(sum(logs) / len(logs)) if logs else None}
    interval = paired_stats.t_interval(logs)
    if interval is not None:
        out["ratio_low"], out["ratio_high"] = math.exp(interval["low"]), math.exp(interval["high"])
    out["sign_flip_p"] = paired_stats.sign_flip_p(logs) if logs else None
    return out


def main(argv=None) -> None:
    args, _ = harness.parse_args(__doc__, FLAGS, argv)
    if not (args.old and args.old_cmd and args.metric):
        raise SystemExit("--old, --old_cmd and --metric are required")
    if args.pairs < 2:
        raise SystemExit(f"--pairs={args.pairs}: at least 2 pairs for an interval")
    new_cmd = args.new_cmd or args.old_cmd
    pairs = []
    with tempfile.TemporaryDirectory(prefix="alternate_trees_") as tmp:
        roots = {side: archive(getattr(args, side), pathlib.Path(tmp)) for side in ("old", "new")}
        for i in range(1, args.pairs + 1):
            row = {"pair": i}
            loads = []
            for side, cmd in (("old", args.old_cmd), ("new", new_cmd)):
                loads.append(f"{os.getloadavg()[0]:.1f}")
                harness.progress(f"pair {i}/{args.pairs}: {side} (load {loads[-1]})")
                row[side] = run_once(roots[side], cmd, args.metric, args.timeout_s)
            row["ratio"], row["load"] = row["new"] / row["old"], ", ".join(loads)
            pairs.append(row)
    stats = summarize(pairs)
    print(harness.format_table(pairs, COLUMNS))
    print(
        f"{args.metric}: new / old {stats['ratio']:.4f}, 95% t interval "
        f"[{stats['ratio_low']:.4f}, {stats['ratio_high']:.4f}], exact sign-flip p "
        f"{stats['sign_flip_p']:.4f} (n = {stats['n']} pairs)"
    )
    harness.write_json(args.json, {"args": vars(args), "pairs": pairs, "summary": stats})


if __name__ == "__main__":
    harness.run(main)
