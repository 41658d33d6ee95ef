"""The layouts of `expertax parity`: the default matrix, the `--layouts` names, and each one's
config.

A layout is a dispatch (dense or sparse; ring of experts or all-to-all with each implementation
the backend has) on a mesh of expert / fsdp / tensor / data axes (`Layout`). `default_layouts` is
the default matrix for a device count and backend; `parse_layout` reads a `--layouts` name
(`Layout.name` writes it); `layout_config` is the base config under a layout.

A layout may pipeline the layer stack (`-ppN`, `ici_pipeline_parallelism`; `-mbM` for
`num_pipeline_microbatches`, default the stages; `-rR` for `num_pipeline_repeats`, circular): the
stages, with EP/FSDP/TP/data inside each, must give the reference's losses too. The default matrix
pipelines only the models whose pipelined layers divide into its stages x repeats
(`pipeline_misfit`); for the others those layouts are listed as skipped (a fact of the model, not
a failure of the layout), whereas a pipeline layout named in `--layouts` that the model cannot
take is refused like any other.

A layout may run its MoE stack with the paged stash (`-stash` in its name, `moe_paged_stash`,
nn/moe/stash.py): its losses must equal the reference's like any other layout's. A stash layout
keeps the routed experts' grouped-matmul outputs (a remat policy change, which moves the loss by
float32 rounding at most) when the base config keeps none of them, so the stash has rows to hold
(`stash_overrides`).
"""

from __future__ import annotations

import dataclasses
import math

from expertax import platform
from expertax.config.schema import Config
from expertax.errors import ConfigError
from expertax.nn.moe.strategy import a2a_impls
from expertax.parallel import remat
from expertax.preflight import build_config

# Meshes for 8 devices (axis sizes); `meshes_for` scales them to the visible devices.
MESHES_8 = (
    {"expert": 8},
    {"fsdp": 8},
    {"expert": 4, "fsdp": 2},
    {"expert": 2, "tensor": 2, "data": 2},
)
# The 8-device meshes whose sparse layouts also run with the paged stash.
STASH_MESHES_8 = ({"expert": 4, "fsdp": 2},)
# The 8-device meshes whose sparse layouts also run with expert-as-TP rules (`-eptp`,
# `sharding_rules=ep-tp`): together they shard over fsdp, data and tensor besides expert.
EPTP_MESHES_8 = ({"expert": 2, "fsdp": 2, "tensor": 2}, {"expert": 2, "tensor": 2, "data": 2})
# The 8-device meshes pipelined over 2 or 4 stages with EP and FSDP inside the stages: sparse
# layouts run on `PIPELINE_MESHES_8`, the dense dispatch on `PIPELINE_DENSE_MESHES_8`, and the
# circular schedule (`-r2`, 2 repeats; a ring layout) on `CIRCULAR_MESHES_8`. A model pipelines
# only where its layers divide into stages x repeats (mixtral-tiny's 2 and deepseek3-tiny's 2 MoE
# layers: the 2-stage, non-circular ones).
PIPELINE_MESHES_8 = ({"pipeline": 2, "expert": 2, "fsdp": 2}, {"pipeline": 4, "expert": 2})
PIPELINE_DENSE_MESHES_8 = ({"pipeline": 2, "fsdp": 4},)
CIRCULAR_MESHES_8 = ({"pipeline": 2, "expert": 2, "fsdp": 2},)
# Context-parallel rows (name part `cpN`), each with its dispatch; the last runs without the
# load-balanced reorder (`-nolb`). Every one on packed data in the tests
# (tests/distributed/test_parity_context.py).
CONTEXT_LAYOUTS_8 = (
    ("sparse", "padded", {"context": 2, "expert": 2, "fsdp": 2}, True),
    ("sparse", "ring", {"context": 4, "expert": 2}, True),
    ("dense", "-", {"context": 8}, True),
    ("sparse", "ring", {"pipeline": 2, "context": 2, "expert": 2}, True),
    ("sparse", "padded", {"context": 2, "expert": 2, "tensor": 2}, True),
    ("sparse", "ring", {"context": 4, "expert": 2}, False),
)
# Layout name part -> rules preset (configs/parallel/); the default preset has no part.
RULES_PARTS = {"eptp": "ep-tp"}


