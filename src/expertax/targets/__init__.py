"""Compile targets: the hardware a train step is compiled for, with or without that hardware here.

`--target` names one:
- `cpu`: this machine's CPU devices (simulated ones with `--devices N`), the default;
- `tpu:<slice>`: a TPU slice as Cloud TPU and MaxText name it, `v5p-1024` (v5p counts two
  TensorCores per chip: 512 chips), `v5e-256`, `v6e-256` (one core per chip). JAX builds the
  slice's devices from libtpu's topology description (`jax.experimental.topologies`), so a CPU
  machine compiles for it with the real TPU compiler (`pip install 'expertax[tpu]'`);
- `gpu:<chip>x<count>`: `count` GPUs of one kind, 8 per host (`gpu:h100x8`, `gpu:h200x128`).
  The GPU is described to XLA by a GpuTargetConfig that ships with the package (`*.txtpb` here),
  and the CUDA compiler runs without a GPU (`pip install 'expertax[gpu]'`). Such a compile cannot
  autotune: its kernels are XLA's defaults, not the ones a run on the GPU would pick.

A compile for a target is a plan, not a measurement: no time comes out of it. The chip figures
below (memory, peak bfloat16 dense FLOP/s, memory bandwidth) are the vendors' published ones; the
memory is the default `--hbm` of the target.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import math
import os
import sys
from pathlib import Path

from expertax import startup
from expertax.errors import ConfigError

GIB = 1024**3
HERE = Path(__file__).parent


@dataclasses.dataclass(frozen=True)
class Host:
    """The host a chip sits in, from public specs: what pinned host memory can hold and how
    fast it moves. `link_bytes_per_s` is per chip, one direction, nominal."""

    chips: int  # chips per host
    ram_gib: float  # the host's (the TPU VM's) memory
    link: str  # the chip's link to host memory
    link_bytes_per_s: float
    source: str


@dataclasses.dataclass(frozen=True)
class Chip:
    name: str
    platform: str  # "tpu" | "gpu"
    hbm_gib: float
    peak_bf16_flops: float  # dense, per chip
    hbm_bytes_per_s: float
    dims: int = 3  # TPU: 3-D torus (v5p) or 2-D (v5e, v6e); GPU: unused
    cores_per_chip: int = 1  # how the slice name counts (v5p-N: N TensorCores, two per chip)
    libtpu_name: str = ""  # the topology name's prefix in libtpu
    target_config: str = ""  # GPU: the GpuTargetConfig file next to this module
    host: Host | None = None


GEN4, GEN5 = 32e9, 64e9  # PCIe x16, per direction, nominal
DGX = "NVIDIA DGX H100/H200 data sheets: 8 GPUs, 2 TB of system memory, PCIe Gen5 x16 per GPU"
HOSTS = {
    "v5p": Host(
        4,
        448e9 / GIB,
        "PCIe (generation not published; Gen4 x16 assumed)",
        GEN4,
        "Cloud TPU v5p docs: 4 chips, 208 vCPUs, 448 GB per TPU VM",
    ),
    "v5e": Host(
        8,
        384e9 / GIB,
        "PCIe (generation not published; Gen4 x16 assumed)",
        GEN4,
        "Cloud TPU v5e docs: ct5lp-hightpu-8t, 8 chips, 224 vCPUs, 384 GB",
    ),
    "v6e": Host(
        8,
        1536.0,
        "PCIe Gen5 x16",
        GEN5,
        "Cloud TPU v6e docs: 8 chips and 1536 GiB of DRAM per host, PCIe Gen5",
    ),
    "h100": Host(8, 2e12 / GIB, "PCIe Gen5 x16", GEN5, DGX),
    "h200": Host(8, 2e12 / GIB, "PCIe Gen5 x16", GEN5, DGX),
}


CHIPS = {
    "v5p": Chip("TPU v5p", "tpu", 95.0, 459e12, 2765e9, 3, 2, "v5p"),
    "v5e": Chip("TPU v5e", "tpu", 16.0, 197e12, 819e9, 2, 1, "v5e"),
    "v6e": Chip("TPU v6e", "tpu", 32.0, 918e12, 1640e9, 2, 1, "v6e"),
    "h100": Chip(
        "NVIDIA H100 SXM 80 GB",
        "gpu",
        85520809984 / GIB,
        989e12,
        3352e9,
        target_config="h100.txtpb",
    ),
    "h200": Chip(
        "NVIDIA H200 SXM 141 GB",
        "gpu",
        150754820096 / GIB,
        989e12,
        4800e9,
        target_config="h200.txtpb",
    ),
}
CHIPS = {k: dataclasses.replace(v, host=HOSTS[k]) for k, v in CHIPS.items()}
GPUS_PER_HOST = 8
EXTRAS = {"tpu": "pip install 'expertax[tpu]' (libtpu)", "gpu": "pip install 'expertax[gpu]'"}
EXAMPLES = "cpu, tpu:v5p-16, tpu:v5p-1024, tpu:v6e-256, tpu:v5e-256, gpu:h100x8, gpu:h200x128"


@dataclasses.dataclass(frozen=True)
class Target:
    """A parsed `--target`: the platform, the chip and how many, and the topology to build."""

    spec: str
    platform: str  # "cpu" | "tpu" | "gpu"
    chip: Chip | None  # None for cpu
    count: int  # devices (chips); 0 for cpu: whatever the CPU backend has
    topology: str = ""  # libtpu's "v5p:8x8x8" or the GPU "slices x hosts x per-host"

    @property
    def hbm_gib(self) -> float | None:
        return self.chip.hbm_gib if self.chip else None

    @property
    def is_cpu(self) -> bool:
        return self.platform == "cpu"

    def describe(self) -> str:
        if self.chip is None:
            return "cpu"
        return f"{self.spec}: {self.count} x {self.chip.name} ({self.topology})"

    def devices(self) -> list:
        """The target's devices (compile-only for TPU and GPU targets)."""
        if self.chip is None:
            import jax

            return list(jax.devices())
        return list(_topology_devices(self.platform, self.topology, self.chip.target_config))


