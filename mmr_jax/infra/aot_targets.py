"""The accelerators a run can be compiled for without one: TPUs and NVIDIA GPUs, compile-only.

`jax.experimental.topologies.get_topology_desc` returns compile-only devices of a real target;
`jit(...).lower(...).compile()` on a mesh of them runs that target's own compiler (libtpu's for a
TPU, the CUDA plugin's for a GPU) on a machine without the accelerator. This module is the one
list of those targets and how each is built: `parse_target("h100:8")` -> a `Target`,
`compile_only_devices(target)` -> its devices (training/aot_dry_run.py compiles the run's programs
for them: `scripts/train.py --dry_run --dry_run_target=...`).

Target names: `<accelerator>:<shape>`.
- GPUs (`h100`, `h200`): `h100:8` is one host of 8 GPUs, `h100:2x8` two hosts of 8; `h100` is
  one GPU. The compiler's view of the card is XLA's device spec (third_party/xla_gpu_specs/).
- TPUs (`v4`, `v5e`, `v5p`, `v6e`): the slice's chip topology as Cloud TPU names it, 2-D for the
  lite chips (`v5e:2x4`, `v6e:4x4`), 3-D for v4 and v5p (`v5p:2x2x2`, `v5p:4x4x4`). A slice is
  laid over its hosts as Cloud TPU builds it (`Target.chips_per_host_bounds`): v4 and v5p hosts
  hold 2x2x1 chips; a v5e or v6e slice of up to 8 chips is one host, a larger one hosts of 2x2.
  One JAX device per chip (v4 and v5p as megacore, their two TensorCores one device).

Needs the environment of the target's plugin: `.venv-aot-tpu` (`jax[tpu]`, libtpu) or
`.venv-aot-gpu` (`jax[cuda12]`), both built by scripts/setup_aot_env.sh. In the plain `.venv`
this module imports and parses; `compile_only_devices` raises `AotEnvironmentMissing` naming that
script.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import pathlib
import re

GIB = 2**30
# Where the GPU device specs live: third_party/ of the repository (the package is installed
# editable from it: scripts/setup_env.sh, scripts/setup_aot_env.sh).
SPEC_DIR = pathlib.Path(__file__).resolve().parents[2] / "third_party" / "xla_gpu_specs"
SETUP_SCRIPT = "scripts/setup_aot_env.sh"


@dataclasses.dataclass(frozen=True)
class Accelerator:
    """One kind of chip: how JAX names its platform, its memory a device, how to build it."""

    name: str
    platform: str  # "cuda" or "tpu"
    memory_bytes: int  # per JAX device
    description: str
    # GPU: XLA's GpuTargetConfigProto text of the card, a file in SPEC_DIR.
    spec_file: str = ""
    max_devices_per_host: int = 8
    # TPU: the topology's dimensions (2 for v5e/v6e, 3 for v4/v5p) and the chip config name.
    topology_dims: int = 0
    chip_config: str = "default"

    @property
    def memory_gib(self) -> float:
        return self.memory_bytes / GIB


# The device memory of a GPU is the one its XLA spec states (what CUDA reports as the card's
# total: 79.1 GiB of an "80 GB" H100); a TPU's is Cloud TPU's HBM a chip.
ACCELERATORS: dict[str, Accelerator] = {
    a.name: a
    for a in (
        Accelerator(
            "h100",
            "cuda",
            84978434048,
            "NVIDIA H100 SXM 80 GB (XLA's h100_sxm spec)",
            spec_file="h100_sxm.txtpb",
        ),
        Accelerator(
            "h200",
            "cuda",
            150212444160,
            "NVIDIA H200 SXM 141 GB (a spec derived from the H100's)",
            spec_file="h200_sxm.txtpb",
        ),
        Accelerator(
            "v4", "tpu", 32 * GIB, "TPU v4, 32 GiB HBM", topology_dims=3, chip_config="megacore"
        ),
        Accelerator("v5e", "tpu", 16 * GIB, "TPU v5e (v5 lite), 16 GiB HBM", topology_dims=2),
        Accelerator("v5p", "tpu", 95 * GIB, "TPU v5p, 95 GiB HBM", topology_dims=3),
        Accelerator("v6e", "tpu", 32 * GIB, "TPU v6e (Trillium), 32 GiB HBM", topology_dims=2),
    )
}

EXAMPLES = ("h100:8", "h200:1", "v5e:2x4", "v5p:2x2x2", "v6e:2x4", "v5p:4x4x4")


class UnknownTarget(ValueError):
    """A target string that names no known accelerator, or a shape it cannot have."""


class AotEnvironmentMissing(RuntimeError):
    """The compile-only plugin of a target (libtpu, jax's CUDA plugin) is not installed."""


@dataclasses.dataclass(frozen=True)
class Target:
    """An accelerator and a slice of it: `shape` is the TPU chip topology, or for GPUs
    (hosts, GPUs a host)."""

    accelerator: Accelerator
    shape: tuple[int, ...]

    @property
    def platform(self) -> str:
        return self.accelerator.platform

    @property
    def name(self) -> str:
        acc = self.accelerator
        if acc.platform == "cuda" and self.shape[0] == 1:
            return f"{acc.name}:{self.shape[1]}"
        return f"{acc.name}:{'x'.join(map(str, self.shape))}"

    @property
    def devices(self) -> int:
        return math.prod(self.shape)

    @property
    def chips_per_host_bounds(self) -> tuple[int, int, int]:
        """TPU: the chips one host holds, as (x, y, z) bounds of the topology."""
        dims = tuple(self.shape) + (1,) * (3 - len(self.shape))
        if self.accelerator.topology_dims == 2 and self.devices <= 8:
            return dims  # v5e-8 / v6e-8: one host of 8 chips
        return (min(dims[0], 2), min(dims[1], 2), 1)

    @property
    def hosts(self) -> int:
        if self.platform == "cuda":
            return self.shape[0]
        return self.devices // math.prod(self.chips_per_host_bounds)

    def describe(self) -> str:
        return (
            f"{self.name}: {self.devices} x {self.accelerator.description} on "
            f"{self.hosts} host(s), {self.accelerator.memory_gib:.1f} GiB a device"
        )


def known_targets() -> str:
    """One line for errors and --help: the accelerators and example targets."""
    return f"known accelerators: {', '.join(ACCELERATORS)} (e.g. {', '.join(EXAMPLES)})"


def parse_target(text: str) -> Target:
    """'h100:8', 'h100:2x8', 'v5e:2x4', 'v5p:4x4x4' -> Target; UnknownTarget on anything else."""
    name, _, shape_text = text.strip().lower().partition(":")
    acc = ACCELERATORS.get(name)
    if acc is None:
        raise UnknownTarget(f"unknown accelerator {name!r} in target {text!r}; {known_targets()}")
    if shape_text and not re.fullmatch(r"[1-9][0-9]*(x[1-9][0-9]*)*", shape_text):
        raise UnknownTarget(
            f"target {text!r}: the shape must be positive integers joined by 'x'; {known_targets()}"
        )
    shape = tuple(int(s) for s in shape_text.split("x")) if shape_text else ()
    if acc.platform == "cuda":
        shape = shape or (1,)
        if len(shape) == 1:
            shape = (1, shape[0])
        if len(shape) != 2 or shape[1] > acc.max_devices_per_host:
            raise UnknownTarget(
                f"target {text!r}: a {name} target is <GPUs> (one host, at most "
                f"{acc.max_devices_per_host}) or <hosts>x<GPUs a host>, e.g. {name}:8 or {name}:2x8"
            )
        return Target(acc, shape)
    if len(shape) != acc.topology_dims:
        example = "2x4" if acc.topology_dims == 2 else "2x2x2"
        raise UnknownTarget(
            f"target {text!r}: a {name} slice is a {acc.topology_dims}-D chip topology, "
            f"e.g. {name}:{example}"
        )
    if math.prod(shape) > 4 and any(s % 2 for s in shape[:2]):
        raise UnknownTarget(
            f"target {text!r}: a slice of more than 4 chips has even x and y sizes (one host "
            "holds 2x2 or 2x4 chips)"
        )
    return Target(acc, shape)


def _check_plugin(target: Target) -> None:
    module, extra = {
        "cuda": ("jax_plugins.xla_cuda12", "jax[cuda12]"),
        "tpu": ("libtpu", "jax[tpu]"),
    }[target.platform]
    try:
        found = importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # find_spec of a submodule imports its parent
        found = False
    if not found:
        venv = ".venv-aot-gpu" if target.platform == "cuda" else ".venv-aot-tpu"
        raise AotEnvironmentMissing(
            f"compiling for {target.name} needs {extra} (module {module} is not installed here); "
            f"build its environment with `bash {SETUP_SCRIPT}` and run this with "
            f"{venv}/bin/python"
        )


# Set (unless set) before the plugins load: the CUDA plugin's check that a GPU is there is
# skipped; libtpu's lock on /tmp/libtpu_lockfile, which stops two processes from driving one TPU
# host's chips, is not taken (there are no chips: compiles in other processes of this machine
# would otherwise fail with "Internal error when accessing libtpu multi-process lockfile").
PLUGIN_ENV = ("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "ALLOW_MULTIPLE_LIBTPU_LOAD")


def prepare_jax() -> None:
    """Keeps JAX's own backend on the CPU: nothing probes for an accelerator that is not there
    (the CUDA plugin's start-up check would fail without a GPU and drop the plugin, and with it
    the compile-only topology). Call before anything initialises JAX's backends."""
    import jax

    for name in PLUGIN_ENV:
        os.environ.setdefault(name, "1")
    try:
        jax.config.update("jax_platforms", "cpu")
    except Exception:  # backends already up: whatever they are, they stay
        pass


def compile_only_devices(target: Target) -> list:
    """The target's compile-only JAX devices, in the topology's order (each with its
    `process_index`, the host it would be on). Raises AotEnvironmentMissing without the plugin."""
    _check_plugin(target)
    prepare_jax()
    from jax.experimental import topologies

    if target.platform == "cuda":
        spec = SPEC_DIR / target.accelerator.spec_file
        if not spec.is_file():
            raise AotEnvironmentMissing(f"the GPU device spec {spec} is missing (third_party/)")
        hosts, per_host = target.shape
        desc = topologies.get_topology_desc(
            platform="cuda",
            topology_name="",
            # slices x hosts x devices a host: 1x1x8 is one host of 8 GPUs
            topology=f"1x{hosts}x{per_host}",
            target_config=spec.read_text(),
        )
    else:
        desc = topologies.get_topology_desc(
            platform="tpu",
            topology_name=target.name,
            chip_config_name=target.accelerator.chip_config,
            chips_per_host_bounds=target.chips_per_host_bounds,
            num_slices=1,
        )
    devices = list(desc.devices)
    if len(devices) != target.devices:  # the topology's device count is the promise made here
        raise RuntimeError(
            f"{target.name}: the compiler's topology has {len(devices)} devices, "
            f"expected {target.devices}"
        )
    return devices