@dataclasses.dataclass(frozen=True)
class Layout:
    """One row of the table: the dispatch, the mesh, the pipeline schedule, the rules preset and
    whether the MoE stack is stashed."""

    mode: str  # "sparse" | "dense"
    ring: bool
    a2a_impl: str  # "ragged" | "padded" | "-" (not used: ring or dense)
    ep: int = 1
    fsdp: int = 1
    tp: int = 1
    data: int = 1
    stash: bool = False  # moe_paged_stash (sparse layouts only)
    rules: str = "default"  # sharding_rules preset
    pp: int = 1  # pipeline stages (ici_pipeline_parallelism)
    cp: int = 1  # context parallelism (ici_context_parallelism)
    balance: bool = True  # context_parallel_load_balance (`-nolb`: off)
    cp_ring: bool = False  # context_parallel_strategy=ring (`-cpring`; else all_gather)
    microbatches: int = -1  # num_pipeline_microbatches (-1: the stages)
    repeats: int = 1  # num_pipeline_repeats (circular schedule)

    @property
    def num_devices(self) -> int:
        return self.pp * self.cp * self.ep * self.fsdp * self.tp * self.data

    @property
    def pipeline_microbatches(self) -> int:
        """Microbatches per step as the config resolves them (-1 -> the stages)."""
        return self.pp if self.microbatches == -1 else self.microbatches

    @property
    def pipeline_parts(self) -> list[str]:
        """The name parts of the pipeline: `ppN`, then `mbM` and `rR` when not the defaults."""
        if self.pp == 1:
            return []
        parts = [f"pp{self.pp}"]
        parts += [f"mb{self.microbatches}"] if self.microbatches != -1 else []
        return parts + ([f"r{self.repeats}"] if self.repeats != 1 else [])

    @property
    def name(self) -> str:
        """The `--layouts` spelling: `parse_layout(layout.name) == layout` on this backend."""
        parts = [self.mode]
        if self.ring:
            parts.append("ring")
        elif self.a2a_impl != "-":
            parts.append(self.a2a_impl)
        parts += self.pipeline_parts
        parts += [f"cp{self.cp}"] if self.cp != 1 else []
        sizes = (("ep", self.ep), ("fsdp", self.fsdp), ("tp", self.tp), ("data", self.data))
        parts += [f"{k}{v}" for k, v in sizes if v != 1]
        parts += [part for part, preset in RULES_PARTS.items() if preset == self.rules]
        if self.stash:
            parts.append("stash")
        if self.cp != 1 and not self.balance:
            parts.append("nolb")
        if self.cp != 1 and self.cp_ring:
            parts.append("cpring")
        return "-".join(parts)

    def overrides(self, global_batch: int) -> dict:
        return {
            "sparse_matmul": self.mode == "sparse",
            "use_ring_of_experts": self.ring,
            "a2a_impl": "auto" if self.a2a_impl == "-" else self.a2a_impl,
            "capacity_factor": -1.0,
            "ici_expert_parallelism": self.ep,
            "ici_fsdp_parallelism": self.fsdp,
            "ici_tensor_parallelism": self.tp,
            "ici_data_parallelism": self.data,
            "ici_pipeline_parallelism": self.pp,
            "ici_context_parallelism": self.cp,
            "context_parallel_load_balance": self.balance,
            "context_parallel_strategy": "ring" if self.cp_ring else "all_gather",
            "num_pipeline_microbatches": self.microbatches,
            "num_pipeline_repeats": self.repeats,
            "per_device_batch_size": global_batch / self.num_devices,
            "moe_paged_stash": self.stash,
            "sharding_rules": self.rules,
        }


def stash_overrides(base: Config) -> dict:
    """What a stash layout sets besides `moe_paged_stash`: when `base` keeps none of the stashable
    names, a custom remat policy keeping all of them on device (everything else rematerialized)."""
    if remat.stashed_names(base):
        return {}
    return {"remat_policy": "custom", **dict.fromkeys(remat.STASHABLE, remat.DEVICE)}


def meshes_for(num_devices: int, meshes_8=MESHES_8) -> list[dict]:
    """The 8-device meshes scaled down (halving the largest axis, the pipeline last among equals)
    to fit `num_devices`, without axes of size one and without repeats."""
    out = []
    for mesh in meshes_8:
        mesh = dict(mesh)
        while math.prod(mesh.values()) > num_devices:
            big = max(mesh, key=lambda axis: (mesh[axis], axis != "pipeline"))
            mesh[big] //= 2
        mesh = {axis: size for axis, size in mesh.items() if size > 1}
        if mesh not in out:
            out.append(mesh)
    return out


