"""The paged stash: the routed experts' saved activations, valid rows only, in one shared buffer.

With `moe_paged_stash=true` the outputs of the routed experts' grouped matmuls that the remat
policy keeps (`moe_mlpwi_0`, `moe_mlpwi_1`, `moe_mlpwo` placed `device` or `offload`) are not
saved per layer at their worst-case row count (the all-to-all receive buffer, the ring's gathered
rows). Their valid rows are copied, back to back, into one buffer per name shared by every MoE
layer of the stack, at a running row offset: `Stash`, threaded through the layer scan
(models/stashed_stack.py), through the MoE `shard_map` (one buffer per device) and the token-chunk
scan, down to `dispatch.expert_ffn_sorted`, the one place those matmuls run. Rows are copied a
page of `moe_paged_stash_page_rows` at a time in a loop whose trip count is the layer's real row
count, so a buffer of `capacity` rows needs one page of slack, not one layer's worst case.

Two modes. `write` (the stack's forward): copy the valid rows in, advance the offset, or, when
they do not fit in what is left, copy nothing and clear `fits` (the stack then recomputes the
layer in its backward pass). `read` (the stack's backward): rebuild each saved value at its
worst-case shape (zeros outside the valid rows, exactly what the grouped matmul produced) and
hand it to `gmm(..., given=...)`, whose forward is that value and whose backward is the grouped
matmul's own. docs/design/stash.md has the whole mechanism.

Per device, a buffer is `[capacity + page, W]` (W = F/tensor for the gate and up, D for the
output); outside the `shard_map` the devices' buffers are stacked on the leading axis, sharded
over the mesh axes of `AXES`, and `offset`, `fits`, `rows` have one entry per such device.

Under an fp8 `quantization` the gate and up are held as what the fp8 backward reads, the
activation's inputs as e4m3 tiles and their row scales: the layout is fp8's (`buffers` asks
`fp8.experts.buffers`, the module docstring there), and so are the values written and read back
(the layer's `ExpertProducts`, nn/moe/gmm.py).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from expertax.config.schema import Config
from expertax.fp8 import experts as fp8_experts
from expertax.nn.moe.vma import varying_like
from expertax.parallel import remat

WRITE, READ = "write", "read"
# The mesh axes over which a device's stashed rows differ: its tokens (data, fsdp, context,
# expert), its experts (expert) and its slice of F (tensor). The buffers are replicated over
# any other axis.
# every mesh axis the MoE tokens or experts may vary over (`pipeline` is a batch axis outside a
# pipeline; the stash itself is refused with pipeline stages, config/checks/parallel.py)
AXES = ("pipeline", "data", "fsdp", "context", "expert", "tensor")


@dataclasses.dataclass(frozen=True)
class Stash:
    """The shared buffers and the cursor into them (a pytree; `mode`, `capacity`, `page` static).

    bufs: name -> [capacity + page, W] per device, the rows' bits as unsigned integers of the
    values' width (`dtypes`: each buffer's value dtype): a copy, never arithmetic, and no
    backend widens integers (XLA:CPU converts a bfloat16 buffer to float32 whole).
    offset: int32 [1], the first free row.
    fits: bool [1], false once a row of the current layer did not fit (write mode).
    rows: int32 [1], the rows the stack's layers so far needed, fitting or not (the factor report).
    """

    bufs: dict[str, jax.Array]
    offset: jax.Array
    fits: jax.Array
    rows: jax.Array
    mode: str
    capacity: int
    page: int
    dtypes: tuple[tuple[str, str], ...]

    def dtype(self, name: str) -> jnp.dtype:
        """The value dtype of buffer `name`."""
        return jnp.dtype(dict(self.dtypes)[name])

    def with_fields(self, **kw) -> Stash:
        return dataclasses.replace(self, **kw)

    def write(self, values: dict[str, jax.Array], start, n) -> Stash:
        """Copy rows [start, start + n) of each value (same rows for all) to the buffers."""
        off = self.offset[0]
        fits = self.fits[0] & (off + n <= self.capacity)
        pages = jnp.where(fits, _cdiv(n, self.page), 0)
        r = jnp.arange(self.page, dtype=jnp.int32)

        def body(i, bufs):
            src = start + i * self.page + r
            out = {}
            for name, buf in bufs.items():
                value = values[name]
                rows = jnp.take(value, jnp.clip(src, 0, value.shape[0] - 1), axis=0)
                rows = jax.lax.bitcast_convert_type(rows.astype(self.dtype(name)), buf.dtype)
                out[name] = jax.lax.dynamic_update_slice_in_dim(buf, rows, off + i * self.page, 0)
            return out

        bufs = jax.lax.fori_loop(0, pages, body, self.bufs)
        return self.with_fields(
            bufs=bufs,
            offset=jnp.where(fits, off + n, off)[None],
            fits=fits[None],
            rows=self.rows + n,
        )

    def read(self, name: str, start, n, num_rows: int) -> jax.Array:
        """The saved value of `name` at its full shape [num_rows, W]: the n rows from the offset
        put back at rows [start, start + n), zeros elsewhere."""
        buf = self.bufs[name]
        off = self.offset[0]
        r = jnp.arange(self.page, dtype=jnp.int32)
        zeros = jnp.zeros((num_rows + self.page, buf.shape[1]), buf.dtype)
        out = varying_like(zeros, buf, n)

        def body(i, out):  # on the bits: zero bits are a zero of every value dtype
            bits = jax.lax.dynamic_slice_in_dim(buf, off + i * self.page, self.page)
            bits = jnp.where((i * self.page + r < n)[:, None], bits, jnp.zeros((), buf.dtype))
            return jax.lax.dynamic_update_slice_in_dim(out, bits, start + i * self.page, 0)

        out = jax.lax.fori_loop(0, _cdiv(n, self.page), body, out)[:num_rows]
        return jax.lax.bitcast_convert_type(out, self.dtype(name))

    def advance(self, n) -> Stash:
        return self.with_fields(offset=self.offset + n, rows=self.rows + n)


jax.tree_util.register_dataclass(
    Stash,
    data_fields=["bufs", "offset", "fits", "rows"],
    meta_fields=["mode", "capacity", "page", "dtypes"],
)


def _cdiv(a, b: int):
    return (a + b - 1) // b


def valid_rows(group_sizes_E, group_offset, num_local: int):
    """(first row, row count) of the local groups' rows in rows sorted by group."""
    sizes = group_sizes_E.astype(jnp.int32)
    if group_offset is None:
        return jnp.int32(0), jnp.sum(sizes)
    e = jnp.arange(sizes.shape[0], dtype=jnp.int32)
    start = jnp.sum(jnp.where(e < group_offset, sizes, 0))
    local = (e >= group_offset) & (e < group_offset + num_local)
    return start, jnp.sum(jnp.where(local, sizes, 0))


