"""Benchmark MMR reweighting: jitted + vmapped JAX vs two NumPy loops and a PyTorch port of the
released per-micro-batch loop, in one run.

    python benchmarks/bench_mmr.py            # B x G x D = {32,256,1024} x {6,16,64} x {384,512}
    python benchmarks/bench_mmr.py --quick    # B x G x D = {32,256} x {6,16} x {512}
    python benchmarks/bench_mmr.py --json out.json
    python benchmarks/bench_mmr.py --forms_only   # the cosine's forms alone (seconds; issue 27 #9)

Baselines (benchmarks/mmr_baselines.py), all per group in a Python loop over groups:
  plain  Algorithm 1 as the paper writes it (best_sim recomputed over S each step: O(G^3)).
  vec    the same rule with NumPy vector ops over candidates and an incremental best similarity
         (O(G^2)): a deliberately strong baseline.
  torch  own port of the released code's loop, run over a micro-batch of --torch_prompts_per_call
         prompts (P * G completions, one O((PG)^2) greedy loop), reported per group-equivalent
         (call time / P), on one torch thread (its ops are tiny).
The "max x vec" column divides vec's time by the Gram floor, torch's batched matmul of the B
[G, D] x [D, G] products on every core: every implementation pays it, so it bounds the speed-up
any kernel can show over vec on this machine.

The JAX kernel runs with one CPU device per core (--cpu_devices, default all cores) and the B
groups sharded over them (jit partitions the vmapped kernel, every group stays on one device);
"1-dev" is the same kernel on one device, in the same run. XLA:CPU runs the batched Gram products
of one program on one core, so the sharding is what puts the second core to work.

Cosine forms (B=256, G=16, D=512 by default, --forms_cell): the same jitted kernel with the cosine
as it was before the fuzz fixes (unscaled: overflows at row norms ~1e19), as the fuzz fixes made it
(every row max-abs scaled on every call), and as it is now (unscaled, with the scaled form only
when a row is huge, tiny or zero), timed interleaved in one process against the plain NumPy loop
(benchmarks/mmr_forms.py).

Throughput is groups (prompts) per second from the best of repeated timed calls after a warm-up
(compilation excluded; JAX timed with block_until_ready, default XLA CPU threads); the JSON also
holds the medians. The per-step figure is a median. The Python baselines time at most
--max_plain_groups / --max_baseline_groups groups per cell and extrapolate linearly to B (marked
`*` in the table).
"""

import os

import jax
import jax.numpy as jnp
import mmr_baselines as baselines  # benchmarks/, beside this file
import mmr_forms  # benchmarks/, beside this file: the cosine's forms

from mmr_jax.algorithms import mmr
from mmr_jax.infra import bench_harness as harness
from mmr_jax.models import sharding

IMPLS = ("jax", "jax_1dev", "numpy_plain", "numpy_vectorised", "torch")
COLUMNS = [
    ("B", "B", ""), ("G", "G", ""), ("D", "D", ""),
    ("jax_groups_per_s", "jax grp/s", ".0f"), ("jax_1dev_groups_per_s", "1-dev", ".0f"),
    ("numpy_plain_groups_per_s", "plain grp/s", ".0f"),
    ("numpy_vectorised_groups_per_s", "vec grp/s", ".0f"),
    ("torch_groups_per_s", "torch grp/s", ".0f"),
    ("extrapolated", "", ""),
    ("speedup_vs_numpy_plain", "x plain", ".1f"), ("speedup_1dev_vs_numpy_plain", "1-dev", ".1f"),
    ("speedup_vs_numpy_vectorised", "x vec", ".1f"), ("speedup_vs_torch", "x torch", ".1f"),
    ("max_speedup_vs_numpy_vectorised", "max x vec", ".1f"),
]  # fmt: skip


_mmr_jit = jax.jit(mmr.mmr_reweight)


