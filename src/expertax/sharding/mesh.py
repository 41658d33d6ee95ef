"""The device mesh: axes (pipeline, data, fsdp, context, expert, tensor) sized from ici_* and
dcn_* keys."""

from __future__ import annotations

import math

import jax
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from expertax.config.schema import MESH_AXES, Config
from expertax.errors import ConfigError

# Auto axis types, chosen deliberately: GSPMD propagates shardings outside the MoE layer (the
# rules table places parameters and block-boundary activations), and the MoE dispatch is an
# explicit `shard_map`. Explicit types (JAX's make_mesh default) would put shardings into every
# array type and require every op outside the shard_map to resolve them by hand.
AXIS_TYPES = (AxisType.Auto,) * len(MESH_AXES)


def _resolve(c: Config, prefix: str, total: int) -> list[int]:
    keys = [f"{prefix}_{a}_parallelism" for a in MESH_AXES]
    sizes = [getattr(c, k) for k in keys]
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        if total % known:
            fill = keys[sizes.index(-1)]
            raise ConfigError(
                f"{fill}=-1 cannot fill the mesh: {total} devices are not divisible by the product "
                f"{known} of the other {prefix}_*_parallelism values"
            )
        sizes[sizes.index(-1)] = total // known
    if math.prod(sizes) != total:
        shown = ", ".join(f"{k}={getattr(c, k)}" for k in keys if getattr(c, k) != 1)
        raise ConfigError(
            f"the {prefix}_*_parallelism product is {math.prod(sizes)} ({shown or 'all 1'}) but "
            f"{total} devices are available; make the product {total} or set one axis to -1"
        )
    return sizes


