"""The hybrid mesh of several hosts (issue 36, item 5): `data` across hosts, fsdp and tensor within
one (`sharding.device_grid`, as `jax.experimental.mesh_utils.create_hybrid_device_mesh` with
processes as granules). One host: the mesh of before, bit for bit.

Devices are stand-ins (`_Dev`) where only the layout matters; the last test runs a real
2-process JAX cluster (localhost coordinator, gloo) and reads the default mesh's process indices.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import sys

import jax
import numpy as np
import pytest

from mmr_jax.config import checks, schema
from mmr_jax.models import sharding

from support import multihost

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "configs"))
import grpo  # noqa: E402


@dataclasses.dataclass(frozen=True)
class _Dev:
    id: int
    process_index: int


def _devices(hosts: int, per_host: int, *, interleaved: bool = False) -> list[_Dev]:
    """hosts x per_host devices; `interleaved`: listed host 0, 1, 0, 1, ... (as a TPU's device
    order by physical coordinates may list them), else host by host."""
    out = [_Dev(h * per_host + i, h) for h in range(hosts) for i in range(per_host)]
    return sorted(out, key=lambda d: (d.id % per_host, d.process_index)) if interleaved else out


def _hosts_of(mesh) -> np.ndarray:
    return np.vectorize(lambda d: d.process_index)(mesh.devices)


def _check_hybrid(mesh, devices):
    """Plain-loop check: data row r belongs to host r // (rows per host); within a row the host's
    devices appear in their listed order, the rows of one host consecutive; every device once."""
    data = mesh.shape["data"]
    hosts = sorted({d.process_index for d in devices})
    per_host_rows = data // len(hosts)
    for h in hosts:
        listed = [d for d in devices if d.process_index == h]
        rows = mesh.devices[h * per_host_rows : (h + 1) * per_host_rows]
        assert list(rows.reshape(-1)) == listed, h
    assert sorted(d.id for d in mesh.devices.reshape(-1)) == sorted(d.id for d in devices)


class TestOneHost:
    @pytest.mark.parametrize(
        "shape", [(1, -1, 1), (2, -1, 1), (-1, 2, 1), (1, 2, -1), (2, 2, 2), (8, 1, 1)]
    )
    @pytest.mark.parametrize("over_hosts", sharding.OVER_HOSTS)
    def test_same_mesh_as_a_plain_reshape(self, shape, over_hosts):
        devices = _devices(1, 8)
        sizes = [8 // -np.prod(shape) if s == -1 else s for s in shape]  # the -1 filled by hand
        mesh = sharding.make_mesh(*shape, devices=devices, over_hosts=over_hosts)
        assert mesh.axis_names == sharding.AXES
        assert mesh.devices.tolist() == np.asarray(devices, object).reshape(sizes).tolist()

    def test_real_cpu_device_default(self):
        import jax

        mesh = sharding.make_mesh()
        assert dict(mesh.shape) == {"data": 1, "fsdp": jax.device_count(), "tensor": 1}
        assert list(mesh.devices.reshape(-1)) == jax.devices()


def _hybrid(*shape, **kw):
    return sharding.make_mesh(*shape, over_hosts="hybrid", **kw)


class TestSeveralHosts:
    def test_granule_is_the_tpu_slice_else_the_process(self):
        import types

        assert sharding.granule(jax.devices()[0]) == 0  # a CPU device: no slice, process 0
        assert sharding.granule(_Dev(5, 3)) == 3
        tpu = types.SimpleNamespace(id=5, process_index=3, slice_index=1, platform="tpu")
        assert sharding.granule(tpu) == 1
        # a CPU (or GPU) device of a cluster: its slice_index (0 on every process) is not read
        cpu = types.SimpleNamespace(id=5, process_index=3, slice_index=0, platform="cpu")
        assert sharding.granule(cpu) == 3

    @pytest.mark.parametrize("interleaved", [False, True])
    def test_default_puts_hosts_on_data(self, interleaved):
        devices = _devices(2, 4, interleaved=interleaved)
        mesh = _hybrid(1, -1, 1, devices=devices)
        assert dict(mesh.shape) == {"data": 2, "fsdp": 4, "tensor": 1}
        np.testing.assert_array_equal(_hosts_of(mesh)[:, :, 0], [[0] * 4, [1] * 4])
        _check_hybrid(mesh, devices)

    def test_minus_one_on_fsdp_is_one_hosts_mesh(self):
        devices = _devices(2, 8, interleaved=True)
        mesh = _hybrid(2, -1, 2, devices=devices)  # per host (2, 2, 2)
        assert dict(mesh.shape) == {"data": 4, "fsdp": 2, "tensor": 2}
        _check_hybrid(mesh, devices)
        assert (_hosts_of(mesh)[:2] == 0).all() and (_hosts_of(mesh)[2:] == 1).all()

    @pytest.mark.parametrize("shape", [(-1, 2, 1), (4, 2, 1)])
    def test_global_data_split_over_hosts(self, shape):
        devices = _devices(2, 4, interleaved=True)
        mesh = _hybrid(*shape, devices=devices)
        assert dict(mesh.shape) == {"data": 4, "fsdp": 2, "tensor": 1}
        _check_hybrid(mesh, devices)

    def test_written_shape_across_hosts_is_honoured(self):
        # (1, 2, 1) on 2 hosts x 1 device: fsdp across hosts, asked for by writing every size.
        devices = _devices(2, 1)
        mesh = _hybrid(1, 2, 1, devices=devices)
        assert mesh.devices.tolist() == [[[devices[0]], [devices[1]]]]

    def test_flat_over_hosts_is_the_plain_reshape(self):
        devices = _devices(2, 4, interleaved=True)
        want = np.asarray(devices, object).reshape(1, 8, 1).tolist()
        assert (
            sharding.make_mesh(1, -1, 1, devices=devices, over_hosts="flat").devices.tolist()
            == want
        )
        # make_mesh's own default is flat (direct callers keep their mesh); runs take the
        # config's `mesh.over_hosts`, hybrid by default (the cluster test below).
        assert sharding.make_mesh(1, -1, 1, devices=devices).devices.tolist() == want

    def test_fake_hosts_by_position(self):
        # The dry run's fake pod: device i on host i // 4 (real CPU devices are all process 0).
        devices = [_Dev(i, 0) for i in range(8)]
        mesh = _hybrid(devices=devices, hosts=[i // 4 for i in range(8)])
        assert [[d.id for d in row[:, 0]] for row in mesh.devices] == [[0, 1, 2, 3], [4, 5, 6, 7]]

    def test_mesh_sizes_without_devices(self):
        assert sharding.mesh_sizes((1, -1, 1), hosts=4, devices_per_host=8) == {
            "data": 4,
            "fsdp": 8,
            "tensor": 1,
        }
        flat = sharding.mesh_sizes((1, -1, 1), hosts=4, devices_per_host=8, over_hosts="flat")
        assert flat == {"data": 1, "fsdp": 32, "tensor": 1}


class TestRefusals:
    def test_auto_shape_that_cannot_stay_within_a_host(self):
        # 2 hosts x 3 devices, fsdp 2: data = 3 rows do not split over 2 hosts.
        with pytest.raises(sharding.MeshShapeError, match="does not split over 2 hosts"):
            _hybrid(-1, 2, 1, devices=_devices(2, 3))

    def test_per_host_shape_must_fit_a_host(self):
        with pytest.raises(sharding.MeshShapeError, match="do not divide the 4 devices of one"):
            _hybrid(2, -1, 3, devices=_devices(2, 4))

    def test_unequal_hosts(self):
        devices = _devices(2, 4)[:-1]  # host 1 holds 3
        with pytest.raises(sharding.MeshShapeError, match=r"hosts hold \[4, 3\] devices"):
            _hybrid(1, -1, 1, devices=devices)
        mesh = _hybrid(1, 7, 1, devices=devices)  # written: laid flat
        assert list(mesh.devices.reshape(-1)) == devices

    @pytest.mark.parametrize("shape", [(1, -1, -1), (0, 2, 1), (1, 2)])
    def test_bad_shapes(self, shape):
        with pytest.raises(sharding.MeshShapeError, match="at most one -1"):
            sharding.device_grid(shape, _devices(1, 2), [0, 0])

    def test_over_hosts_name(self):
        with pytest.raises(sharding.MeshShapeError, match="expected one of"):
            sharding.make_mesh(devices=_devices(1, 2), over_hosts="dcn")
        c = grpo.get_config("smoke")
        c.mesh.over_hosts = "dcn"
        with pytest.raises(schema.ConfigError, match="mesh.over_hosts='dcn'"):
            checks.from_config_dict(c)


_CLUSTER_SCRIPT = """
import json, sys
import jax
from mmr_jax import distributed
distributed.initialize(distributed.options_from_flags(
    distributed="off", coordinator_address=sys.argv[2], num_processes=2,
    process_id=int(sys.argv[1]), timeout_s=120, heartbeat_s=600))
import jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from configs import grpo
from mmr_jax.models import sharding

def hosts_of(mesh):
    return np.vectorize(lambda d: d.process_index)(mesh.devices).tolist()

out = {}
for name, shape in (("default", None), ("written", (1, 4, 1))):
    c = grpo.get_config("smoke")
    if shape:
        c.mesh.shape = shape
    mesh = sharding.make_mesh(*c.mesh.shape, over_hosts=c.mesh.over_hosts)
    # A global array over the mesh, summed: the layout is one a multi-controller program runs.
    x = jax.make_array_from_callback(
        (4, 4), NamedSharding(mesh, P("data", "fsdp")),
        lambda idx: np.arange(16, dtype=np.float32).reshape(4, 4)[idx])
    total = jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P()))(x)
    out[name] = {"shape": dict(mesh.shape), "hosts": hosts_of(mesh),
                 "sum": float(total.addressable_data(0))}
print("RESULT", json.dumps(out), flush=True)
"""


@pytest.mark.slow
def test_default_mesh_puts_data_across_real_processes():
    """2 real processes x 2 CPU devices: the default config's mesh is (2, 2, 1) with process p's
    devices on data row p; a written (1, 4, 1) keeps fsdp across both processes, as asked. A
    sharded global array sums correctly on both meshes."""
    port = multihost.free_port()
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(REPO / "tests")])
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    cmds = [[sys.executable, "-c", _CLUSTER_SCRIPT, str(i), f"localhost:{port}"] for i in (0, 1)]
    for code, out, _ in multihost.outputs(multihost.start_all(cmds, env), timeout=300):
        assert code == 0, out[-3000:]
        (line,) = [x for x in out.splitlines() if x.startswith("RESULT ")]
        r = json.loads(line[len("RESULT ") :])
        assert r["default"]["shape"] == {"data": 2, "fsdp": 2, "tensor": 1}
        assert r["default"]["hosts"] == [[[0], [0]], [[1], [1]]]
        assert r["written"]["shape"] == {"data": 1, "fsdp": 4, "tensor": 1}
        assert r["written"]["hosts"] == [[[0], [0], [1], [1]]]
        assert r["default"]["sum"] == r["written"]["sum"] == 120.0


@pytest.mark.slow
def test_training_on_the_hybrid_default(tmp_path, tiny_llama_dir):
    """scripts/train.py's trainer on 2 processes x 1 device with the default mesh (hybrid:
    (2, 1, 1), data-parallel across the processes) gives the metrics of 1 process x 2 devices
    (1, 2, 1) within the contract's tolerance: another program, the same training."""
    from support import multihost_runs

    cfg = multihost_runs.config(grpo, tiny_llama_dir, steps=2, **{"mesh.shape": (1, -1, 1)})
    one, two = tmp_path / "one", tmp_path / "two"
    multihost_runs.ok(multihost_runs.run(cfg, one, processes=1, devices=2))
    results = multihost_runs.run(cfg, two, processes=2, devices=1)
    multihost_runs.ok(results)
    for workdir, log, mesh in (
        (one, "train.log", "{'data': 1, 'fsdp': 2, 'tensor': 1}"),
        (two, "train.log", "{'data': 2, 'fsdp': 1, 'tensor': 1}"),
        (two, "train.process1.log", "{'data': 2, 'fsdp': 1, 'tensor': 1}"),
    ):
        assert f"mesh {mesh} (over hosts hybrid" in (workdir / log).read_text(), (workdir, log)
    multihost_runs.assert_same(multihost_runs.metrics_of(one), multihost_runs.metrics_of(two))
