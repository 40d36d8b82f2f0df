"""infra/aot_targets: target names parsed, unknown ones refused with the list, and, in the
compile-only environments (.venv-aot-tpu, .venv-aot-gpu; scripts/setup_aot_env.sh), the devices
the real plugin returns: their count, platform, kind and hosts as the target says.

In the plain .venv the device tests are skipped with the reason (no plugin); run them with
`.venv-aot-tpu/bin/python -m pytest tests/infra/aot_targets_test.py` (and the GPU venv)."""

import pytest

from mmr_jax.infra import aot_targets

from support import aot

cpu_backend_for_aot = aot.cpu_backend_for_aot  # the module's fixture


@pytest.mark.parametrize(
    "text, platform, devices, hosts, name",
    [
        ("h100", "cuda", 1, 1, "h100:1"),
        ("h100:8", "cuda", 8, 1, "h100:8"),
        ("H200:1", "cuda", 1, 1, "h200:1"),
        ("h200:2x8", "cuda", 16, 2, "h200:2x8"),
        ("v5e:2x4", "tpu", 8, 1, "v5e:2x4"),  # v5e-8: one host of 8 chips
        ("v5e:4x4", "tpu", 16, 4, "v5e:4x4"),  # larger lite slices: hosts of 2x2
        ("v6e:2x4", "tpu", 8, 1, "v6e:2x4"),
        ("v5p:2x2x1", "tpu", 4, 1, "v5p:2x2x1"),  # v5p-8: 4 chips, one host
        ("v5p:2x2x2", "tpu", 8, 2, "v5p:2x2x2"),
        ("v5p:4x4x4", "tpu", 64, 16, "v5p:4x4x4"),
        ("v4:2x2x1", "tpu", 4, 1, "v4:2x2x1"),
    ],
)
def test_parse(text, platform, devices, hosts, name):
    target = aot_targets.parse_target(text)
    assert (target.platform, target.devices, target.hosts, target.name) == (
        platform,
        devices,
        hosts,
        name,
    )


def test_memory_per_device():
    gib = {n: round(a.memory_gib, 1) for n, a in aot_targets.ACCELERATORS.items()}
    assert gib == {"h100": 79.1, "h200": 139.9, "v4": 32.0, "v5e": 16.0, "v5p": 95.0, "v6e": 32.0}


@pytest.mark.parametrize(
    "text, words",
    [
        ("a100:8", "unknown accelerator 'a100'"),
        ("tpu:2x2", "unknown accelerator 'tpu'"),
        ("h100:16", "at most 8"),
        ("h100:2x2x2", "<hosts>x<GPUs a host>"),
        ("v5e:2x2x2", "2-D chip topology"),
        ("v5p:2x4", "3-D chip topology"),
        ("v5p", "3-D chip topology"),
        ("v5e:3x4", "even x and y"),
        ("h100:0", "positive integers"),
        ("h100:8x", "positive integers"),
    ],
)
def test_bad_targets_say_why_and_list_the_known(text, words):
    with pytest.raises(aot_targets.UnknownTarget) as err:
        aot_targets.parse_target(text)
    message = str(err.value)
    assert words in message
    if "unknown accelerator" in words:
        assert all(name in message for name in aot_targets.ACCELERATORS)


@pytest.mark.parametrize("text", ["h100:1", "h100:8"])
def test_missing_plugin_names_the_setup_script(text):
    target = aot_targets.parse_target(text)
    if aot.has_plugin(target.platform):
        pytest.skip("the CUDA plugin is installed here")
    with pytest.raises(aot_targets.AotEnvironmentMissing, match="scripts/setup_aot_env.sh"):
        aot_targets.compile_only_devices(target)


@pytest.mark.parametrize(
    "text, kind",
    [
        ("h100:1", "NVIDIA H100 80GB HBM3"),
        ("h100:8", "NVIDIA H100 80GB HBM3"),
        ("h200:8", "NVIDIA H200"),
        ("h100:2x8", "NVIDIA H100 80GB HBM3"),
        ("v5e:2x4", "TPU v5 lite"),
        ("v5e:4x4", "TPU v5 lite"),
        ("v6e:2x4", "TPU v6 lite"),
        ("v5p:2x2x1", "TPU v5"),
        ("v5p:4x4x4", "TPU v5"),
        ("v4:2x2x2", "TPU v4"),
    ],
)
@pytest.mark.usefixtures("cpu_backend_for_aot")
def test_compile_only_devices_match_the_target(text, kind):
    target = aot_targets.parse_target(text)
    aot.require_plugin(target.platform)
    devices = aot_targets.compile_only_devices(target)
    assert len(devices) == target.devices
    assert {d.platform for d in devices} == {"gpu" if target.platform == "cuda" else "tpu"}
    assert {d.device_kind for d in devices} == {kind}
    assert len({d.process_index for d in devices}) == target.hosts