def mesh_shape(c: Config, num_devices: int, num_slices: int = 1) -> dict[str, int]:
    """Axis sizes (ici x dcn) for `num_devices` devices in `num_slices` slices (hosts)."""
    dcn = _resolve(c, "dcn", num_slices)
    ici = _resolve(c, "ici", num_devices // num_slices)
    return {a: i * d for a, i, d in zip(MESH_AXES, ici, dcn, strict=True)}


def check_mesh_fit(c: Config, shape: dict[str, int]) -> None:
    """Divisibility checks that need the mesh; they raise ConfigError before any compilation."""
    ep, tp = shape["expert"], shape["tensor"]
    if c.is_moe and c.num_experts % ep:
        raise ConfigError(
            f"num_experts={c.num_experts} is not divisible by the expert axis ({ep}, from "
            f"ici_expert_parallelism={c.ici_expert_parallelism}); use a divisor of {c.num_experts}"
        )
    if c.base_num_query_heads % tp:
        raise ConfigError(
            f"base_num_query_heads={c.base_num_query_heads} is not divisible by the tensor axis "
            f"({tp}, from ici_tensor_parallelism={c.ici_tensor_parallelism})"
        )
    if c.attention_type == "gqa" and c.base_num_kv_heads % tp:
        raise ConfigError(
            f"base_num_kv_heads={c.base_num_kv_heads} is not divisible by the tensor axis ({tp})"
        )
    check_context_fit(c, shape)
    batch_shards = shape["data"] * shape["fsdp"] * shape["expert"]
    devices = math.prod(shape.values())
    global_batch = c.per_device_batch_size * devices
    if global_batch != int(global_batch) or int(global_batch) % batch_shards:
        raise ConfigError(
            f"per_device_batch_size={c.per_device_batch_size} x {devices} devices = {global_batch} "
            f"sequences, which must be a whole multiple of the batch shards "
            f"(data x fsdp x expert = {batch_shards})"
        )
    chunks = c.num_moe_token_chunks
    shard_tokens = int(global_batch) * c.max_target_length // batch_shards
    if c.is_moe and shard_tokens % chunks:
        valid = [d for d in range(1, min(shard_tokens, 64) + 1) if shard_tokens % d == 0]
        raise ConfigError(
            f"num_moe_token_chunks={chunks} does not divide the {shard_tokens} tokens per batch "
            f"shard (global batch {int(global_batch)} x max_target_length={c.max_target_length} "
            f"/ data x fsdp x expert = {batch_shards}); use a divisor such as {valid[-4:]}"
        )


def context_pieces(c: Config, shape: dict[str, int]) -> tuple[int, int, str]:
    """The context axis's size, the chunks each sequence is cut into over it (2 per device with
    context_parallel_load_balance), and how (for messages)."""
    cp = shape.get("context", 1)
    if c.context_parallel_load_balance:
        return cp, 2 * cp, "2 x context"
    return cp, cp, "context"


def check_context_fit(c: Config, shape: dict[str, int]) -> None:
    """The sequence must split evenly over the context axis: into cp chunks, or 2cp with
    context_parallel_load_balance (nn/attention/context.py). Whole kernel blocks per chunk are the
    kernel's check (`nn.attention.context_checks.check_layout`)."""
    cp, pieces, how = context_pieces(c, shape)
    t = c.max_target_length
    if cp > 1 and t % pieces:
        raise ConfigError(
            f"max_target_length={t} does not split into {pieces} equal chunks "
            f"({how}, from ici_context_parallelism={c.ici_context_parallelism}); use a multiple "
            f"of {pieces}"
        )


def check_context_rules(c: Config, shape: dict[str, int], rules) -> None:
    """A context axis above one needs rules that split the sequence over it: else every context
    shard would compute the same tokens (a run that looks faster per device and trains nothing
    more)."""
    cp = shape.get("context", 1)
    if cp > 1 and "context" not in tuple(rules.get("length", ())):
        raise ConfigError(
            f"ici_context_parallelism x dcn_context_parallelism = {cp} but sharding_rules="
            f"{c.sharding_rules!r} maps length -> {list(rules.get('length', ()))}: the sequence "
            "would not be split over the context axis; add context to the preset's `length` "
            "rule (as configs/parallel/default.yml does) or set ici_context_parallelism=1"
        )


def make_mesh(c: Config, devices=None) -> Mesh:
    """The mesh for `c` over `devices` (default: all), axes MESH_AXES with Auto types.

    One slice: `jax.make_mesh`'s device order, which follows the interconnect topology on GPU and
    TPU (on CPU it keeps the given order); on a TPU slice where an axis cannot take whole physical
    axes (16 x 32 on an 8x8x8 torus), one that splits physical axes; a layout neither can build
    is a ConfigError (`buildable` tells the fit search beforehand). Several slices (dcn_* > 1):
    a hybrid mesh whose dcn axes span processes (`mesh_utils.create_hybrid_device_mesh`).
    """
    devices = list(jax.devices() if devices is None else devices)
    uses_dcn = any(getattr(c, f"dcn_{a}_parallelism") != 1 for a in MESH_AXES)
    num_slices = jax.process_count() if uses_dcn else 1
    shape = mesh_shape(c, len(devices), num_slices)
    check_mesh_fit(c, shape)
    sizes = tuple(shape[a] for a in MESH_AXES)
    if num_slices == 1:
        return Mesh(lay_out(sizes, devices), MESH_AXES, axis_types=AXIS_TYPES)
    dcn = tuple(_resolve(c, "dcn", num_slices))
    ici = tuple(s // d for s, d in zip(sizes, dcn, strict=True))
    dev_array = mesh_utils.create_hybrid_device_mesh(ici, dcn, devices, process_is_granule=True)
    return Mesh(dev_array, MESH_AXES, axis_types=AXIS_TYPES)


def lay_out(sizes: tuple[int, ...], devices: list):
    """The devices as an array of `sizes`, in topology order (see `make_mesh`)."""
    try:
        return jax.make_mesh(sizes, MESH_AXES, axis_types=AXIS_TYPES, devices=devices).devices
    except (ValueError, NotImplementedError, AssertionError) as first:
        try:
            return mesh_utils.create_device_mesh(sizes, devices, allow_split_physical_axes=True)
        except (ValueError, NotImplementedError, AssertionError):
            shown = " x ".join(f"{a}={n}" for a, n in zip(MESH_AXES, sizes, strict=True) if n > 1)
            kind = getattr(devices[0], "device_kind", "?")
            raise ConfigError(
                f"the mesh {shown or '1'} cannot be laid out on {len(devices)} {kind} devices "
                f"({str(first).splitlines()[0][:160]}); choose other ici_*_parallelism sizes, "
                "e.g. powers of two that split the slice's torus dimensions"
            ) from None


def buildable(shape: dict[str, int], devices: list) -> bool:
    """Whether `make_mesh` can lay out a mesh of axis sizes `shape` on `devices`."""
    try:
        lay_out(tuple(shape.get(a, 1) for a in MESH_AXES), list(devices))
    except ConfigError:
        return False
    return True
