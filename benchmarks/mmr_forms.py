"""The cosine's forms timed for `bench_mmr.py` (also alone: `--forms_only`): the jitted kernel with
the cosine as it was before the fuzz fixes (unscaled), as the fuzz fixes made it (always scaled)
and as it is now (guarded), interleaved in one process, against the plain NumPy loop.
"""

import jax
import jax.numpy as jnp
import mmr_baselines as baselines  # benchmarks/, beside this file
import numpy as np

from mmr_jax.algorithms import mmr
from mmr_jax.infra import bench_harness as harness


def bench_forms(b, g, d, args, rounds=5):
    """Best ms of each cosine form over interleaved rounds, and each one's speed-up over the
    plain NumPy loop, in this process; the forms' outputs agree on this data."""
    r, e = baselines.data(b, g, d)
    rj, ej = jnp.asarray(r), jnp.asarray(e)
    forms = {
        "unscaled (before the fuzz fixes)": baselines.kernel_with(baselines.unscaled_cosine),
        "always scaled (fuzz fixes)": baselines.kernel_with(baselines.always_scaled_cosine),
        "guarded (now)": jax.jit(mmr.mmr_reweight),
    }
    outs = [np.asarray(f(rj, ej)) for f in forms.values()]
    for out in outs[1:]:
        np.testing.assert_allclose(out, outs[0], rtol=0, atol=1e-5)
    best = dict.fromkeys(forms, float("inf"))
    for _ in range(rounds):  # interleaved: a burst of load on the shared machine hits all forms
        for name, f in forms.items():
            t = harness.best_of(lambda f=f: jax.block_until_ready(f(rj, ej)), min_total=0.1)[0]
            best[name] = min(best[name], t)
    n_plain = min(b, args.max_plain_groups)
    loop = lambda: [baselines.numpy_plain_loop(r[i], e[i]) for i in range(n_plain)]
    t_plain = harness.best_of(loop, min_reps=3)[0] * b / n_plain
    return {
        "B": b,
        "G": g,
        "D": d,
        "numpy_plain_ms": 1e3 * t_plain,
        "forms_ms": {k: 1e3 * v for k, v in best.items()},
        "forms_speedup_vs_numpy_plain": {k: t_plain / v for k, v in best.items()},
    }


def print_forms(row):
    """The forms' times, each against the plain loop and the unscaled form."""
    print(
        f"cosine forms, B={row['B']} G={row['G']} D={row['D']} (one device, one process, "
        f"best of interleaved rounds; plain NumPy loop {row['numpy_plain_ms']:.1f} ms):"
    )
    base = row["forms_ms"]["unscaled (before the fuzz fixes)"]
    for name, ms in row["forms_ms"].items():
        print(
            f"  {name:<34} {ms:7.3f} ms  {row['forms_speedup_vs_numpy_plain'][name]:6.1f}x "
            f"the plain loop  {ms / base:5.2f}x the unscaled time"
        )
