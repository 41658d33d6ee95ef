"""Grouped matrix multiply: rows sorted by group, each group multiplied by its own weight matrix.

`gmm(lhs_MD, rhs_EDF, group_sizes_E)` computes, for rows of group e, `lhs_MD[rows] @ rhs_EDF[e]`.
Rows M beyond `sum(group_sizes)` produce zeros. With `group_offset`, only groups
`[group_offset, group_offset + E_local)` are local: `rhs` holds those E_local experts and
`group_sizes` still covers all experts (rows of non-local groups produce zeros, zero gradients).

Backends (`backend=`, the `gmm_impl` config key):
- `ragged_dot`: `jax.lax.ragged_dot`. XLA:CPU (and XLA:GPU by default) expands it to a dense matmul
  over all experts, so its cost grows with the number of experts, not with the routed rows.
- `tiled`: pure JAX, every backend. A `while_loop` over (group, row chunk) work items whose count is
  known only at run time, so the cost is proportional to routed rows + experts x tile. Its own VJP
  runs the same loop for the input gradient (weights used transposed) and, for the weight
  gradient, adds every item's partial product into its group's slice of one `[E, D, F]` buffer
  in place; the backward pass costs what the forward costs, twice.
- `tokamax_triton`, `tokamax_mosaic_gpu` (GPU), `megablox` (TPU): maintained kernels, one per
  matmul, forward, input and weight gradients (`gmm_kernels.py`); refused elsewhere.
- `auto`: picked per platform traced for (`expertax.platform`) from `MEASURED` below
  (see docs/design/gmm.md).
- `fp8_hopper` (`gmm_impl` under an fp8 `quantization` only): `fp8/matmul.py` runs the fp8
  products on Hopper's kernels (fp8/kernel.py); what runs in the operands' dtype here
  (decoding's unquantized experts) is `auto`'s.

`gmm_glu(gate, up, wo, sizes)` = `gmm(act(gate, up), wo, sizes)`, the expert FFN's second matmul
with its SwiGLU: `tiled` computes the SwiGLU per work item (a row-wise `prologue` of the loop) and
its VJP is one loop for both gradients, so the `[M, F]` hidden activation is never a buffer.

`given=` (the paged stash, `moe/stash.py`): the output is already known (restored from the
stash); `gmm` returns it as its value and its VJP is the grouped matmul's own, so the backward
pass is exact without running the matmul again (`known`: the one place an output is given,
for these backends and the fp8 matmuls alike).

`ExpertProducts`: the expert FFN's grouped matmuls as one object chosen per layer
(`fp8.experts.products`), which the sorted dispatch calls whether or not an fp8 recipe is set:
`GroupedProducts` here, `fp8.experts.Fp8Products` under a recipe.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Protocol

import jax
import jax.numpy as jnp

from expertax import platform
from expertax.fp8 import kernel as fp8_kernel
from expertax.nn.activation import GatedActivation, swiglu
from expertax.nn.moe import gmm_kernels, tiles
from expertax.nn.moe.vma import varying_like
from expertax.parallel import remat

BACKENDS = ("auto", "ragged_dot", "tiled", *gmm_kernels.KERNELS)
# the values of `gmm_impl`: these and the fp8 kernel of the routed experts (fp8/matmul.py)
CONFIG_VALUES = (*BACKENDS, fp8_kernel.HOPPER)

# Backend chosen by `auto`, from `expertax bench gmm` (BENCHMARKS.md, docs/design/gmm.md).
# platform: (choice, measured on, date, evidence). GPU and TPU: COMPILED for the target without
# the hardware (FLOPs, temporaries and kernels read from the compiled program; no time).
MEASURED = {
    "cpu": (
        "tiled",
        "2-core AMD EPYC VM (Zen 5, AVX-512), jax 0.10.2, float32",
        "2026-11-24",
        "expertax bench gmm --backends tiled (benchmarks/results/gmm/grid-tiled-2026-11-24.json), "
        "idle, huge pages: fwd 0.94x dense at 512 rows/expert, 0.91x at 256; 2.03x roofline at "
        "64, 3.09x at 16 (the earlier EPYC VM, 2026-11-24: 1.11x, 0.89x, 1.41x, 2.79x); "
        "ragged_dot 0.12-0.14x at E=8 (2026-11-23 run: expands to E dense matmuls)",
    ),
    "gpu": (
        "tokamax_triton",
        "COMPILED ONLY for gpu:h100x8 (XLA:GPU without a GPU), jax 0.10.2, tokamax 0.0.12, bf16; "
        "no time measured",
        "2026-11-26",
        "expertax bench gmm --target gpu:h100x8 (benchmarks/results/gmm/target-"
        "gpu-h100x8-*-2026-11-26.json), D=2048 F=1024 E=8..256: tokamax_triton is 3 Pallas Triton"
        " kernels (gmm, gmm, tgmm), compiled/routed FLOPs at balanced routing 1.0 in every "
        "regime (16-512 rows/expert, fwd and fwd+bwd: its row block capped at the rows per "
        "expert, 16-128; with tokamax's default 128-row block it was 6.0 at 16, 1.67 at 64), "
        "worst case for the buffer <= 2.0, temporaries < 1 MiB; tokamax_mosaic_gpu (Hopper only) "
        "1.0-5.3, temporaries a transposed copy of the rows (<= 0.29x the outputs); ragged_dot "
        "expands to E dense matmuls (E x the FLOPs, 1-2 GiB temporaries at E=64); tiled 1.0 but a"
        " while loop of per-item kernels and an f32 [E, D, F] temporary (1.1-2.0x the outputs). "
        "Triton over Mosaic GPU: sm80+, and tokamax's own H100 autotuning data (shipped with it, "
        "timed by tokamax, not by us) has Triton's weight-gradient kernel 2.6-6.2x faster and the"
        " three kernels at DeepSeek-V3's expert shapes 68.5 vs 121.5 ms. Time it on a GPU.",
    ),
    "tpu": (
        "megablox",
        "COMPILED ONLY for tpu:v5p-16 (libtpu without a TPU), jax 0.10.2, bf16; no time measured",
        "2026-11-26",
        "expertax bench gmm --target tpu:v5p-16 (benchmarks/results/gmm/target-"
        "tpu-v5p-16-*-2026-11-26.json), D=2048 F=1024 E=8..256: megablox is 3 Pallas Mosaic "
        "kernels (gmm, gmm, tgmm) with its row tile at the rows per expert, compiled/routed FLOPs"
        " 1.0 at balanced routing in every regime, worst case for the buffer <= 2.0, temporaries "
        "a few MiB; ragged_dot's forward and input gradient are Mosaic kernels (1.0) but its "
        "weight gradient a convolution over all experts ((E + 2) / 3 fwd+bwd); tiled 1.0 but "
        "while loops and an f32 [E, D, F] temporary (1.1-2.1x the outputs). Time it on a TPU.",
    ),
}

DEFAULT_TILE_ROWS = 512
DEFAULT_TILE_ROWS_MIN = 8


def resolve_backend(backend: str, on: str | None = None) -> str:
    """The concrete backend `backend` stands for on platform `on` (default: the platform being
    traced for, `expertax.platform.current()`): `auto` is `MEASURED`'s choice there, and so is
    `fp8_hopper` (its products in the operands' dtype: the module docstring)."""
    if backend not in CONFIG_VALUES:
        raise ValueError(f"gmm backend={backend!r}; valid: {', '.join(BACKENDS)}")
    if backend not in ("auto", fp8_kernel.HOPPER):
        return backend
    return MEASURED.get(on or platform.current(), ("tiled",))[0]


def check_backend(backend: str, on: str) -> None:
    """ConfigError (key `gmm_impl`) when `backend`, resolved for platform `on`, cannot run there
    or its library is not installed: before any compilation."""
    gmm_kernels.check(resolve_backend(backend, on), on)


def gmm(
    lhs_MD,
    rhs_EDF,
    group_sizes_E,
    *,
    group_offset=None,
    backend: str = "auto",
    preferred_element_type=None,
    tile_rows: int = DEFAULT_TILE_ROWS,
    tile_rows_min: int = DEFAULT_TILE_ROWS_MIN,
    given=None,
    prologue=None,
):
    """Grouped matmul `[M, D] x [E_local, D, F] -> [M, F]` (see the module docstring).

    Args:
      lhs_MD: rows sorted by group.
      rhs_EDF: weights of the local experts.
      group_sizes_E: int rows per group, for all E experts (E >= E_local), sum <= M; may be traced.
      group_offset: first local group (may be a traced scalar); None means all groups are local.
      backend: one of `BACKENDS`.
      preferred_element_type: output dtype (accumulation is float32); default `lhs_MD.dtype`.
      tile_rows: `tiled` only; rows per work item for the full chunks of a group.
      tile_rows_min: `tiled` only; smallest tile for the remainder of a group (its last
        `size % tile_rows` rows), which takes the smallest of tile_rows_min * 2^k (< tile_rows)
        holding it (fewer than 2x the remainder's rows + tile_rows_min computed), or two such
        tiles where that computes far fewer rows (`tiles.py`).
      given: the output [M, F] when it is already known (see the module docstring).
      prologue: a row-wise function (hashable); then `lhs_MD` is a tuple of `[M, ...]` arrays
        and the rows are `prologue(*lhs_MD)`, computed per work item by `tiled` (`gmm_glu`).
    """
    xs = tuple(lhs_MD) if prologue is not None else (lhs_MD,)
    backend = resolve_backend(backend)
    out_dtype = jnp.dtype(preferred_element_type or xs[0].dtype)
    group_sizes_E = group_sizes_E.astype(jnp.int32)
    if backend == "tiled":
        return _gmm_tiled(
            xs,
            prologue,
            rhs_EDF,
            group_sizes_E,
            group_offset,
            out_dtype,
            tile_rows,
            tile_rows_min,
            given,
        )
    lhs_MD = xs[0] if prologue is None else prologue(*xs)
    if given is not None:
        fn = functools.partial(gmm, backend=backend, preferred_element_type=out_dtype)
        inputs = (lhs_MD, rhs_EDF, group_sizes_E, group_offset)
        backward = functools.partial(_backend_vjp, fn)
        return known(_inputs, backward, given.astype(out_dtype), inputs)
    if backend in gmm_kernels.KERNELS:
        expected = tiles.current_expected_rows()
        args = (lhs_MD, rhs_EDF, group_sizes_E, group_offset, out_dtype, expected)
        return gmm_kernels.gmm(backend, *args)
    if group_offset is None:
        return jax.lax.ragged_dot(lhs_MD, rhs_EDF, group_sizes_E, preferred_element_type=out_dtype)
    # ragged_dot's group_offset is not implemented everywhere; select the local groups instead.
    e_local = rhs_EDF.shape[0]
    sizes = jax.lax.dynamic_slice_in_dim(group_sizes_E, group_offset, e_local)
    start = jnp.sum(jnp.where(jnp.arange(group_sizes_E.shape[0]) < group_offset, group_sizes_E, 0))
    rolled = jnp.roll(lhs_MD, -start, axis=0)
    out = jax.lax.ragged_dot(rolled, rhs_EDF, sizes, preferred_element_type=out_dtype)
    return jnp.roll(out, start, axis=0)


def gmm_glu(gate_MF, up_MF, rhs_EFD, group_sizes_E, act: GatedActivation = swiglu, **kw):
    """`gmm(act(gate, up), rhs, sizes, **kw)`: an expert FFN's second grouped matmul with its
    SwiGLU (keyword arguments as `gmm`'s).

    `tiled` applies `act` (nn/activation.py) to each work item's tile of gate and up rows right
    before the item's dot, and its VJP turns each tile's hidden gradient into the gate's and
    up's at once, so neither the `[M, F]` hidden activation nor its gradient is ever a buffer
    (the gate and up are the residuals, as they are of the first matmuls) and the activation
    works on the routed rows only. Other backends compute `act` on all M rows (one elementwise
    pass, not a matmul), then the grouped matmul.
    """
    return gmm((gate_MF, up_MF), rhs_EFD, group_sizes_E, prologue=act, **kw)


class ExpertProducts(Protocol):
    """The routed experts' grouped matmuls over rows sorted by expert, with the group sizes,
    the backend and the gated activation chosen once per layer. `given` (the paged stash's read
    mode: name -> saved value, or {}) stands in for the values it names."""

    def project(self, rows_MD, w_EDF, name: str, given: dict[str, jax.Array]) -> jax.Array:
        """The gate's or the up's grouped matmul [M, F] under checkpoint `name`."""
        ...

    def glu(
        self, gate_MF, up_MF, wo_EFD, given: dict[str, jax.Array]
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """(the down projection of `act(gate, up)` [M, D] under `remat.MOE_MLPWO`, what the
        paged stash holds of the gate and up in place of the matmuls' values: {} for those
        values themselves)."""
        ...


@dataclasses.dataclass(frozen=True)
class GroupedProducts:
    """`ExpertProducts` in the operands' dtype: `gmm` and `gmm_glu` on the configured backend
    (`kw`: `backend`, `group_offset`, `tile_rows`, `tile_rows_min`)."""

    group_sizes_E: jax.Array
    act: GatedActivation
    kw: dict[str, Any]

    def project(self, rows_MD, w_EDF, name: str, given: dict[str, jax.Array]) -> jax.Array:
        y = gmm(rows_MD, w_EDF, self.group_sizes_E, given=given.get(name), **self.kw)
        return remat.tag(y, name)

    def glu(
        self, gate_MF, up_MF, wo_EFD, given: dict[str, jax.Array]
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        # The SwiGLU runs inside the second matmul, on each work item's rows (gmm_glu): no
        # [M, F] hidden buffer, and none of the worst-case padding rows of EP is touched.
        given_y = given.get(remat.MOE_MLPWO)
        sizes = self.group_sizes_E
        y = gmm_glu(gate_MF, up_MF, wo_EFD, sizes, act=self.act, given=given_y, **self.kw)
        return remat.tag(y, remat.MOE_MLPWO), {}


def _gmm_tiled(xs, prologue, rhs, sizes, group_offset, out_dtype, tile_rows, tile_rows_min, given):
    """The `tiled` backend on the rows `prologue(*xs)` (`xs[0]` when `prologue` is None)."""
    ladder = tiles.ladder(xs[0].shape[0], tile_rows, tile_rows_min)
    offset = jnp.asarray(0 if group_offset is None else group_offset, jnp.int32)
    # Inside shard_map, give all operands the same varying axes outside the custom VJP so
    # autodiff transposes the implicit broadcast (a psum) for replicated operands.
    args = (*xs, rhs, sizes, offset)
    *xs, rhs, sizes, offset = (varying_like(a, *args) for a in args)
    if given is not None:
        backward = functools.partial(_tiled_bwd, ladder, out_dtype, prologue)
        args = (tuple(xs), rhs, sizes, offset)
        return known(_inputs, backward, given.astype(out_dtype), args)
    return _tiled(tuple(xs), rhs, sizes, offset, ladder, out_dtype, prologue)


def _rows_of(xs, prologue):
    return xs[0] if prologue is None else prologue(*xs)


def _loop_rows(xs, w_EIZ, items, out_MZ, *, prologue=None):
    """out[rows of item] = prologue(*xs)[rows] @ w[g] for every item (`xs[0]` without a
    prologue; the prologue runs on the item's tile only). I: the contracted width, Z: the
    output width (D -> F, or F -> D for the FFN's second matmul)."""

    def step(g, start, mask, tile, out):
        x = _rows_of(tiles.tile_of(xs, start, tile), prologue)
        w = jax.lax.dynamic_index_in_dim(w_EIZ, g, keepdims=False)
        y = jax.lax.dot_general(x, w, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        return tiles.put(out, y.astype(out.dtype), start, mask)

    return tiles.for_items(items, xs[0].shape[0], step, out_MZ)


def _loop_input_grad(x_MI, dy_MZ, w_EIZ, items):
    """dx[rows of item] = dy[rows] @ w[g]^T for every item (the weights contracted on Z)."""
    zeros = varying_like(jnp.zeros_like(x_MI), dy_MZ, w_EIZ, x_MI)

    def step(g, start, mask, tile, dx):
        w = jax.lax.dynamic_index_in_dim(w_EIZ, g, keepdims=False)
        dy = jax.lax.dynamic_slice_in_dim(dy_MZ, start, tile)
        d = jax.lax.dot_general(dy, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        return tiles.put(dx, d.astype(dx.dtype), start, mask)

    return tiles.for_items(items, x_MI.shape[0], step, zeros)


def _loop_weight_grad(x_MD, dy_MF, items, e_local: int):
    """dw[g] = sum over g's items of x[rows]^T @ dy[rows], float32, as `[E_local, D, F]`.

    One loop per tile list, like the forward: each item adds its `[D, F]` partial product into
    its group's slice of one `[E_local, D, F]` loop carry, updated in place (a fused
    dynamic-slice + add + dynamic-update-slice; HLO has no copy of the carry). Groups without
    items keep the initial exact zeros. This replaced a `scan` over groups with a `[D, F]`
    accumulator whose stacked output XLA zero-filled anyway and then copied every group's
    accumulator into: per group two more `[D, F]` passes and a loop nest per group
    (docs/design/gmm.md, "Where the time went").
    """
    dw_EDF = tiles.zero_weight_grad(e_local, x_MD.shape[1], dy_MF, x_MD, items[0]["g"])

    def step(g, start, mask, tile, dw_EDF):
        x = jnp.where(mask, jax.lax.dynamic_slice_in_dim(x_MD, start, tile), 0)
        return tiles.add_weight_grad(dw_EDF, g, x, jax.lax.dynamic_slice_in_dim(dy_MF, start, tile))

    return tiles.for_items(items, x_MD.shape[0], step, dw_EDF)


def _loop_prologue_grads(xs, dy_MZ, w_EIZ, items, prologue):
    """Both gradients of a gmm with a prologue in one loop: per item, one evaluation of the
    prologue on the tile gives its rows x (for `dw[g] += x^T dy`) and its VJP, which turns the
    rows' gradient `dy @ w[g]^T` into the cotangents of `xs` (written to their rows)."""
    e_local = w_EIZ.shape[0]
    dxs = tuple(varying_like(jnp.zeros_like(a), dy_MZ, w_EIZ, *xs) for a in xs)
    width = jax.eval_shape(prologue, *xs).shape[1]
    dw = tiles.zero_weight_grad(e_local, width, dy_MZ, w_EIZ, *xs, items[0]["g"])

    def step(g, start, mask, tile, carry):
        dxs, dw = carry
        w = jax.lax.dynamic_index_in_dim(w_EIZ, g, keepdims=False)
        dy = jax.lax.dynamic_slice_in_dim(dy_MZ, start, tile)
        x, pull = jax.vjp(prologue, *tiles.tile_of(xs, start, tile))
        dx = jax.lax.dot_general(
            dy, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
        )
        news = pull(dx.astype(x.dtype))
        dxs = tuple(tiles.put(o, n, start, mask) for o, n in zip(dxs, news, strict=True))
        return dxs, tiles.add_weight_grad(dw, g, jnp.where(mask, x, 0), dy)

    return tiles.for_items(items, xs[0].shape[0], step, (dxs, dw))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _tiled(xs, rhs_EDF, group_sizes_E, offset, ladder, out_dtype, prologue):
    return _tiled_fwd(xs, rhs_EDF, group_sizes_E, offset, ladder, out_dtype, prologue)[0]


def _tiled_fwd(xs, rhs_EDF, group_sizes_E, offset, ladder, out_dtype, prologue):
    n, e_local, f = xs[0].shape[0], rhs_EDF.shape[0], rhs_EDF.shape[2]
    items = tiles.work_items(group_sizes_E, offset, e_local, n, ladder)
    zeros_MF = varying_like(jnp.zeros((n, f), out_dtype), *xs, rhs_EDF, group_sizes_E, offset)
    out_MF = _loop_rows(xs, rhs_EDF, items, zeros_MF, prologue=prologue)
    return out_MF, (xs, rhs_EDF, group_sizes_E, offset)


def _tiled_bwd(ladder, out_dtype, prologue, res, dout_MF):
    xs, rhs_EDF, group_sizes_E, offset = res
    n, e_local = xs[0].shape[0], rhs_EDF.shape[0]
    items = tiles.work_items(group_sizes_E, offset, e_local, n, ladder)
    if prologue is None:
        dxs = (_loop_input_grad(xs[0], dout_MF, rhs_EDF, items),)
        dw_EDF = _loop_weight_grad(xs[0], dout_MF, items, e_local)
    else:
        dxs, dw_EDF = _loop_prologue_grads(xs, dout_MF, rhs_EDF, items, prologue)
    return dxs, dw_EDF.astype(rhs_EDF.dtype), None, None


_tiled.defvjp(_tiled_fwd, _tiled_bwd)


def _inputs(*args):
    """The residuals of a matmul whose backward needs only its inputs."""
    return args


def _backend_vjp(fn, res, dout_MF):
    """The cotangents of (lhs, rhs, sizes, offset) from `fn(lhs, rhs, sizes, group_offset=...)`'s
    VJP (its forward value there is dead code to XLA)."""
    lhs_MD, rhs_EDF, group_sizes_E, offset = res
    _, vjp = jax.vjp(lambda a, b: fn(a, b, group_sizes_E, group_offset=offset), lhs_MD, rhs_EDF)
    return (*vjp(dout_MF), None, None)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def known(residuals, backward, given, args):
    """`given`, the output of a function of `args` that is already known (the paged stash
    restored it), with that function's VJP: `residuals(*args)` the residuals its forward saves
    (any value of the output it computes on the way is dead code to XLA), `backward(res, dy)`
    the cotangents of `args` (a tuple). `given` takes no cotangent. Every grouped matmul whose
    output may be given (the backends here, the fp8 ones: fp8/matmul.py) goes through this."""
    return given


def _known_fwd(residuals, backward, given, args):
    return given, residuals(*args)


def _known_bwd(residuals, backward, res, dout):
    return None, backward(res, dout)


known.defvjp(_known_fwd, _known_bwd)
