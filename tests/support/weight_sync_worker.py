"""One process of tests/distributed/weight_sync_test.py and benchmarks/weight_sync.py: the weight
hand-over of a multi-process run (`ShareEngine.sync_weights` into an `EmbeddedEngine`), timed and
checked.

    python weight_sync_worker.py --coordinator=localhost:PORT --processes=2 --process_id=I \
        --path=new --modes=full,lora --syncs=3 --model=tiny --check=1

Builds a random model of `--model`'s shapes on a (1, all devices, 1) mesh (fsdp spans the
processes), an engine holding a process-local copy, then `--syncs` updates of the trainable
parameters (+k * 1e-3), each followed by a sync. Prints one `RESULT <json>` line: per sync the
seconds, the bytes gathered into this process, the compilations during it and (with `--check`)
whether the engine's weights equal the trainer's bit for bit (the reference: JAX's own
`multihost_utils.process_allgather`) and lie on this process's first device alone.

`--path=old` runs the hand-over as it was before issue 36 item 2 (`old_local_copy`, kept here
for the benchmark's comparison): every array replicated on every device of the mesh by a jit
built anew at each call.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import resource
import statistics
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[2]


def old_local_copy(tree, mesh=None):
    """The hand-over before issue 36 item 2 (collectives.local_copy then), for comparison; the
    run's mesh is the arrays' own."""
    import jax

    leaves, treedef = jax.tree.flatten(tree)
    mesh = mesh or next(
        x.sharding.mesh for x in leaves if isinstance(x, jax.Array) and hasattr(x.sharding, "mesh")
    )
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    arrays = [i for i, x in enumerate(leaves) if isinstance(x, jax.Array)]
    OLD_BYTES[0] += sum(int(leaves[i].nbytes) for i in arrays)
    OLD_BYTES[1] = max(OLD_BYTES[1], sum(int(leaves[i].nbytes) for i in arrays))  # per device
    moved = jax.jit(lambda *xs: xs, out_shardings=replicated)(*(leaves[i] for i in arrays))
    moved = jax.block_until_ready(moved)
    for i, x in zip(arrays, moved, strict=True):
        leaves[i] = jax.device_put(x.addressable_data(0), jax.local_devices()[0])
    return jax.tree.unflatten(treedef, leaves)


OLD_BYTES = [0, 0]  # bytes gathered, most bytes one gather put on one device


def _model_config(name: str):
    from mmr_jax.models import config as model_config

    if name == "tiny":
        sys.path.insert(0, str(REPO / "tests"))
        from support import testing

        return model_config.ModelConfig.from_hf(testing.tiny_hf_config().to_dict())
    return model_config.ModelConfig.from_hf(REPO / "third_party" / "hf_configs" / f"{name}.json")


class _Compiles:
    """Backend compilations (XLA programs built or loaded) in this process since start."""

    def __init__(self):
        from jax import monitoring

        self.count = 0
        monitoring.register_event_duration_secs_listener(self._on)

    def _on(self, event, duration, **_):
        if event == "/jax/core/compile/backend_compile_duration":
            self.count += 1


_COMPILES: list[_Compiles] = []


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux


def _bits(x):
    import jax
    import numpy as np

    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    return np.asarray(x).tobytes()


class AdapterEngine:
    """Stands in for `VllmEngine` under LoRA (`syncs_adapters_only`): its sync writes the PEFT
    adapter folder as `VllmEngine.sync_weights` does; `tensors` is the last one written."""

    syncs_adapters_only = True

    def __init__(self, out_dir: pathlib.Path):
        self.out_dir, self.tensors = out_dir, None

    def sync_weights(self, model, *, version: int) -> None:
        self.tensors = _adapter_tensors(model, self.out_dir / f"v{version}")


def _adapter_tensors(model, out_dir: pathlib.Path) -> dict:
    from safetensors.numpy import load_file

    from mmr_jax.models import export

    path = export.save_peft_adapter(model, out_dir, base_model_name_or_path="tiny")
    return load_file(path / "adapter_model.safetensors")


MODES = ("full", "lora", "vllm_lora")  # engine: embedded, embedded, AdapterEngine
# also "disagree": the processes copy different arrays (a named error, `disagree`)


def disagree() -> dict:
    """Process 1 copies one global array more than process 0: both must stop with a named error
    before the gather (a mismatched collective would hang or mix arrays)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    from mmr_jax import distributed
    from mmr_jax.models import sharding

    mesh = sharding.make_mesh(1, -1, 1)
    place = jax.jit(
        lambda: jnp.arange(8.0), out_shardings=NamedSharding(mesh, PartitionSpec("fsdp"))
    )
    arrays = [place(), place()][: 1 + jax.process_index()]
    try:
        distributed.local_copy(arrays)
    except distributed.DistributedError as e:
        return {
            "process": jax.process_index(),
            "mode": "disagree",
            "error": f"{type(e).__name__}: {e}",
        }
    return {"process": jax.process_index(), "mode": "disagree", "error": None}


