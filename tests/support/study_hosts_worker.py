"""One study process of a study on several "hosts" (local processes, a real JAX cluster), whose
runs' children run a small body of this file instead of a training: `on_hosts.start`, then
`on_hosts.run`, as scripts/study.py does. tests/studies/on_hosts_test.py launches it.

    python tests/support/study_hosts_worker.py --folder=F --body=joins_cluster \\
        --coordinator_address=localhost:PORT --num_processes=2 --process_id=I [--lr=0.002]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys

BODIES = ("joins_cluster", "fails_on_process_1")


def _gather_twice(workdir, *, fail: bool) -> None:
    """Two all-gathers over the run's cluster (the first connects the processes), then writes
    what this process saw to <workdir>/process<i>.json; `fail`: process 1 raises between the
    two in run mmr_grpo_s1 (as in the middle of a step)."""
    import jax
    import numpy as np

    from mmr_jax import distributed

    index = jax.process_index()
    first = distributed.allgather(np.array([index], np.int32))
    if fail and index == 1 and pathlib.Path(workdir).name == "mmr_grpo_s1":
        raise RuntimeError("injected failure of process 1 in run mmr_grpo_s1")
    second = distributed.allgather(np.array([10 + index], np.int32))
    seen = {
        "processes": jax.process_count(),
        "gathered": [first[:, 0].tolist(), second[:, 0].tolist()],
        "pid": os.getpid(),
    }
    folder = pathlib.Path(workdir)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"process{index}.json").write_text(json.dumps(seen))


# Run bodies, in the runs' children (which joined the run's cluster before calling them).
def joins_cluster(cfg, workdir):
    del cfg
    _gather_twice(workdir, fail=False)


def fails_on_process_1(cfg, workdir):
    del cfg
    _gather_twice(workdir, fail=True)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--folder", required=True)
    parser.add_argument("--body", choices=BODIES, required=True)
    parser.add_argument("--coordinator_address", required=True)
    parser.add_argument("--num_processes", type=int, required=True)
    parser.add_argument("--process_id", type=int, required=True)
    parser.add_argument("--lr", type=float, default=1e-3)
    args = parser.parse_args(argv)

    from mmr_jax import distributed
    from mmr_jax.studies import on_hosts

    # The body by its module name (not __main__), which the spawned children import.
    from support import study_hosts_worker, tiny_study

    opts = distributed.Options(
        "explicit", args.coordinator_address, args.num_processes, args.process_id, timeout_s=300
    )
    on_hosts.check_options(opts, in_process=False)
    on_hosts.start(opts)
    config = tiny_study.tiny_study("ckpt", args.folder, **{"optim.lr": args.lr})
    on_hosts.run(
        config,
        opts,
        report=lambda: print("report written by process 0", flush=True),
        train_fn=getattr(study_hosts_worker, args.body),
        drop_checkpoints=False,
    )
    print(f"study process {args.process_id} done", flush=True)


if __name__ == "__main__":
    here = pathlib.Path(__file__).resolve()
    sys.path[:0] = [str(here.parents[2]), str(here.parents[1])]  # mmr_jax, and tests/ (support)
    main(sys.argv[1:])