def parse_target(spec: str, named: str = "--target") -> Target:
    """`cpu`, `tpu:<kind>-<n>` or `gpu:<kind>x<n>`; a ConfigError names the value as `named`
    (the flag, or the file it came from) and what would be valid."""
    text = spec.strip().lower()
    if text == "cpu":
        return Target("cpu", "cpu", None, 0)
    platform, _, rest = text.partition(":")
    if platform == "tpu":
        kind, _, n = rest.partition("-")
        chip = CHIPS.get(kind)
        if chip is None or chip.platform != "tpu" or not n.isdigit():
            raise _bad(named, spec, "a TPU slice is tpu:<v5p|v5e|v6e>-<N>")
        cores = int(n)
        chips, odd = divmod(cores, chip.cores_per_chip)
        if odd or chips < 1 or chips & (chips - 1):
            raise _bad(
                named,
                spec,
                f"{kind}-N counts {chip.cores_per_chip} TensorCore(s) per chip and needs a power "
                f"of two chips, e.g. {kind}-{8 * chip.cores_per_chip}",
            )
        return Target(spec, "tpu", chip, chips, f"{chip.libtpu_name}:{_torus(chips, chip.dims)}")
    if platform == "gpu":
        kind, _, n = rest.partition("x")
        chip = CHIPS.get(kind)
        if chip is None or chip.platform != "gpu" or not n.isdigit() or int(n) < 1:
            gpus = ", ".join(k for k, v in CHIPS.items() if v.platform == "gpu")
            raise _bad(named, spec, f"a GPU target is gpu:<{gpus}>x<count>")
        count = int(n)
        if count > GPUS_PER_HOST and count % GPUS_PER_HOST:
            raise _bad(
                named, spec, f"above {GPUS_PER_HOST} GPUs, count whole hosts of {GPUS_PER_HOST}"
            )
        hosts, per_host = (count // GPUS_PER_HOST, GPUS_PER_HOST) if count > 8 else (1, count)
        return Target(spec, "gpu", chip, count, f"1x{hosts}x{per_host}")
    raise _bad(named, spec, "the platform is cpu, tpu or gpu")


def _bad(named: str, spec: str, why: str) -> ConfigError:
    return ConfigError(f"{named}={spec}: {why}; valid targets include {EXAMPLES}")


def _torus(chips: int, dims: int) -> str:
    """The slice's chip grid, as libtpu names it: powers of two, as even as possible, smallest
    first (8 -> 2x2x2, 512 -> 8x8x8, 1024 -> 8x8x16; 2-D: 256 -> 16x16; 4 chips of v5p: 2x2x1)."""
    sides = [1] * dims
    for _ in range(int(math.log2(chips))):
        sides[sides.index(min(sides))] *= 2
    if dims == 3 and chips == 4:
        sides = [2, 2, 1]
    else:
        sides.sort()
    return "x".join(map(str, sides))


# The module that brings each platform's compiler (the extra that installs it: EXTRAS).
COMPILER_MODULES = {"tpu": "libtpu", "gpu": "jax_plugins.xla_cuda12"}


def compiler_available(platform: str) -> bool:
    module = COMPILER_MODULES.get(platform)
    if module is None:
        return True
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a dotted name whose package (jax_plugins) is not installed
        return False


def check_compiler(target: Target) -> None:
    """A target whose compiler is not installed is refused, naming the extra that installs it."""
    if not compiler_available(target.platform):
        raise ConfigError(
            f"--target={target.spec}: the {target.platform.upper()} compiler is not installed; "
            f"{EXTRAS[target.platform]}"
        )


@functools.cache
def _topology_devices(platform: str, topology: str, target_config: str) -> tuple:
    from jax.experimental import topologies

    try:
        # The compilers' native start-up logs what a machine without the hardware lacks.
        with startup.quiet_native_logs():
            if platform == "tpu":
                # libtpu takes a machine-wide lock on load; compile-only use needs no exclusive
                # access (a test run's workers, a fit search beside a training): share it.
                os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
                startup.compile_only_tpu_environment(_slice_name(topology))
                desc = topologies.get_topology_desc(platform="tpu", topology_name=topology)
            else:
                config = (HERE / target_config).read_text()
                desc = topologies.get_topology_desc(
                    platform="cuda", target_config=config, topology=topology
                )
    except Exception as e:  # noqa: BLE001 - the compiler's own refusal, reworded
        raise ConfigError(
            f"the {platform.upper()} compiler cannot describe the topology {topology}: "
            f"{str(e).splitlines()[0]}"
        ) from None
    return tuple(desc.devices)


def _slice_name(topology: str) -> str:
    """Cloud TPU's accelerator type of a libtpu topology: "v5p:8x8x8" -> "v5p-1024"."""
    kind, _, grid = topology.partition(":")
    chip = next(c for c in CHIPS.values() if c.libtpu_name == kind)
    return f"{kind}-{math.prod(int(n) for n in grid.split('x')) * chip.cores_per_chip}"


def prepare_process(target: Target) -> None:
    """Before JAX starts a backend: compile-only targets run on the CPU backend (with libtpu
    or the CUDA plugin installed JAX would otherwise try to start a TPU or GPU client), unless
    the user chose the platforms ($JAX_PLATFORMS)."""
    if not target.is_cpu:
        check_compiler(target)
        if "JAX_PLATFORMS" not in os.environ or startup.chosen_platforms() is not None:
            os.environ["JAX_PLATFORMS"] = "cpu"
        if target.platform == "tpu":
            os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
        # JAX reads JAX_PLATFORMS when it is imported, and the command's config modules import
        # it first: with other platforms chosen it would start their plugins, and the CUDA
        # plugin, failing to load CUDA on a machine without a GPU, then registers no compiler.
        jax = sys.modules.get("jax")
        if jax is not None and jax.config.jax_platforms != os.environ["JAX_PLATFORMS"]:
            jax.config.update("jax_platforms", os.environ["JAX_PLATFORMS"])
