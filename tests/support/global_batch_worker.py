"""One process of tests/distributed/global_arrays_test.py: places a host batch with
`distributed.global_batch` and prints what each of its devices received, as one JSON line.

    python global_batch_worker.py MODE [COORDINATOR PROCESSES ID]

MODE 'same': every process holds the same host batch; 'differ': process 1's advantages differ in
one row (every process must then stop with `BatchMismatchError`); 'reduce': no batch, the
process's `distributed.reduce_metrics` of `process_metrics(index)` instead.
"""

from __future__ import annotations

import json
import sys

import numpy as np


def host_batch(perturb: bool = False) -> dict:
    """8 rows of each layout field, and a [3, 5] field whose rows do not split over 2 devices."""
    rng = np.random.default_rng(0)
    out = {
        "tokens": rng.integers(0, 100, (8, 6)).astype(np.int32),
        "completion_mask": rng.random((8, 6)) > 0.3,
        "advantages": rng.standard_normal(8).astype(np.float32),
        "odd_rows": rng.standard_normal((3, 5)).astype(np.float32),
    }
    if perturb:
        out["advantages"][5] = np.nextafter(out["advantages"][5], np.float32(np.inf))
    return out


def process_metrics(index: int) -> dict[str, float]:
    """Process `index`'s metrics: a time, a batch metric and a value float32 cannot hold."""
    return {
        "time/step": [3.0, 7.5, 1.25][index],
        "loss": [0.1, 0.2, 0.6][index],
        "reward/mean": 1.0 + [1e-12, 3e-12, 0.0][index],
    }


def main(argv: list[str]) -> None:
    mode = argv[0]
    import jax

    if len(argv) > 1:
        from mmr_jax import distributed

        opts = distributed.options_from_flags(
            distributed="off",
            coordinator_address=argv[1],
            num_processes=int(argv[2]),
            process_id=int(argv[3]),
            timeout_s=120,
            heartbeat_s=600,
        )
        distributed.initialize(opts)
    from mmr_jax import distributed
    from mmr_jax.models import sharding

    if mode == "reduce":
        reduced = distributed.reduce_metrics(process_metrics(jax.process_index()))
        print("RESULT " + json.dumps({"process": jax.process_index(), "reduced": reduced}))
        return
    mesh = sharding.make_mesh(1, -1, 1)
    host = host_batch(perturb=mode == "differ" and jax.process_index() == 1)
    result = {"process": jax.process_index()}
    try:
        dev = distributed.global_batch(host, mesh)
    except distributed.BatchMismatchError as e:
        result["error"] = f"BatchMismatchError: {e}"
    else:
        result["fields"] = {
            k: {
                "spec": str(x.sharding.spec),
                "global_shape": list(x.shape),
                "shards": [
                    {
                        "device": s.device.id,
                        "rows": [s.index[0].start or 0, s.index[0].stop or x.shape[0]],
                        "equal": bool(np.array_equal(np.asarray(s.data), host[k][s.index])),
                        "shape": list(s.data.shape),
                    }
                    for s in x.addressable_shards
                ],
            }
            for k, x in dev.items()
        }
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