def bench_cell(b, g, d, args, mesh):
    """One B x G x D cell: every implementation's (best, median) seconds for the B groups."""
    import torch

    r, e = baselines.data(b, g, d)
    rj, ej = jnp.asarray(r), jnp.asarray(e)
    t = {"jax_1dev": harness.best_of(lambda: jax.block_until_ready(_mmr_jit(rj, ej)))}
    ways = sharding.batch_size(mesh) if b % sharding.batch_size(mesh) == 0 else 1
    t["jax"] = t["jax_1dev"]
    if ways > 1:
        rs, es = (jax.device_put(x, sharding.batch_sharding(mesh)) for x in (r, e))
        t["jax"] = harness.best_of(lambda: jax.block_until_ready(_mmr_jit(rs, es)))

    def per_group_loop(fn, n):
        best, med = harness.best_of(lambda: [fn(r[i], e[i]) for i in range(n)], min_reps=3)
        return best * b / n, med * b / n

    n_plain, n_vec = min(b, args.max_plain_groups), min(b, args.max_baseline_groups)
    t["numpy_plain"] = per_group_loop(baselines.numpy_plain_loop, n_plain)
    t["numpy_vectorised"] = per_group_loop(baselines.numpy_vectorised, n_vec)
    p = args.torch_prompts_per_call
    calls = max(1, min(b // p, args.max_baseline_groups // p))
    rt, et = torch.from_numpy(r), torch.from_numpy(e)

    def run_torch():
        for c in range(calls):
            sl = slice(c * p, (c + 1) * p)
            baselines.torch_released(rt[sl].reshape(-1), et[sl].reshape(-1, d))

    torch.set_num_threads(1)
    t["torch"] = tuple(x * b / (calls * p) for x in harness.best_of(run_torch, min_reps=3))
    # The floor any implementation pays: the B Gram matrices (B*G*G*D multiply-adds), timed as
    # torch's batched matmul on every core; the best ratio to a baseline is baseline / floor.
    torch.set_num_threads(args.gram_threads)
    et_t = et.transpose(1, 2).contiguous()
    t_gram = harness.best_of(lambda: torch.bmm(et, et_t))[0]
    torch.set_num_threads(1)
    row = {"B": b, "G": g, "D": d, "jax_devices": ways}
    row |= {f"{k}_s": t[k][0] for k in IMPLS} | {"gram_floor_s": t_gram}
    row |= {f"{k}_median_s": t[k][1] for k in IMPLS}
    row |= {f"{k}_groups_per_s": b / t[k][0] for k in IMPLS}
    best = {k: v[0] for k, v in t.items()}
    return row | {
        "speedup_vs_numpy_plain": best["numpy_plain"] / best["jax"],
        "speedup_1dev_vs_numpy_plain": best["numpy_plain"] / best["jax_1dev"],
        "speedup_vs_numpy_vectorised": best["numpy_vectorised"] / best["jax"],
        "speedup_vs_torch": best["torch"] / best["jax"],
        "max_speedup_vs_numpy_vectorised": best["numpy_vectorised"] / t_gram,
        "baseline_extrapolated": n_plain < b or n_vec < b or calls * p < b,
    }


def bench_step(args):
    """Per-training-step cost at B=8, G=6, D=512: kernel on device arrays and the host entry."""
    r, e = baselines.data(8, 6, args.step_dim)
    rj, ej = jnp.asarray(r), jnp.asarray(e)
    kernel = lambda: jax.block_until_ready(_mmr_jit(rj, ej))
    entry = lambda: jax.block_until_ready(mmr.reweight("mmr", r, e))
    return {
        "B": 8,
        "G": 6,
        "D": args.step_dim,
        "kernel_ms": 1e3 * harness.best_of(kernel, max_reps=5000)[1],
        "host_entry_ms": 1e3 * harness.best_of(entry, max_reps=5000)[1],
    }


FLAGS = {
    "quick": (False, "small grid"),
    "max_baseline_groups": (64, "vec and torch groups timed (then x B)"),
    "max_plain_groups": (16, "plain-loop groups timed (then x B)"),
    "torch_prompts_per_call": (4, "prompts per released-code call"),
    "gram_threads": (os.cpu_count(), "torch threads for the floor"),
    "step_dim": (512, "D of the per-step timing (B=8, G=6)"),
    "cpu_devices": (0, "JAX CPU devices (0 = one per core)"),
    "forms_only": (False, "time only the cosine's forms, then exit"),
    "forms_cell": ("256,16,512", "B,G,D of the forms' timing"),
}


def _args():
    args, ap = harness.parse_args(__doc__.splitlines()[0], FLAGS)
    args.forms_cell = tuple(int(x) for x in args.forms_cell.split(","))
    if len(args.forms_cell) != 3:
        ap.error(f"--forms_cell must be B,G,D, got {args.forms_cell!r}")
    return args


def main():
    import torch

    args = _args()
    if args.forms_only:
        forms = mmr_forms.bench_forms(*args.forms_cell, args)
        print(f"jax {jax.__version__}, {jax.devices()[0].platform}")
        mmr_forms.print_forms(forms)
        harness.write_json(args.json, {"forms": forms})
        return
    devices = sharding.use_cpu_cores_as_devices(args.cpu_devices or None)
    mesh = sharding.data_parallel_mesh()
    grid = (
        ((32, 256), (6, 16), (512,)) if args.quick else ((32, 256, 1024), (6, 16, 64), (384, 512))
    )
    print(
        f"jax {jax.__version__} on {devices} {jax.devices()[0].platform} devices (B sharded), "
        f"torch {torch.__version__}"
    )
    rows = []
    for b in grid[0]:
        for g in grid[1]:
            for d in grid[2]:
                rows.append(bench_cell(b, g, d, args, mesh))
                rows[-1]["extrapolated"] = "*" if rows[-1]["baseline_extrapolated"] else ""
                harness.progress(f"B={b} G={g} D={d} done")
    print(harness.format_table(rows, COLUMNS))
    print(
        "best of repeated calls; * baselines timed on a subset of groups, extrapolated to B\n"
        f"jax: B sharded over {devices} CPU devices; 1-dev: the same kernel on one device\n"
        "plain: Algorithm 1 as written (O(G^3) per group); vec: NumPy with vector ops and an\n"
        "incremental best similarity; torch: port of the released per-micro-batch loop;\n"
        "max x vec: vec time / the Gram floor (torch.bmm of the B Gram matrices on every core),\n"
        "the most any implementation could gain over vec on this machine"
    )
    forms = mmr_forms.bench_forms(*args.forms_cell, args)
    mmr_forms.print_forms(forms)
    step = bench_step(args)
    print(
        f"per training step (B=8, G=6, D={step['D']}): kernel {step['kernel_ms']:.3f} ms, "
        f"host entry with validation {step['host_entry_ms']:.3f} ms (target < 1 ms)"
    )
    for t in (x for x in rows if (x["B"], x["G"], x["D"]) == (256, 16, 512)):
        print(
            f"B=256, G=16, D=512: {t['speedup_vs_numpy_plain']:.1f}x the plain NumPy loop "
            f"(target >= 50x; {t['speedup_1dev_vs_numpy_plain']:.1f}x on one device); "
            f"{t['speedup_vs_numpy_vectorised']:.1f}x the vectorised NumPy "
            f"(at most {t['max_speedup_vs_numpy_vectorised']:.1f}x here)"
        )
    for row in rows:
        del row["extrapolated"]
    out = {"cells": rows, "forms": forms, "step": step}
    out |= {"torch_prompts_per_call": args.torch_prompts_per_call, "jax_cpu_devices": devices}
    harness.write_json(args.json, out)


if __name__ == "__main__":
    harness.run(main)