def run_ffn(stash: Stash | None, m: int, group_sizes_E, group_offset, num_local: int, ffn):
    """`ffn(given)` -> (y, {name: value}) with the stash: write the values, or supply them.

    `ffn` runs the grouped matmuls (or the fused routed FFN's loops) over `m` rows sorted by
    group, taking `given` (name -> saved value, or {}) in place of the values it names.
    Returns (y, stash).
    """
    if stash is None:
        return ffn({})[0], None
    start, n = valid_rows(group_sizes_E, group_offset, num_local)
    if stash.mode == READ:
        given = {name: stash.read(name, start, n, m) for name in stash.bufs}
        return ffn(given)[0], stash.advance(n)
    y, values = ffn({})
    return y, stash.write(values, start, n)


# ---------------------------------------------------------------------------------------------
# Sizes and the empty stash.


def expected_rows(c: Config, num_tokens: int, axis_sizes: dict[str, int]) -> int:
    """Rows a device's experts receive per layer on average: its tokens' N*K (the tokens of all
    B*T spread over the batch axes; a device receives as many rows as it sends)."""
    shards = math.prod(axis_sizes.get(a, 1) for a in ("data", "fsdp", "context", "expert"))
    return math.ceil(num_tokens * c.num_experts_per_tok / shards)