def run(*, path: str, mode: str, syncs: int, model: str, check: bool) -> dict:
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.experimental import multihost_utils

    from mmr_jax import distributed
    from mmr_jax.distributed import weight_sync
    from mmr_jax.infra import bench_harness
    from mmr_jax.models import lora as lora_lib
    from mmr_jax.models import random_init, sharding
    from mmr_jax.rollout import embedded

    lora = mode != "full"
    if not _COMPILES:
        _COMPILES.append(_Compiles())
    compiles = _COMPILES[0]
    if path == "old":
        weight_sync.local_copy = old_local_copy  # what ShareEngine.sync_weights reaches
    mesh = sharding.make_mesh(1, -1, 1)
    adapters = lora_lib.LoraConfig(rank=4, alpha=8.0, dropout=0.0) if lora else None
    policy = lora_lib.split_policy(
        random_init.random_model(
            _model_config(model), dtype=jnp.float32, param_dtype=jnp.float32, mesh=mesh,
            lora=adapters, seed=0,
        )
    )  # fmt: skip
    stats0, old0, compiles0 = weight_sync.gather_stats(), OLD_BYTES[0], compiles.count
    local = dataclasses.replace(
        policy,
        params=weight_sync.local_copy(policy.params),
        frozen=weight_sync.local_copy(policy.frozen),
        rest=weight_sync.local_copy(policy.rest),
    )  # as trainer._make_engine
    if mode == "vllm_lora":  # the local copies are dropped, as a vLLM engine drops them
        engine = AdapterEngine(pathlib.Path(tempfile.mkdtemp(prefix="weight_sync_")))
        del local
    else:
        engine = embedded.EmbeddedEngine(local.model())
    share = distributed.ShareEngine(engine)
    build_row = {
        "bytes": weight_sync.gather_stats()["bytes"] - stats0["bytes"] + OLD_BYTES[0] - old0,
        "compiles": compiles.count - compiles0,
    }
    shardings = jax.tree.map(lambda x: x.sharding, policy.params)
    bump = jax.jit(lambda p, k: jax.tree.map(lambda x: x + k, p), out_shardings=shardings)
    params = jax.block_until_ready(bump(policy.params, jnp.float32(0.0)))  # compiled here
    distributed.barrier()  # its allgather program is the one the sync's check reuses
    first_device = jax.local_devices()[0]
    rss_before = _rss_mib()
    rows = []
    for k in range(1, syncs + 1):
        params = jax.block_until_ready(bump(params, jnp.float32(k * 1e-3)))
        trainer_model = policy.model(params)
        stats0, old0, compiles0 = weight_sync.gather_stats(), OLD_BYTES[0], compiles.count
        t0 = time.perf_counter()
        share.sync_weights(trainer_model, version=k)
        if mode != "vllm_lora":
            jax.block_until_ready(nnx.state(share.engine.model))
        row = {"seconds": time.perf_counter() - t0, "compiles": compiles.count - compiles0}
        row["rss_peak_mib"] = _rss_mib()
        stats = weight_sync.gather_stats()
        row["bytes"] = stats["bytes"] - stats0["bytes"] + OLD_BYTES[0] - old0
        row["max_device_bytes"] = max(stats["max_device_bytes"], OLD_BYTES[1])
        if check and mode == "vllm_lora":  # against the adapter of JAX's own gather
            graphdef, adapters, others = nnx.split(trainer_model, nnx.LoRAParam, ...)
            whole = jax.tree.map(
                lambda x: multihost_utils.process_allgather(x, tiled=True), adapters
            )
            ref = _adapter_tensors(nnx.merge(graphdef, whole, others), engine.out_dir / f"ref{k}")
            row["equal"] = sorted(ref) == sorted(engine.tensors) and all(
                _bits(ref[n]) == _bits(engine.tensors[n]) for n in ref
            )
            row["on_first_device"] = True  # written out to files: nothing left on a device
        elif check:
            mine = jax.tree.leaves(nnx.state(share.engine.model, nnx.Param))
            ref = [
                multihost_utils.process_allgather(x, tiled=True)
                for x in jax.tree.leaves(nnx.state(trainer_model, nnx.Param))
            ]
            row["equal"] = len(mine) == len(ref) and all(
                _bits(a) == _bits(b) for a, b in zip(mine, ref, strict=True)
            )
            row["on_first_device"] = all(x.sharding.device_set == {first_device} for x in mine)
        rows.append(row)
    state = nnx.state(policy.model(params))
    adapter_bytes = sum(
        int(x.nbytes) for x in jax.tree.leaves(nnx.state(policy.model(params), nnx.LoRAParam))
    )
    return {
        "process": jax.process_index(),
        "processes": jax.process_count(),
        "local_devices": jax.local_device_count(),
        "path": path,
        "mode": mode,
        "lora": lora,
        "model": model,
        "build": build_row,
        "syncs": rows,
        "first_s": rows[0]["seconds"],
        "steady_s": statistics.median(r["seconds"] for r in rows[1:]) if syncs > 1 else None,
        "model_bytes": sum(int(x.nbytes) for x in jax.tree.leaves(state)),
        "param_bytes": sum(int(x.nbytes) for x in jax.tree.leaves(nnx.state(params))),
        "adapter_bytes": adapter_bytes,
        "rss_before_mib": rss_before,
        "rss_peak_mib": _rss_mib(),
        "device_peak_bytes": bench_harness.jax_peak_bytes(),
    }


