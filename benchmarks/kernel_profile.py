"""Per-kernel device time from a `jax.profiler` trace, by category (matmul, transpose, ...).

`jax.profiler.trace(dir, create_perfetto_trace=True)` writes
`dir/plugins/profile/<run>/perfetto_trace.json.gz` (Chrome trace-event JSON, converted from the
run's `.xplane.pb`; jax 0.10 and 0.11 both write it). On a GPU the kernels are the complete
events ('X') of the device's process (`/device:GPU:0`), on its stream threads ('Stream #...');
the derived threads there ('XLA Ops', 'XLA Modules', 'Steps') cover the same time again and
are left out. On the CPU (no device process) the XLA thunks of the XLA:CPU threads stand in,
so the table can be checked here; its shares mean less (thunks nest and overlap).

`category` is a pure function of a kernel's name: XLA names a fusion after its root
instruction (`loop_transpose_fusion`, `input_concatenate_fusion`, `loop_pad_fusion`,
`input_reduce_fusion`), cuBLAS/CUTLASS name their GEMMs (`nvjet_...`, `cutlass_80_tensorop_...`,
`sm90_xmma_gemm_...`), cuDNN its fused attention (`cudnn_generated_fort_native_sdpa...`).
"""

from __future__ import annotations

import collections
import gzip
import json
import pathlib
import re

CATEGORIES = (
    "matmul",
    "attention",
    "transpose",
    "concatenate",
    "reduce",
    "pad",
    "select/convert/slice",
    "other",
)
# First match wins, in this order: a GEMM fusion that ends in a transpose is a GEMM.
_RULES = (
    ("attention", r"fmha|flash|sdpa|cudnn.*(attn|attention)|fused_attention|splash|mha_"),
    (
        "matmul",
        r"gemm|nvjet|cutlass|xmma|wgmma|cublas|tensorop|\bdot\b|_dot|dot_|matmul|convolution",
    ),
    ("transpose", r"transpose"),
    ("concatenate", r"concatenate|concat"),
    ("pad", r"(^|_)pad(_|$)|pad_fusion"),
    ("reduce", r"reduce|reduction|argmax|argmin|softmax"),
    ("select/convert/slice", r"select|convert|slice|bitcast|dynamic_update"),
)
_COMPILED = tuple((cat, re.compile(rx)) for cat, rx in _RULES)
# Thread names on a device process that repeat the stream's time (xprof's derived lines).
_DERIVED = ("XLA Ops", "XLA Modules", "Steps", "Framework", "Source", "TensorFlow", "Launch")


def category(kernel_name: str) -> str:
    """The category of one kernel (or XLA:CPU thunk) by its name; 'other' when none applies."""
    name = kernel_name.lower()
    for cat, rx in _COMPILED:
        if rx.search(name):
            return cat
    return "other"


def find_trace(folder: str | pathlib.Path) -> pathlib.Path:
    """The newest perfetto trace under a `jax.profiler.trace` folder."""
    found = sorted(
        pathlib.Path(folder).rglob("perfetto_trace.json.gz"), key=lambda p: p.stat().st_mtime
    )
    if not found:
        raise FileNotFoundError(f"no perfetto_trace.json.gz under {folder}")
    return found[-1]


def kernel_events(trace: dict | list) -> tuple[list[tuple[str, float]], str]:
    """[(kernel name, microseconds)] of a trace's device kernels, and where they came from
    ('device' or 'cpu')."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    procs, threads = {}, {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            procs[e["pid"]] = e.get("args", {}).get("name", "")
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            threads[(e["pid"], e["tid"])] = e.get("args", {}).get("name", "")
    device = {pid for pid, name in procs.items() if name.startswith("/device:")}
    out = []
    for e in events:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        thread = threads.get((e["pid"], e.get("tid")), "")
        if device:
            if e["pid"] in device and not thread.startswith(_DERIVED):
                out.append((e["name"], float(e["dur"])))
        elif thread.startswith("tf_XLA") and not _host_bookkeeping(e["name"]):
            out.append((e["name"], float(e["dur"])))
    return out, "device" if device else "cpu"


def _host_bookkeeping(name: str) -> bool:
    return "::" in name or name.startswith(("end: ", "$")) or name in ("ThunkExecutor",)


def table(kernels: list[tuple[str, float]], *, top: int = 25) -> dict:
    """Device time by category (ms and share) and the `top` kernels by time."""
    by_cat = collections.Counter()
    by_name = collections.Counter()
    counts = collections.Counter()
    for name, us in kernels:
        by_cat[category(name)] += us
        by_name[name] += us
        counts[name] += 1
    total = sum(by_cat.values())
    return {
        "total_ms": total / 1e3,
        "kernels": len(kernels),
        "categories": {
            c: {"ms": by_cat[c] / 1e3, "share": by_cat[c] / total if total else 0.0}
            for c in CATEGORIES
        },
        "layout_share": sum(by_cat[c] for c in ("transpose", "concatenate", "pad")) / total
        if total
        else 0.0,
        "top": [
            {"name": n, "ms": us / 1e3, "calls": counts[n], "category": category(n)}
            for n, us in by_name.most_common(top)
        ],
    }


def profile_table(folder: str | pathlib.Path, *, steps: int = 1) -> dict:
    """The table of the trace under `folder`, times per step (the trace held `steps` steps)."""
    path = find_trace(folder)
    with gzip.open(path, "rt") as f:
        kernels, source = kernel_events(json.load(f))
    result = table([(n, us / steps) for n, us in kernels])
    result.update(source=source, trace=str(path), steps=steps)
    return result


def format_table(result: dict) -> str:
    lines = [f"device time per step {result['total_ms']:.2f} ms ({result['source']} events):"]
    for c, v in result["categories"].items():
        lines.append(f"  {c:<22s} {v['ms']:10.3f} ms  {v['share']:6.1%}")
    lines.append(f"  transpose + concatenate + pad: {result['layout_share']:.1%}")
    for k in result["top"][:10]:
        lines.append(
            f"    {k['ms']:9.3f} ms  {k['calls']:4d}x  {k['category']:<14s} {k['name'][:70]}"
        )
    return "\n".join(lines)
