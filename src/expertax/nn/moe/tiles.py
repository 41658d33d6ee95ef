"""The tiled grouped matmul's work items and loops, shared by `gmm.py` and the fused routed FFN
(`routed.py`).

Rows are sorted by group (expert). A tile ladder (`ladder`) gives a big tile and smaller
remainder tiles; `work_items` splits each local group's rows into items of those tiles (one
list per tile size, ordered by group), and `for_items` runs `step(group, start, mask, tile,
carry)` over every item in one `fori_loop` per list, whose trip count is known only at run
time: the cost follows the routed rows, not the number of experts. `put` writes a tile's
masked rows into an `[M, *]` carry in place; `add_weight_grad` adds a tile's `x^T @ dy` into
its group's slice of an `[E, D, F]` carry. `expected_group_rows` names the balanced-routing
expectation the compiled program's FLOPs are counted at (planner/flops.py).
"""

from __future__ import annotations

import contextlib
import contextvars

import jax
import jax.numpy as jnp
import numpy as np

from expertax import scopes
from expertax.nn.moe.vma import varying_like


def ladder(n: int, tile_rows: int, tile_rows_min: int) -> tuple[int, ...]:
    """(big tile, remainder tiles ascending), all <= n: `tile_rows`, then tile_rows_min * 2^k."""
    if tile_rows < 1 or tile_rows_min < 1:
        raise ValueError(f"gmm tile_rows={tile_rows}, tile_rows_min={tile_rows_min}: must be >= 1")
    big = max(1, min(tile_rows, n))
    small = [min(tile_rows_min, big)]
    while small[-1] * 2 < big:
        small.append(small[-1] * 2)
    return Tiles((big, *sorted({min(s, big) for s in (*small, big)})), _EXPECTED_ROWS.get())


class Tiles(tuple):
    """A tile ladder that also carries the balanced-routing rows per group it was built under
    (`expected_group_rows`), so that the VJP, traced later, names the same expectation."""

    expected_rows: float | None

    def __new__(cls, sizes, expected_rows: float | None = None):
        out = super().__new__(cls, sizes)
        out.expected_rows = expected_rows
        return out


# An extra work item costs a slice and a packing of its expert's `[D, F]` weights (about three
# passes over them) on top of its dot; with the dot at ~300 GFLOP/s and those passes at 30-60 GB/s
# (2-core VM, quiet) that is the dot of ~30-60 rows, whatever D and F. A remainder is split in two
# items only when that saves at least this many computed rows.
SPLIT_MIN_SAVED_ROWS = 64


# Rows per local group under balanced routing, where the caller knows it (`expected_group_rows`):
# the tile loops' counts are data-dependent, and a compiled program's FLOPs (planner/flops.py)
# count such a loop at this expectation, named in its scope as `trips~N`.
_EXPECTED_ROWS: contextvars.ContextVar[float | None] = contextvars.ContextVar(
    "gmm_expected_rows", default=None
)


@contextlib.contextmanager
def expected_group_rows(rows: float | None):
    """Trace the grouped matmuls under it with `rows` per group as the balanced expectation."""
    token = _EXPECTED_ROWS.set(rows)
    try:
        yield
    finally:
        _EXPECTED_ROWS.reset(token)