def _sizes(mesh: dict) -> dict:
    return {
        "pp": mesh.get("pipeline", 1),
        "cp": mesh.get("context", 1),
        "ep": mesh.get("expert", 1),
        "fsdp": mesh.get("fsdp", 1),
        "tp": mesh.get("tensor", 1),
        "data": mesh.get("data", 1),
    }


def default_layouts(num_devices: int, backend: str) -> list[Layout]:
    """The default matrix: every mesh with each sparse dispatch and the dense one, then the
    sparse layouts of `STASH_MESHES_8` with the paged stash and of `EPTP_MESHES_8` with
    expert-as-TP rules, then the pipelined ones (`pipeline_layouts`)."""
    rows = []
    for mesh in meshes_for(num_devices):
        sizes = _sizes(mesh)
        for impl in a2a_impls(backend):
            rows.append(Layout("sparse", False, impl, **sizes))
        rows.append(Layout("sparse", True, "-", **sizes))
        rows.append(Layout("dense", False, "-", **sizes))
    for mesh in meshes_for(num_devices, STASH_MESHES_8):
        sizes = _sizes(mesh)
        for impl in a2a_impls(backend):
            rows.append(Layout("sparse", False, impl, **sizes, stash=True))
        rows.append(Layout("sparse", True, "-", **sizes, stash=True))
    for mesh in meshes_for(num_devices, EPTP_MESHES_8):
        if mesh.get("expert", 1) == 1:
            continue  # scaled down to no expert axis: expert-as-TP is the default layout
        sizes = _sizes(mesh)
        for impl in a2a_impls(backend):
            rows.append(Layout("sparse", False, impl, **sizes, rules="ep-tp"))
        rows.append(Layout("sparse", True, "-", **sizes, rules="ep-tp"))
    return rows + pipeline_layouts(num_devices, backend) + context_layouts(num_devices)


def context_layouts(num_devices: int) -> list[Layout]:
    """`CONTEXT_LAYOUTS_8` scaled down to `num_devices` (a mesh left without a context axis, or
    one already listed, is left out)."""
    rows: list[Layout] = []
    for mode, impl, mesh_8, balance in CONTEXT_LAYOUTS_8:
        mesh = meshes_for(num_devices, (mesh_8,))[0]
        layout = Layout(mode, impl == "ring", "-" if impl == "ring" else impl, **_sizes(mesh),
                        balance=balance)  # fmt: skip
        if layout.cp > 1 and layout not in rows:
            rows.append(layout)
    return rows


def pipeline_layouts(num_devices: int, backend: str) -> list[Layout]:
    """Every sparse dispatch on `PIPELINE_MESHES_8`, the dense one on `PIPELINE_DENSE_MESHES_8`
    and a circular ring layout (2 repeats) on `CIRCULAR_MESHES_8`; meshes scaled down to one
    stage are left out (they are the unpipelined layouts)."""
    staged = lambda meshes: [m for m in meshes_for(num_devices, meshes) if m.get("pipeline", 1) > 1]
    rows = []
    for mesh in staged(PIPELINE_MESHES_8):
        for impl in a2a_impls(backend):
            rows.append(Layout("sparse", False, impl, **_sizes(mesh)))
        rows.append(Layout("sparse", True, "-", **_sizes(mesh)))
    for mesh in staged(PIPELINE_DENSE_MESHES_8):
        rows.append(Layout("dense", False, "-", **_sizes(mesh)))
    for mesh in staged(CIRCULAR_MESHES_8):
        rows.append(Layout("sparse", True, "-", **_sizes(mesh), repeats=2))
    return rows


# Layout name part (letters before the number) -> Layout field.
SIZE_PARTS = {
    "pp": "pp",
    "cp": "cp",
    "mb": "microbatches",
    "r": "repeats",
    "ep": "ep",
    "fsdp": "fsdp",
    "tp": "tp",
    "data": "data",
}