def capacity_rows(c: Config, num_layers: int, num_tokens: int, axis_sizes: dict[str, int]) -> int:
    """The buffer's capacity per device, without the page of slack."""
    per_layer = expected_rows(c, num_tokens, axis_sizes)
    return math.ceil(c.moe_paged_stash_capacity_factor * num_layers * per_layer)


def widths(c: Config, axis_sizes: dict[str, int]) -> dict[str, int]:
    """Row width of each stashed name per device (F sharded over `tensor`)."""
    f = c.base_moe_mlp_dim // axis_sizes.get("tensor", 1)
    full = {remat.MOE_MLPWI_0: f, remat.MOE_MLPWI_1: f, remat.MOE_MLPWO: c.base_emb_dim}
    return {n: full[n] for n in remat.stashed_names(c)}


def buffers(c: Config, axis_sizes: dict[str, int], dtype) -> dict[str, tuple[int, jnp.dtype]]:
    """Each buffer's (row width, value dtype) per device: the stashed names in `dtype` (the
    compute dtype), or, under an fp8 `quantization`, as fp8 holds them (`fp8.experts.buffers`:
    the gate and up as e4m3 plus a buffer of their float32 row scales)."""
    out: dict[str, tuple[int, jnp.dtype]] = {}
    for name, w in widths(c, axis_sizes).items():
        out.update(fp8_experts.buffers(c, name, w, dtype))
    return out


def row_bytes(c: Config, axis_sizes: dict[str, int], dtype) -> int:
    """The bytes of one stashed row over all buffers (`buffers`)."""
    return sum(w * t.itemsize for w, t in buffers(c, axis_sizes, dtype).values())


def empty(c: Config, num_layers: int, num_tokens: int, dtype, axis_sizes: dict[str, int]) -> Stash:
    """A zeroed write-mode stash for a stack of `num_layers` MoE layers over `num_tokens` tokens,
    one per device of the MoE `shard_map` over a mesh of `axis_sizes` ({} for one device),
    stacked on the leading axis and sharded over the axes of `AXES`."""
    axes = mesh_axes(axis_sizes)
    devices, sizes = math.prod(axis_sizes[a] for a in axes), axis_sizes
    cap = capacity_rows(c, num_layers, num_tokens, sizes)
    page = c.moe_paged_stash_page_rows
    layout = buffers(c, sizes, dtype)
    rows = devices * (cap + page)
    bufs = {n: jnp.zeros((rows, w), bits_dtype(t)) for n, (w, t) in layout.items()}
    stash = Stash(
        bufs=bufs,
        offset=jnp.zeros((devices,), jnp.int32),
        fits=jnp.ones((devices,), bool),
        rows=jnp.zeros((devices,), jnp.int32),
        mode=WRITE,
        capacity=cap,
        page=page,
        dtypes=tuple((n, t.name) for n, (_, t) in layout.items()),
    )
    return constrain(stash, axes)


def mesh_axes(mesh_axis_names) -> tuple[str, ...]:
    """The axes of `AXES` in a mesh, in the mesh's order."""
    return tuple(a for a in mesh_axis_names if a in AXES)


def bits_dtype(dtype) -> jnp.dtype:
    """The unsigned integer type a buffer of `dtype` values is stored as (same width)."""
    return jnp.dtype(f"uint{jnp.dtype(dtype).itemsize * 8}")


def specs(stash: Stash | None, mesh_axis_names):
    """shard_map specs of a stash: every leaf split over `mesh_axes` on its leading dim."""
    return jax.tree.map(lambda _: P(mesh_axes(mesh_axis_names)), stash)


def constrain(stash: Stash, axes: tuple[str, ...]) -> Stash:
    if not axes:
        return stash
    return jax.tree.map(lambda a: jax.lax.with_sharding_constraint(a, P(axes)), stash)