def _expected_counts(e_local: int, n: int, tiles: tuple[int, ...]) -> list[int] | None:
    """Each tile list's item count when every local group has the expected rows: what
    `work_items` counts, evaluated in numpy at trace time (no device is needed; a compile for
    a TPU or GPU target has none to run on)."""
    rows = getattr(tiles, "expected_rows", None)
    if rows is None:
        return None
    ends = np.minimum(np.cumsum(np.full(e_local, round(rows))), n)
    sizes = np.maximum(ends - np.clip(ends - round(rows), 0, n), 0)
    big, rest = tiles[0], tuple(tiles[1:])
    counts = [int((sizes // big).sum())] + [0] * len(rest)
    for rem in (sizes % big).tolist():
        for k in _remainder_items(rem, rest):
            counts[1 + k] += 1
    return counts


def _remainder_items(rem: int, tiles: tuple[int, ...]) -> list[int]:
    """`_remainder_tiles` for one static remainder: the indices of the tiles it takes."""
    if rem <= 0 or not tiles:
        return []
    fit = lambda r: sum(r > t for t in tiles[:-1])
    head = sum(rem >= t for t in tiles) - 1
    if head >= 0 and rem > tiles[head]:
        tail = fit(rem - tiles[head])
        if tiles[head] + tiles[tail] + SPLIT_MIN_SAVED_ROWS <= tiles[fit(rem)]:
            return [head, tail]
    return [fit(rem)]


def work_items(group_sizes_E, offset, e_local: int, n: int, tiles: tuple[int, ...]):
    """Lists of work items, one list per tile size; each a dict of int32 arrays and counts.

    Local group g with rows [s_g, s_g + n_g) yields n_g // big items of `big = tiles[0]` rows,
    then its remainder r_g = n_g % big > 0 (see `_remainder_tiles`) in at most one item of each
    list of `tiles[1:]`. One list per tile size (no `lax.switch` over tile sizes: XLA copies
    the loop carry through a conditional, measured 30x slower). Items are ordered by group.
    Rows are clipped to [0, n).
    """
    big, rest_tiles = tiles[0], tiles[1:]
    ends_E = jnp.minimum(jnp.cumsum(group_sizes_E), n)
    starts_E = jnp.clip(ends_E - group_sizes_E, 0, n)
    starts = jax.lax.dynamic_slice_in_dim(starts_E, offset, e_local)
    ends = jax.lax.dynamic_slice_in_dim(ends_E, offset, e_local)
    sizes = jnp.maximum(ends - starts, 0)
    n_full = sizes // big
    rem_start = starts + n_full * big
    specs = [(n_full, starts, n // big, big)]
    for count, first, tile in _remainder_tiles(sizes - n_full * big, rem_start, rest_tiles):
        specs.append((count, first, e_local, tile))
    expected = _expected_counts(e_local, n, tiles)
    lists = []
    for k, (count, first, cap, tile) in enumerate(specs):
        cum = jnp.cumsum(count)
        # At least two slots: a loop of at most one trip is turned by XLA:TPU into straight-line
        # code that computes the tile whether or not the item exists (measured: 3x the routed
        # FLOPs at one expert per device); with two it stays a loop of data-dependent length.
        i = jnp.arange(max(cap, 2), dtype=jnp.int32)
        g = jnp.minimum(jnp.searchsorted(cum, i, side="right"), e_local - 1).astype(jnp.int32)
        row0 = first[g] + (i - (cum[g] - count[g])) * tile
        lists.append(
            dict(
                g=g,
                row0=row0,
                row1=jnp.minimum(row0 + tile, ends[g]),
                count=cum[-1],
                tile=tile,
                expected=None if expected is None else expected[k],
            )
        )
    return lists


def _remainder_tiles(rem, rem_start, tiles: tuple[int, ...]):
    """Per tile of `tiles` (ascending): (0/1 item count per group, first row), covering `rem`.

    A remainder r takes the smallest tile holding it (< 2r + tiles[0] rows computed), or, when
    that saves at least `SPLIT_MIN_SAVED_ROWS` computed rows, two items: the largest tile h <= r,
    full, then the smallest tile holding r - h (a 300-row remainder: 256 + 64 rows, not 512).
    The two tiles differ, so each list gets at most one item per group. Index arithmetic is
    written as sums of comparisons so no constant array enters the traced function (a
    jax.checkpoint would save it as a residual).
    """

    def fit(r):  # index of the smallest tile >= r
        return sum((r > t).astype(jnp.int32) for t in tiles[:-1])

    def size(k):  # tiles[k] for a traced index k
        return sum(jnp.where(k == j, t, 0) for j, t in enumerate(tiles))

    head = sum((rem >= t).astype(jnp.int32) for t in tiles) - 1  # largest tile <= r, or -1
    head_rows = size(head)
    tail = fit(rem - head_rows)
    split = (head >= 0) & (rem > head_rows)
    split &= head_rows + size(tail) + SPLIT_MIN_SAVED_ROWS <= size(fit(rem))
    one = (rem > 0) & ~split
    for k, tile in enumerate(tiles):
        is_tail = split & (tail == k)
        count = (one & (fit(rem) == k)) | (split & (head == k)) | is_tail
        yield count.astype(jnp.int32), rem_start + jnp.where(is_tail, head_rows, 0), tile


def _tile_rows_mask(row0, row1, tile: int, n: int):
    """Clamped slice start and the mask of the tile's rows that belong to the item."""
    start = jnp.minimum(row0, n - tile)
    r = start + jnp.arange(tile, dtype=jnp.int32)
    return start, ((r >= row0) & (r < row1))[:, None]


def for_items(items, n: int, step, carry):
    """`carry = step(group, start, mask, tile, carry)` for every work item, one loop per tile
    list (`start`: the tile's clamped first row, `mask`: [tile, 1], its rows of the item)."""
    for item in items:

        def body(i, carry, item=item):
            tile = item["tile"]
            start, mask = _tile_rows_mask(item["row0"][i], item["row1"][i], tile, n)
            return step(item["g"][i], start, mask, tile, carry)

        expected = item.get("expected")
        scope = (
            jax.named_scope(scopes.TRIPS.label(expected)) if expected is not None else _no_scope()
        )
        with scope:
            carry = jax.lax.fori_loop(0, item["count"], body, carry)
    return carry


@contextlib.contextmanager
def _no_scope():
    yield


def tile_of(xs, start, tile: int):
    return tuple(jax.lax.dynamic_slice_in_dim(a, start, tile) for a in xs)


def put(out, new, start, mask):
    """`out` with the masked rows of the tile at `start` replaced by `new` (in place)."""
    old = jax.lax.dynamic_slice_in_dim(out, start, new.shape[0])
    return jax.lax.dynamic_update_slice_in_dim(out, jnp.where(mask, new, old), start, 0)


def add_weight_grad(dw_EDF, g, x, dy):
    """dw[g] += x^T @ dy (float32), in place in the `[E_local, D, F]` loop carry."""
    # XLA:CPU hands a dot to its fast library (the `__ynn_fusion`) only when the lhs contracts
    # its last dim; `x^T @ dy` written directly contracts dim 0 and runs in the generic dot,
    # several times slower. The barrier keeps the small transposed tile a real `[D, tile]`
    # copy (XLA would otherwise fold the transpose back).
    x_T = jax.lax.optimization_barrier(x.T)
    part_DF = jnp.matmul(x_T, dy, preferred_element_type=jnp.float32)
    old_1DF = jax.lax.dynamic_index_in_dim(dw_EDF, g, keepdims=True)
    return jax.lax.dynamic_update_slice_in_dim(dw_EDF, old_1DF + part_DF[None], g, 0)


def zero_weight_grad(e_local: int, d: int, dy_MF, *refs):
    return varying_like(jnp.zeros((e_local, d, dy_MF.shape[1]), jnp.float32), dy_MF, *refs)


def current_expected_rows() -> float | None:
    """The rows per group `expected_group_rows` set for what is being traced, or None."""
    return _EXPECTED_ROWS.get()