def parse_layout(name: str, backend: str | None = None) -> Layout:
    """`sparse-padded-ep8`, `sparse-ring-ep4-fsdp2-stash`, `sparse-ring-ep2-tp2-data2-eptp`,
    `dense-ep2-tp2-data2`, `sparse-ring-pp2-ep2-fsdp2`, `dense-pp2-mb4-r2-fsdp4`, ... -> Layout.
    `cpN` is the context axis, `nolb` its load balancing off, `cpring` its ring strategy.
    A sparse all-to-all layout without an implementation (`sparse-ep8`) takes the first one
    `backend` has (the platform compiled for; default `platform.current()`)."""
    mode, *parts = name.split("-")
    sizes: dict[str, int] = {}
    ring, impl, stash, rules, balance, cp_ring = False, "-", False, "default", True, False
    for part in parts:
        key = part.rstrip("0123456789")
        if part == "stash":
            stash = True
        elif part == "nolb":
            balance = False
        elif part == "cpring":
            cp_ring = True
        elif part in RULES_PARTS:
            rules = RULES_PARTS[part]
        elif part in ("ring", "ragged", "padded"):
            ring, impl = (True, "-") if part == "ring" else (False, part)
        elif key in SIZE_PARTS and part[len(key) :].isdigit():
            if int(part[len(key) :]) < 1:
                raise ConfigError(f"--layouts {name!r}: {part!r} must be a positive {key} size")
            sizes[SIZE_PARTS[key]] = int(part[len(key) :])
        else:
            raise ConfigError(
                f"--layouts {name!r}: unknown part {part!r} (e.g. sparse-ring-ep8; sizes "
                f"{', '.join(k + 'N' for k in SIZE_PARTS)}; {', '.join(RULES_PARTS)}, stash, "
                "nolb, cpring)"
            )
    if mode not in ("sparse", "dense") or (mode == "dense" and (ring or impl != "-")):
        raise ConfigError(f"--layouts {name!r}: use sparse-[ring|ragged|padded]-... or dense-...")
    if mode == "dense" and stash:
        raise ConfigError(f"--layouts {name!r}: the paged stash needs sparse dispatch (sparse-...)")
    if sizes.get("pp", 1) == 1 and ({"microbatches", "repeats"} & set(sizes)):
        raise ConfigError(
            f"--layouts {name!r}: mbM (microbatches) and rR (repeats) set the pipeline schedule; "
            "add ppN with N > 1 stages (e.g. sparse-ring-pp2-mb4-ep2)"
        )
    on = backend or platform.current()
    if mode == "sparse" and not ring and impl == "-":
        impl = a2a_impls(on)[0]
    if impl not in ("-", *a2a_impls(on)) and sizes.get("ep", 1) > 1:
        raise ConfigError(
            f"--layouts {name!r}: XLA on {on} has no {impl} all-to-all (the expert exchange of "
            f"ep{sizes['ep']}); use {name.replace(impl, a2a_impls(on)[0])} or a ring layout"
        )
    if cp_ring and sizes.get("cp", 1) == 1:
        raise ConfigError(f"--layouts {name!r}: cpring passes keys round the context axis; add cpN")
    return Layout(
        mode, ring, impl, **sizes, stash=stash, rules=rules, balance=balance, cp_ring=cp_ring
    )


def reference_layout() -> Layout:
    return Layout("sparse", False, "-")


def layout_config(base: Config, layout: Layout, global_batch: int) -> Config:
    """`base` under `layout`; raises ConfigError when the config checks refuse the layout."""
    extra = stash_overrides(base) if layout.stash else {}
    return build_config({**base.model_dump(), **layout.overrides(global_batch), **extra})


def pipeline_misfit(base: Config, layout: Layout) -> str | None:
    """Why `base`'s pipelined layers do not divide into `layout`'s stages x repeats, or None
    (the default matrix skips such a layout for this model rather than failing it)."""
    if layout.pp == 1:
        return None
    staged = base.model_copy(update={"ici_pipeline_parallelism": layout.pp})
    layers, stages = staged.pipelined_layers, staged.pipeline_stages
    if layers % (stages * layout.repeats) == 0:
        return None
    stack = "MoE" if staged.pipelined_stack == "moe" else "dense"
    return (
        f"this model's {layers} pipelined {stack} layers do not divide into "
        f"{stages} stages x {layout.repeats} repeats"
    )
