"""Every check of a config, before anything is traced: the config's fields against each other
(`expertax.config`), then each subsystem's own, collected here in one `check(config, mesh)`.

Who checks what: the config package knows fields only; a kernel's abilities are checked by the
nn module that owns the kernel (`nn/attention/cudnn.py`, `context_checks.py`, `kernel.py`,
`nn/moe/gmm.py`, `fp8/kernel.py`), the expert exchange's by `nn/moe/strategy.py`; the remat
names' by `parallel/checks.py`; the mesh's divisibility by `sharding/mesh.py`. Without a mesh,
`check` runs what needs the config alone (`load_config` and `build_config` do, so a refused
config never reaches a command); with one, also what needs the platform of its devices and its
shape (`train.trainer.build_trainer`, the decoder's and `generate`'s meshes). `check_paths`: the
files and folders a training run reads, by the train command before any backend starts.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from expertax import platform
from expertax.config import Config, build_fields, load_fields
from expertax.config.checks import run as run_checks
from expertax.fp8 import kernel as fp8_kernel
from expertax.nn.attention import context_checks, cudnn, kernel
from expertax.nn.moe import gmm, strategy
from expertax.parallel import checks as remat_checks
from expertax.sharding.mesh import check_mesh_fit


def check(c: Config, mesh=None) -> Config:
    """The subsystems' checks of `c` (ConfigError naming keys and values); with `mesh`, also
    those that need its devices' platform and its axis sizes. Returns `c`."""
    cudnn.check(c)
    context_checks.check(c)
    fp8_kernel.check(c)
    for each in remat_checks.CHECKS:
        each(c)
    if mesh is None:
        return c
    check_kernels(c, mesh)
    remat_checks.check_moe_chunk_offload(c, platform.of_mesh(mesh))
    check_layout(c, dict(mesh.shape))
    return c


def check_kernels(c: Config, mesh) -> None:
    """The kernels and exchanges `c` asks for exist on `mesh`'s devices: attention, the grouped
    matmuls, the all-to-all kinds XLA has there (`generate` asks it of its decoding mesh)."""
    on = platform.of_mesh(mesh)
    kernel.check_platform(c, on)
    if c.is_moe and c.sparse_matmul:
        gmm.check_backend(c.gmm_impl, on)
    strategy.check_exchange(c, on, dict(mesh.shape))


def check_paths(c: Config) -> Config:
    """The files and folders a training run of `c` reads (dataset_path, eval_dataset_path,
    tokenizer_path, load_parameters_path) exist and are of their kind, and base_output_directory
    is no file: ConfigError naming the key. Not part of `check`: a saved config whose data has
    moved since still loads for generate and convert. Returns `c`."""
    run_checks.check_paths(c)
    return c


def check_layout(c: Config, shape: dict[str, int]) -> None:
    """What a mesh of axis sizes `shape` needs of `c`: divisibility (sharding) and whole kernel
    blocks per context shard (attention); the fit search asks it of a layout before building
    one."""
    check_mesh_fit(c, shape)
    context_checks.check_layout(c, shape)


def build_config(values: Mapping[str, Any]) -> Config:
    """A flat mapping as a Config every subsystem accepts (without a mesh)."""
    return check(build_fields(values))


def load_config(*files: str | Path, overrides: Iterable[str] | Mapping[str, Any] = ()) -> Config:
    """Defaults, the `model_name` preset, YAML `files` and `overrides` (`key=value` strings or a
    mapping) as a Config every subsystem accepts (without a mesh)."""
    return check(load_fields(*files, overrides=overrides))
