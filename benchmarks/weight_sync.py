"""The weight hand-over of a multi-process run (`ShareEngine.sync_weights`), old against new: per
sync seconds (the first and the steady median), bytes gathered into each process, the most one
device of a process held during a gather, the host memory it added, and compilations.

    python benchmarks/weight_sync.py                                   # tiny + SmolLM2-135M shapes
    python benchmarks/weight_sync.py --models=tiny --devices=1,2 --out=/tmp/weight_sync.json

Each row is its own cluster of 2 real processes on this machine (tests/support/
weight_sync_worker.py: a localhost coordinator, gloo), each with `--devices` CPU devices, the
model's random weights on a (1, all devices, 1) mesh (fsdp across the processes), an embedded
engine per process and `--syncs` updates each followed by a sync. `old` is the hand-over before
issue 36 item 2 (every array replicated on every device of the mesh by a jit built at each call,
kept in the worker for this comparison); `new` is `mmr_jax/distributed/weight_sync.py`.
Times are the slower process's; the 2-core machine may be shared, so they are rough. Memory on
CPU: `rss +MiB` is the growth of the process's peak resident set over the syncs (CPU devices
are host memory); `dev max MiB` is the most bytes one device of a process received in one
gather (old: the whole model on every device).
"""

import pathlib
import sys

from absl import flags

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]
from mmr_jax.infra import bench_harness as harness  # noqa: E402
from mmr_jax.infra import user_errors  # noqa: E402

from support import weight_sync_worker  # noqa: E402

_MODELS = flags.DEFINE_list(
    "models", ["tiny", "smollm2_135m_instruct"], "tiny, or third_party/hf_configs/<name>.json."
)
_DEVICES = flags.DEFINE_list("devices", ["2"], "CPU devices per process, one row set each.")
harness.counts_flag("devices")
_MODES = flags.DEFINE_list("modes", ["full", "lora"], f"Of {weight_sync_worker.MODES}.")
_SYNCS = flags.DEFINE_integer("syncs", 5, "Syncs per row (the first apart, then the median).")
_OUT = flags.DEFINE_string("out", None, "Also write the rows here as JSON.")
_TIMEOUT = flags.DEFINE_integer("timeout_s", 900, "Per row.")
MIB = 2.0**20
COLUMNS = [
    ("model", "model", ""),
    ("devices", "dev/proc", "d"),
    ("mode", "mode", ""),
    ("path", "path", ""),
    ("first_s", "first s", ".3f"),
    ("steady_s", "steady s", ".3f"),
    ("steady_mib", "MiB/sync", ".2f"),
    ("device_mib", "dev max MiB", ".2f"),
    ("rss_mib", "rss +MiB", ".0f"),
    ("compiles", "compiles", "d"),
]


def row(model: str, devices: int, mode: str, path: str) -> dict:
    """One cluster's figures (times: the slower process's; bytes: process 0's)."""
    args = (f"--model={model}", f"--modes={mode}", f"--path={path}", f"--syncs={_SYNCS.value}")
    out = {"model": model, "devices": devices, "mode": mode, "path": path}
    try:
        runs = [r[0] for r in weight_sync_worker.cluster(devices, *args, "--check=0")]
    except (RuntimeError, OSError) as e:
        return {**out, "error": str(e)[-400:]}
    syncs = runs[0]["syncs"]
    return {
        **out,
        "first_s": max(r["first_s"] for r in runs),
        "steady_s": max(r["steady_s"] for r in runs),
        "steady_mib": syncs[-1]["bytes"] / MIB,
        "device_mib": max(s["max_device_bytes"] for s in syncs) / MIB,
        "rss_mib": max(r["rss_peak_mib"] - r["rss_before_mib"] for r in runs),
        "compiles": sum(s["compiles"] for s in syncs),
        "model_mib": runs[0]["model_bytes"] / MIB,
        "processes": runs,
    }


def main(argv):
    del argv
    import os

    rows = []
    for model in _MODELS.value:
        for devices in map(int, _DEVICES.value):
            for mode in _MODES.value:
                for path in ("old", "new"):
                    harness.progress(f"{model} {devices} dev/proc {mode} {path}")
                    rows.append(row(model, devices, mode, path))
    load = os.getloadavg()
    print(
        f"2 processes, {_SYNCS.value} syncs per row; load average {load[0]:.1f} {load[1]:.1f} "
        f"{load[2]:.1f}"
    )
    print(harness.format_table(rows, COLUMNS))
    harness.write_json(_OUT.value, {"rows": rows, "loadavg": load, "syncs": _SYNCS.value})


if __name__ == "__main__":
    user_errors.run(main)