def cluster(devices: int, *args: str, processes: int = 2, timeout: float = 900) -> list[list]:
    """This worker on `processes` processes x `devices` CPU devices (a localhost coordinator,
    gloo); -> each process's runs, in process order. Raises with the output of a failed one."""
    import os
    import subprocess

    sys.path.insert(0, str(REPO / "tests"))
    from support import multihost

    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(REPO / "tests"), env.get("PYTHONPATH", "")])
    port = multihost.free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, f"--coordinator=localhost:{port}"]
            + [f"--processes={processes}", f"--process_id={i}", *args],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(processes)
    ]
    try:
        outs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    results = []
    for p, out in zip(procs, outs, strict=True):
        found = [x for x in out.splitlines() if x.startswith("RESULT ")]
        if p.returncode != 0 or len(found) != 1:
            raise RuntimeError(f"worker exited {p.returncode}:\n{out[-3000:]}")
        results.append(json.loads(found[0][len("RESULT ") :])["runs"])
    return results


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--coordinator")
    parser.add_argument("--processes", type=int, default=1)
    parser.add_argument("--process_id", type=int, default=0)
    parser.add_argument("--path", choices=("new", "old"), default="new")
    parser.add_argument("--modes", default="full", help=f"some of {MODES}, in turn: full,lora")
    parser.add_argument("--syncs", type=int, default=3)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--check", type=int, default=1)
    args = parser.parse_args(argv)
    sys.path[:0] = [str(REPO), str(REPO / "tests")]
    from mmr_jax import distributed
    from mmr_jax.infra import bench_harness

    if args.processes > 1:
        distributed.initialize(
            distributed.options_from_flags(
                distributed="off",
                coordinator_address=args.coordinator,
                num_processes=args.processes,
                process_id=args.process_id,
                timeout_s=300,
                heartbeat_s=600,
            )
        )
    results = [
        disagree()
        if m == "disagree"
        else run(path=args.path, mode=m, syncs=args.syncs, model=args.model, check=bool(args.check))
        for m in args.modes.split(",")
    ]  # fmt: skip
    bench_harness.emit({"runs": results})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
