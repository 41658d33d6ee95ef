"""`expertax parity`: the same model, weights and data under many layouts, one loss table.

Every layout (dense or sparse dispatch; ring of experts or all-to-all with each implementation
the backend has; a mesh of expert / fsdp / tensor / data axes) trains from the same initial
weights (initialization does not depend on the sharding) on the same synthetic batches, and its
per-step losses are compared with the single-device reference run. A layout fails when
max_step |loss - reference| exceeds `TOLERANCE[dtype]` x |reference|. A layout the config checks
refuse (an expert axis that does not divide num_experts, more devices than visible, ...) fails
the table too, with its reason in its row, unless refusals are asked to be skipped
(`expertax parity --skip-refused`): then it is listed as skipped and not counted.

A layout may pipeline the layer stack (`-ppN`, `ici_pipeline_parallelism`; `-mbM` for
`num_pipeline_microbatches`, default the stages; `-rR` for `num_pipeline_repeats`, circular): the
stages, with EP/FSDP/TP/data inside each, must give the reference's losses too. The default matrix
pipelines only the models whose pipelined layers divide into its stages x repeats; for the others
those layouts are listed as skipped (a fact of the model, not a failure of the layout), whereas a
pipeline layout named in `--layouts` that the model cannot take is refused like any other.

A layout may run its MoE stack with the paged stash (`-stash` in its name, `moe_paged_stash`,
nn/moe/stash.py): its losses must equal the reference's like any other layout's. A stash layout
keeps the routed experts' grouped-matmul outputs (a remat policy change, which moves the loss by
float32 rounding at most) when the base config keeps none of them, so the stash has rows to hold.

Each row also counts its routing flips (tools/parity_routing.py): per MoE layer, the (token, slot)
decisions of the first step whose expert differs from the reference's, a top-k near-tie that a
layout's rounding tipped the other way. With `impose_routing` (`--impose-routing`) the first
step's loss is also compared with the reference's routing imposed on the layout. A row out of
tolerance passes only when flips explain it: it flips, and with the routing imposed its loss is
within tolerance (`parity_routing.verdict`).

With multi-token prediction (`mtp_num_layers` > 0) the compared loss is the objective's
cross-entropy part, the main loss + mtp_loss_scaling_factor x the MTP loss, so that the MTP
modules' forward is held to the reference as well as the training it drives.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Callable

import jax
import numpy as np

from expertax import platform, progress
from expertax.config.loader import build_config
from expertax.config.schema import Config
from expertax.data.synthetic import SyntheticData
from expertax.errors import ConfigError
from expertax.parallel import remat
from expertax.tools import parity_routing
from expertax.train.trainer import build_trainer

# Relative tolerance on the loss, per compute dtype (the one table; loosening it is reviewed).
TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2, "float16": 1e-2}

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


def a2a_impls(backend: str) -> tuple[str, ...]:
    """The all-to-all implementations this backend has (XLA:CPU has no ragged all-to-all)."""
    return ("ragged", "padded") if backend in ("gpu", "cuda", "rocm", "tpu") else ("padded",)


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


def layouts(num_devices: int, backend: str) -> list[Layout]:
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
    if mode == "sparse" and not ring and impl == "-":
        impl = a2a_impls(backend or platform.current())[0]
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


def refusal(base: Config, layout: Layout, global_batch: int, devices=None) -> str | None:
    """Why the config checks refuse `layout` on `devices` (default: this process's) (config and
    mesh, nothing compiled), or None."""
    devices = list(jax.devices() if devices is None else devices)
    try:
        c = layout_config(base, layout, global_batch)
        build_trainer(c, devices=devices[: layout.num_devices])
    except ConfigError as e:
        return str(e)
    return None


def run_layout(
    base: Config,
    layout: Layout,
    *,
    steps: int,
    global_batch: int,
    corrupt: Callable | None = None,
    routing: list | None = None,
    packed: bool = False,
) -> dict:
    """Train `steps` steps of `base` under `layout`; per-step losses and throughput.

    `corrupt(state, trainer) -> state` is a test hook applied to the initial state (the negative
    control: a deliberately mis-sharded weight must fail the table).
    `routing`: the routings to probe the first batch with (parity_routing.probe: None for the
    routers' own, an array to impose), when the layout can be probed; their results in "probes".
    """
    c = layout_config(base, layout, global_batch)
    devices = jax.devices()[: layout.num_devices]
    data = SyntheticData(
        vocab_size=c.vocab_size,
        seq_len=c.max_target_length,
        global_batch=global_batch,
        seed=c.data_shuffle_seed,
    )
    batches = [data.batch_at(i) for i in range(steps)]
    if packed:
        batches = [pack(b, i) for i, b in enumerate(batches)]
    probes = None
    if routing and corrupt is None and parity_routing.probed(c):
        probes = parity_routing.probe(c, devices, batches[0], routing)
    trainer = build_trainer(c, devices=devices)
    state = trainer.init_state()
    step_fn = trainer.compile()
    if corrupt is not None:
        state = corrupt(state, trainer)
    losses = []

    def loss(m):  # the main loss, plus the weighted MTP loss with MTP (module docstring)
        return (
            m["loss"] + c.mtp_loss_scaling_factor * m["mtp_loss"] if "mtp_loss" in m else m["loss"]
        )

    with trainer.context():
        state, m = step_fn(state, trainer.put_batch(batches[0]))  # warm-up, not timed
        losses.append(loss(m))
        jax.block_until_ready(m)
        t0 = time.perf_counter()
        for batch in batches[1:]:
            state, m = step_fn(state, trainer.put_batch(batch))
            losses.append(loss(m))
        jax.block_until_ready(losses)
        dt = time.perf_counter() - t0
    tokens = global_batch * c.max_target_length * (steps - 1)
    return {
        "losses": [float(x) for x in jax.device_get(losses)],
        # None with one step: it is the untimed warm-up
        "tokens_per_s_per_device": tokens / dt / trainer.num_devices if steps > 1 else None,
        "probes": probes,
    }


def pack(batch: dict, step: int) -> dict:
    """`batch` as packed data: each row cut into up to three documents at random points (seeded
    by `step`), positions from 0 per document, no target across a document's end."""
    rng = np.random.default_rng(step)
    b, t = batch["inputs"].shape
    out = dict(batch)
    seg, pos, w = (np.empty((b, t), np.int32) for _ in range(3))
    for r in range(b):
        cuts = np.sort(rng.choice(np.arange(1, t), size=min(2, t - 1), replace=False))
        seg[r] = 1 + np.searchsorted(cuts, np.arange(t), side="right")
        starts = np.concatenate([[0], cuts])[seg[r] - 1]
        pos[r] = np.arange(t) - starts
        w[r] = np.append(seg[r, 1:] == seg[r, :-1], True)
    out.update(segment_ids=seg, positions=pos, weights=batch["weights"] * w)
    return out


def make_row(layout: Layout, run: dict, ref_losses: list[float], ref_probe: dict | None = None):
    """The row of `layout`; with the reference's probe (`ref_probe`, {"loss", "chosen"}) and the
    layout's probes (run["probes"]: its own routing, then the imposed one if any), its routing
    flips per MoE layer and the first step's |dloss| under the imposed routing."""
    diff = max(abs(a - b) for a, b in zip(run["losses"], ref_losses, strict=True))
    final = run["losses"][-1]
    probes = run.get("probes")
    flips = imposed = None
    if probes and ref_probe is not None:
        flips = parity_routing.count_flips(ref_probe["chosen"], probes[0]["chosen"])
        if len(probes) > 1:
            imposed = abs(probes[1]["loss"] - ref_probe["loss"])
    return {
        "mode": layout.mode,
        "ring": layout.ring,
        "a2a_impl": layout.a2a_impl,
        "pp": layout.pp,
        "cp": layout.cp,
        "load_balance": layout.balance,
        "cp_ring": layout.cp_ring,
        "microbatches": layout.pipeline_microbatches,
        "repeats": layout.repeats,
        "ep": layout.ep,
        "fsdp": layout.fsdp,
        "tp": layout.tp,
        "data": layout.data,
        "stash": layout.stash,
        "sharding_rules": layout.rules,
        "final_loss": final,
        "perplexity": float(np.exp(min(final, 80.0))),
        "tokens_per_s_per_device": run["tokens_per_s_per_device"],
        "max_abs_loss_diff": diff,
        "routing_flips": flips,
        "imposed_loss_diff": imposed,
    }


def parity_table(
    base: Config,
    *,
    steps: int,
    layout_list: list[Layout] | None = None,
    skip_refused: bool = False,
    corrupt: dict | None = None,
    echo=print,
    impose_routing: bool = False,
    packed: bool = False,
) -> dict:
    """Run the reference and every layout.

    Returns {"rows", "refused", "skipped", "skip_refused", "tolerance", "reference_losses",
    "ok"}: `rows` for the layouts that trained, `refused` ({"layout", "reason"}) for those the
    config checks refused, `skipped` (the same fields) for the default matrix's pipeline layouts
    that `base`'s layers do not divide into (`pipeline_misfit`; never counted against `ok`).
    `ok` needs every row's `parity_routing.verdict` and, unless `skip_refused`, no refusal.
    A table where no layout trained is not ok (it compared nothing).
    Each layout the routing probe can run (parity_routing.probed; none with a `corrupt` hook) is
    probed on the first batch: its routing flips against the reference's; with `impose_routing`
    also its first-step loss under the reference's routing.
    `corrupt` maps a Layout to a `corrupt(state, trainer)` hook (tests only).
    """
    n = len(jax.devices())
    skipped = []
    if layout_list is None:
        layout_list = []
        for layout in layouts(n, platform.of_devices(jax.devices())):
            misfit = pipeline_misfit(base, layout)
            if misfit is None:
                layout_list.append(layout)
            else:
                skipped.append({"layout": layout.name, "reason": misfit})
                echo(f"skipped {layout.name}: {misfit}")
    global_batch = int(base.per_device_batch_size * n)
    tol = TOLERANCE[base.dtype]
    refused, runnable = [], []
    for layout in layout_list:  # refusals first: they cost no compile
        reason = refusal(base, layout, global_batch)
        if reason is None:
            runnable.append(layout)
        else:
            refused.append({"layout": layout.name, "reason": reason})
            echo(f"{'skipped' if skip_refused else 'REFUSED'} {layout.name}: {reason}")
    rows, ref_losses = [], []
    bar = progress.bar(len(runnable) + 1 if runnable else 0, "parity", unit="layout")
    say = progress.say_above(bar, echo)
    probe = any(
        parity_routing.probed(layout_config(base, layout, global_batch))
        and layout not in (corrupt or {})
        for layout in runnable
    )
    ref_probe = None
    if runnable:
        bar.set_postfix_str("reference")
        ref = run_layout(
            base,
            reference_layout(),
            steps=steps,
            global_batch=global_batch,
            routing=[None] if probe else None,
            packed=packed,
        )
        ref_losses, ref_probe = ref["losses"], (ref.get("probes") or [None])[0]
        bar.update(1)
        say(f"reference (1 device): final loss {ref_losses[-1]:.6f} after {steps} steps")
    for layout in runnable:
        bar.set_postfix_str(layout.name)
        hook = (corrupt or {}).get(layout)
        routing = None
        if ref_probe is not None:
            routing = [None, ref_probe["chosen"]] if impose_routing else [None]
        run = run_layout(
            base, layout, steps=steps, global_batch=global_batch, corrupt=hook, routing=routing,
            packed=packed,
        )  # fmt: skip
        rows.append(make_row(layout, run, ref_losses, ref_probe))
        bar.update(1)
        say(format_row(rows[-1], tol, ref_losses))
    bar.close()
    bound = tol * max((abs(x) for x in ref_losses), default=0.0)
    ok = all(parity_routing.verdict(r, bound)[0] for r in rows) and (skip_refused or not refused)
    ok = ok and bool(rows)
    return {
        "rows": rows,
        "refused": refused,
        "skipped": skipped,
        "skip_refused": skip_refused,
        "tolerance": tol,
        "reference_losses": ref_losses,
        "ok": ok,
    }


HEADER = (
    "mode",
    "ring",
    "a2a",
    "PP",
    "CP",
    "EP",
    "FSDP",
    "TP",
    "data",
    "stash",
    "rules",
    "final loss",
    "perplexity",
    "tok/s/dev",
    "max |dloss|",
    "routing flips",
    "imposed |dloss|",
    "ok",
)


def pp_cell(pp: int, microbatches: int, repeats: int) -> str:
    """The PP column: the stages, with the microbatches and repeats when not the defaults."""
    extra = ([f"mb{microbatches}"] if microbatches != pp else []) + (
        [f"r{repeats}"] if repeats != 1 else []
    )
    return " ".join([str(pp), *extra])


def cp_cell(cp: int, balance: bool, ring: bool = False) -> str:
    """The CP column: the context axis, `nolb` when its load balancing is off, `ring` under
    context_parallel_strategy=ring."""
    if cp == 1:
        return "1"
    return " ".join([str(cp)] + (["nolb"] if not balance else []) + (["ring"] if ring else []))


def format_row(r: dict, tol: float, ref_losses: list[float]) -> str:
    _, ok = parity_routing.verdict(r, tol * max(abs(x) for x in ref_losses))
    imposed = r.get("imposed_loss_diff")
    pp = r.get("pp", 1)  # rows written before pipeline layouts have no pp
    cells = (
        r["mode"],
        str(r["ring"]),
        r["a2a_impl"],
        pp_cell(pp, r.get("microbatches", pp), r.get("repeats", 1)),
        cp_cell(r.get("cp", 1), r.get("load_balance", True), r.get("cp_ring", False)),
        r["ep"],
        r["fsdp"],
        r["tp"],
        r["data"],
        "yes" if r.get("stash") else "no",
        r.get("sharding_rules", "default"),
        f"{r['final_loss']:.6f}",
        f"{r['perplexity']:.3f}",
        "-" if r["tokens_per_s_per_device"] is None else f"{r['tokens_per_s_per_device']:,.0f}",
        f"{r['max_abs_loss_diff']:.2e}",
        parity_routing.format_flips(r.get("routing_flips")),
        "-" if imposed is None else f"{imposed:.2e}",
        ok,
    )
    return "| " + " | ".join(str(x) for x in cells) + " |"


def format_refused_row(refused: dict, skipped: bool, why: str = "refused") -> str:
    """A refused (or skipped) layout's row: its name in the first cells, the reason in the last."""
    layout = parse_layout(refused["layout"])
    pp = pp_cell(layout.pp, layout.pipeline_microbatches, layout.repeats)
    cp = cp_cell(layout.cp, layout.balance, layout.cp_ring)
    cells = [layout.mode, str(layout.ring), layout.a2a_impl, pp, cp, layout.ep, layout.fsdp]
    cells += [layout.tp, layout.data, "yes" if layout.stash else "no", layout.rules]
    cells += ["-"] * 6
    word = "skipped" if skipped else "NO"
    cells.append(f"{word} ({why}: {refused['reason'].replace('|', '/')})")
    return "| " + " | ".join(str(x) for x in cells) + " |"


def format_table(result: dict) -> str:
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    for r in result["rows"]:
        lines.append(format_row(r, result["tolerance"], result["reference_losses"]))
    for r in result.get("refused", []):
        lines.append(format_refused_row(r, result.get("skip_refused", False)))
    for r in result.get("skipped", []):
        lines.append(format_refused_row(r, True, why="model"))
    return "\n".join(lines)


def write_json(result: dict, path: str) -> None:
    keep = ("rows", "refused", "skipped", "skip_refused", "tolerance", "ok")
    with open(path, "w") as f:
        json.dump({k: result[k] for k in keep if k in result}, f, indent=1)
