"""The routed experts' grouped GEMM under an fp8 recipe (config key `quantization`).

`gmm(lhs_MK, rhs_EKN, sizes_E, recipe)` is `moe/gmm.py`'s grouped matmul whose three products
take e4m3 operands quantized the way `fp8/dense.py` quantizes a linear's:
- fprop: the rows in 1 x 128 tiles along K (per row, per 128 channels), each expert's weight
  in 128 x 128 blocks (`fp8_blockwise`; `fp8_tensorwise`: one scale for the rows, one per
  expert's weight);
- dgrad: the output gradient in 1 x 128 tiles along N, the weights as held;
- wgrad: the rows and the output gradient re-tiled along the rows (128 rows per scale, per
  channel), the rows outside the local experts' groups zeroed first (an EP buffer's unused
  rows hold anything, and would share a tile's scale with routed rows).

The forward saves the e4m3 values and scales of the rows and weights (what remat then holds),
not the rows in their own dtype. Each product then runs on the configured backend
(`gmm_impl`) with the dequantized operands: the numbers of the fp8 recipe on every backend,
with the backend's own kernels for all three products (its VJP gives the dgrad and the
wgrad), but no fp8 tensor-core time: no such backend multiplies e4m3 in its grouped GEMM
(docs/design/fp8.md, "Grouped GEMM"). `backend=HOPPER` instead runs the fprop and the dgrad on
the quantized operands in `fp8/hopper/`'s kernel (e4m3 `wgmma` on Hopper; Pallas's interpreter
when traced for a CPU), and the wgrad on `hopper/wgrad.py`.

`given=` (the paged stash): the output is known; the value is `given`, the backward is this
one's.

`gmm_glu(gate, up, wo, sizes, recipe, act, names)`: the expert FFN's second GEMM with its gated
activation, as DeepSeek-V3 stores it (Sec. 3.3.3: the SwiGLU's inputs cached in fp8, its output
recomputed in the backward): the forward computes `act(gate, up)` from the exact inputs and
multiplies its quantized tiles; what it saves is gate and up in 1 x 128 e4m3 tiles (named
`names`, the remat names of gate and up: a policy that keeps them keeps these fp8 bytes, a
quarter of the two bf16 arrays plus the scales), from which the backward recomputes the hidden
rows for the wgrad and takes the activation's gradient.
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp

from expertax.fp8 import kernel, recipes, stats
from expertax.nn.moe import gmm as gmm_mod
from expertax.nn.moe import tiles
from expertax.nn.moe.vma import varying_like
from expertax.parallel import remat

TILE = recipes.TILE
# `backend=HOPPER` (`gmm_impl=fp8_hopper`, or `auto` on a Hopper mesh: fp8/kernel.py): the
# fprop and the dgrad multiply the e4m3 operands in fp8/hopper/'s kernel (Hopper's fp8 tensor
# cores; on CPU its interpreter), the wgrad on its wgrad kernel
HOPPER = kernel.HOPPER


def gmm(lhs_MK, rhs_EKN, sizes_E, recipe: str, *, group_offset=None, given=None, probes=None, **kw):
    """`gmm_mod.gmm(lhs_MK, rhs_EKN, sizes_E, group_offset=..., **kw)` with fp8 operands under
    `recipe` (`fp8_gemm.RECIPES`); `kw`: `backend`, `tile_rows`, `tile_rows_min`. The output
    is in lhs_MK's dtype. `probes` (optional, nn/stats.py): two probes whose cotangents are
    the quantizer counts of the operands indexed by K (the rows) and by N (the output
    gradient)."""
    opts, args, probes = _prepare(recipe, group_offset, kw, probes, lhs_MK, rhs_EKN, sizes_E)
    lhs_MK, rhs_EKN, sizes_E, offset = args
    if given is None:
        return _gmm(lhs_MK, rhs_EKN, sizes_E, offset, probes, opts)
    given = varying_like(given.astype(lhs_MK.dtype), lhs_MK)
    return _gmm_given(lhs_MK, rhs_EKN, sizes_E, offset, given, probes, opts)


def gmm_glu(
    gate_MF,
    up_MF,
    rhs_EFN,
    sizes_E,
    recipe: str,
    act,
    names,
    *,
    group_offset=None,
    given=None,
    held=(),
    probes=None,
    **kw,
):
    """`gmm(act(gate, up), rhs, sizes, recipe)` saving gate and up in fp8 under the checkpoint
    `names` (gate's, up's) for the backward (the module docstring); `act` hashable.

    `held` (the paged stash's read mode): (gate's, up's) quantized tiles as the forward saved
    them (`recipes.quantize(.., 1, TILE)`), or None each: those are the residuals, and the
    values of `gate_MF`/`up_MF` they stand for are not read (the forward's output, when not
    `given`, and the counts come from their dequantized values)."""
    arrays = (gate_MF, up_MF, rhs_EFN, sizes_E)
    opts, args, probes = _prepare(recipe, group_offset, kw, probes, *arrays)
    gate_MF, up_MF, rhs_EFN, sizes_E, offset = args
    if given is not None:
        given = varying_like(given.astype(gate_MF.dtype), gate_MF)
    held = tuple(held) + (None,) * (2 - len(held))
    held = jax.tree.map(lambda a: varying_like(a, gate_MF), held)
    return _glu(
        gate_MF, up_MF, rhs_EFN, sizes_E, offset, given, held, probes, opts, act, tuple(names)
    )


def _prepare(recipe, group_offset, kw, probes, *arrays):
    """(the custom VJPs' static options, `arrays` with int32 sizes last and the group offset
    appended, all with the same varying mesh axes as `gmm._gmm_tiled` gives its operands, and
    the probes with those axes: their cotangents vary where the counts do, and the transpose
    of that widening sums them over the shards)."""
    recipes.check_recipe(recipe)
    offset = jnp.asarray(0 if group_offset is None else group_offset, jnp.int32)
    # the balanced-routing rows the tile loops are named with (tiles.py), also in the backward
    # products, which are traced later, outside the MoE layer's scope
    expected = tiles.current_expected_rows()
    opts = (recipe, group_offset is not None, tuple(sorted(kw.items())), expected)
    args = (*arrays[:-1], arrays[-1].astype(jnp.int32), offset)
    args = tuple(varying_like(a, *args) for a in args)
    return opts, args, jax.tree.map(lambda p: varying_like(p, *args), probes)


def _backend(x_MK, w_EKN, sizes_E, offset, opts):
    _, has_offset, kw, expected = opts
    kw = dict(kw)  # (backend=HOPPER: its products in the operands' dtype are `auto`'s, gmm.py)
    with tiles.expected_group_rows(expected):
        return gmm_mod.gmm(
            x_MK, w_EKN, sizes_E, group_offset=offset if has_offset else None,
            preferred_element_type=x_MK.dtype, **kw,
        )  # fmt: skip


def _hopper(opts) -> bool:
    return dict(opts[2]).get("backend") == HOPPER


# The Hopper kernel's fprop and dgrad pad each group's rows to whole row tiles: the waste is
# half a tile per group on average, a large share of the work where groups are small, which a
# 64-row tile (one `wgmma` high) halves. A 128-row tile reuses each weight tile it loads for
# twice the rows; from 1,024 rows per group on, its waste (64 rows: 6%) is small enough for
# that to pay. Where the program names no balanced rows per group (None): 64.
HOPPER_TILE_128_FROM_ROWS = 1024


def _hopper_tile_rows(opts) -> int:
    """The kernel's row tile (hopper/layout.TILE_ROWS) for the balanced rows per group `opts[3]`
    (`tiles.current_expected_rows()` where the products were traced)."""
    expected = opts[3]
    return 64 if expected is None or expected < HOPPER_TILE_128_FROM_ROWS else 128


def _rows_scope(opts):
    """The Hopper kernel's call traced under `rows~R` (R: the balanced rows per group, where
    named), as gmm_kernels.py names the bfloat16 kernels: the compiled FLOPs count both at the
    tiles those groups fill (planner/flops.py)."""
    expected = opts[3]
    return jax.named_scope(f"rows~{round(expected)}") if expected else contextlib.nullcontext()


def _grid(scale, shape):
    """A scale as the blockwise grid of `shape` (a tensorwise scale broadcast to it)."""
    return jnp.broadcast_to(scale.astype(jnp.float32), shape)


# the products' named scopes (the compiled program's op names, tools/fp8_kernels.py)
SCOPES = ("fp8_gmm_fprop", "fp8_gmm_dgrad", "fp8_gmm_wgrad")


def _scoped(i):
    """The product run under its scope `SCOPES[i]`."""

    def wrap(fn):
        @functools.wraps(fn)
        def scoped(*args, **kw):
            with jax.named_scope(SCOPES[i]):
                return fn(*args, **kw)

        return scoped

    return wrap


@_scoped(0)
def _fprop(qx, qw, sizes_E, offset, opts, dtype, w_dtype):
    """rows @ w per group from the quantized operands (rows in 1 x 128 tiles along K), in
    `dtype` (the rows'; `w_dtype`: the weight's)."""
    if not _hopper(opts):
        x = recipes.dequantize(qx, dtype, 1, TILE)
        return _backend(x, _dequantize_weights(qw, w_dtype), sizes_E, offset, opts)
    from expertax.fp8.hopper import gmm as hopper_gmm

    (x, xs), (w, ws) = qx, qw
    g, k, n = w.shape
    blocks = hopper_gmm.blocks  # a 64-wide last block where a dim is not a multiple of 128
    with _rows_scope(opts):
        return hopper_gmm.gmm(
            x, _grid(xs, (x.shape[0], blocks(k))), w, _grid(ws, (g, blocks(k), blocks(n))),
            sizes_E, group_offset=offset if opts[1] else None, out_dtype=dtype,
            tile_rows=_hopper_tile_rows(opts), interpret=_interpret(),
        )  # fmt: skip


@_scoped(1)
def _dgrad(q_dy, qw, x, w, sizes_E, offset, opts):
    """dy @ w^T per group: `q_dy` in 1 x 128 tiles along N; `x`, `w`: the fprop's operands
    dequantized (the backend's VJP), in the output's dtype."""
    dtype = x.dtype
    if not _hopper(opts):
        _, pull = jax.vjp(lambda a: _backend(a, w, sizes_E, offset, opts), x)
        return pull(recipes.dequantize(q_dy, dtype, 1, TILE))[0]
    from expertax.fp8.hopper import gmm as hopper_gmm

    (dy, dys), (wq, ws) = q_dy, qw
    g, k, n = wq.shape
    blocks = hopper_gmm.blocks
    with _rows_scope(opts):
        return hopper_gmm.dgrad(
            dy, _grid(dys, (dy.shape[0], blocks(n))), wq, _grid(ws, (g, blocks(k), blocks(n))),
            sizes_E, group_offset=offset if opts[1] else None, out_dtype=dtype,
            tile_rows=_hopper_tile_rows(opts), interpret=_interpret(),
        )  # fmt: skip


def _interpret() -> bool:
    """The kernel in Pallas's interpreter when the program is traced for a CPU."""
    return kernel.interpreting()


@_scoped(2)
def _wgrad(x_local, dy_local, w, sizes_E, offset, opts):
    """dw[g] = x^T dy over group g's rows (foreign rows already zeroed): both operands re-tiled
    along the rows (128 rows per scale, per channel), dequantized, on `_backend`'s VJP; under
    `_hopper(opts)` the Hopper kernel's wgrad (`hopper/wgrad.py`: e4m3 `wgmma`; blockwise:
    each group's rows padded to whole 128-row tiles, so a tile's scale is one expert's;
    tensorwise: one scale per operand, as here). Returns (dw float32-accumulated in w's dtype,
    the re-tiled operands' e4m3 values, for the counts)."""
    recipe = opts[0]
    if _hopper(opts):
        from expertax.fp8.hopper import wgrad as hopper_wgrad

        with _rows_scope(opts):
            dw, q_x_m, q_dy_m = hopper_wgrad.wgrad_counted(
                x_local, dy_local, sizes_E, group_offset=offset if opts[1] else None,
                num_groups=w.shape[0], interpret=_interpret(),
                tensorwise=recipe == "fp8_tensorwise",
            )  # fmt: skip
        # the Pallas call's output declares no varying axes: it varies as the weight's cotangent
        return varying_like(dw.astype(w.dtype), w), q_x_m, q_dy_m
    x_m, q_x_m = _tiles_q(x_local, recipe, TILE, 1)
    dy_m, q_dy_m = _tiles_q(dy_local, recipe, TILE, 1)
    _, pull_w = jax.vjp(lambda b: _backend(x_m, b, sizes_E, offset, opts), w)
    (dw,) = pull_w(dy_m)
    return dw, q_x_m, q_dy_m


def _quantize_weights(w_EKN, recipe):
    return recipes.quantize(w_EKN, recipe, TILE, TILE)  # each expert's matrix on its own


def _dequantize_weights(qw, dtype):
    return recipes.dequantize(qw, dtype, TILE, TILE)


def _tiles(x_RC, recipe, rows, cols):
    """`x_RC` through the fp8 quantizer and back (e4m3 values times their scales)."""
    return _tiles_q(x_RC, recipe, rows, cols)[0]


def _tiles_q(x_RC, recipe, rows, cols):
    """(`_tiles(x_RC, ...)`, the e4m3 values)."""
    q = recipes.quantize(x_RC, recipe, rows, cols)
    return recipes.dequantize(q, x_RC.dtype, rows, cols), q[0]


def _cotangents(fwd_k, bwd_k, bwd_n):
    """The probes' cotangents: the K-indexed operands' forward and backward counts, the
    N-indexed operands' backward counts (nn/stats.py)."""
    none = jnp.zeros_like(bwd_n)
    return (stats.encode(fwd_k, bwd_k), stats.encode(none, bwd_n))


def _local_rows(sizes_E, offset, e_local: int, m: int):
    """[M, 1] bool: the rows of the groups [offset, offset + e_local) (sorted rows)."""
    g = jnp.arange(sizes_E.shape[0])
    start = jnp.sum(jnp.where(g < offset, sizes_E, 0))
    end = start + jnp.sum(jnp.where((g >= offset) & (g < offset + e_local), sizes_E, 0))
    r = jnp.arange(m)
    return ((r >= start) & (r < end))[:, None]


def _forward(lhs_MK, rhs_EKN, sizes_E, offset, opts, given, probes):
    recipe = opts[0]
    qx = recipes.quantize(lhs_MK, recipe, 1, TILE)
    qw = _quantize_weights(rhs_EKN, recipe)
    if given is None:
        given = _fprop(qx, qw, sizes_E, offset, opts, lhs_MK.dtype, rhs_EKN.dtype)
    fwd = None
    if probes is not None:
        local = _local_rows(sizes_E, offset, rhs_EKN.shape[0], lhs_MK.shape[0])
        fwd = stats.counts(lhs_MK, qx[0], local)
    tags = (jnp.zeros((0,), lhs_MK.dtype), jnp.zeros((0,), rhs_EKN.dtype))
    return given, (qx, qw, sizes_E, offset, tags, fwd)


def _backward(opts, res, dy_MN):
    recipe = opts[0]
    qx, qw, sizes_E, offset, (x_tag, w_tag), fwd = res
    w = _dequantize_weights(qw, w_tag.dtype)
    x = recipes.dequantize(qx, x_tag.dtype, 1, TILE)
    dy_MN = dy_MN.astype(x.dtype)
    # dgrad: the output gradient in 1 x 128 tiles along N (the contraction), the weights as held
    q_dy = recipes.quantize(dy_MN, recipe, 1, TILE)
    dx, q_dy_n = _dgrad(q_dy, qw, x, w, sizes_E, offset, opts), q_dy[0]
    # wgrad: both operands re-tiled along the rows (its contraction), foreign rows zeroed
    local = _local_rows(sizes_E, offset, w.shape[0], x.shape[0])
    x_local, dy_local = jnp.where(local, x, 0), jnp.where(local, dy_MN, 0)
    dw, q_x_m, q_dy_m = _wgrad(x_local, dy_local, w, sizes_E, offset, opts)
    cts = None
    if fwd is not None:
        bwd_k = stats.counts(x_local, q_x_m)
        bwd_n = stats.total((dy_MN, q_dy_n), rows=local) + stats.counts(dy_local, q_dy_m)
        cts = _cotangents(fwd, bwd_k, bwd_n)
    return dx, dw.astype(w_tag.dtype), None, None, cts


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _gmm(lhs_MK, rhs_EKN, sizes_E, offset, probes, opts):
    return _forward(lhs_MK, rhs_EKN, sizes_E, offset, opts, None, None)[0]


def _gmm_fwd(lhs_MK, rhs_EKN, sizes_E, offset, probes, opts):
    return _forward(lhs_MK, rhs_EKN, sizes_E, offset, opts, None, probes)


_gmm.defvjp(_gmm_fwd, _backward)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _gmm_given(lhs_MK, rhs_EKN, sizes_E, offset, given_MN, probes, opts):
    return given_MN


def _gmm_given_fwd(lhs_MK, rhs_EKN, sizes_E, offset, given_MN, probes, opts):
    return _forward(lhs_MK, rhs_EKN, sizes_E, offset, opts, given_MN, probes)


def _gmm_given_bwd(opts, res, dy_MN):
    dx, dw, _, _, cts = _backward(opts, res, dy_MN)
    return dx, dw, None, None, None, cts


_gmm_given.defvjp(_gmm_given_fwd, _gmm_given_bwd)


def _glu_forward(gate_MF, up_MF, rhs_EFN, sizes_E, offset, given, held, probes, opts, act, names):
    recipe = opts[0]
    qw = _quantize_weights(rhs_EFN, recipe)
    # the activation's inputs in 1 x 128 tiles (or as the paged stash held them)
    qg, qu = (
        recipes.quantize(a, recipe, 1, TILE) if q is None else q
        for a, q in zip((gate_MF, up_MF), held)
    )
    fwd = None
    if given is None or probes is not None:
        # (with a given output and probes: the hidden rows only for their counts)
        gate_MF, up_MF = (
            a if h is None else recipes.dequantize(q, a.dtype, 1, TILE)
            for a, h, q in zip((gate_MF, up_MF), held, (qg, qu))
        )
        h_exact = act(gate_MF, up_MF)
        qh = recipes.quantize(h_exact, recipe, 1, TILE)
        q_h = qh[0]
        if probes is not None:
            local = _local_rows(sizes_E, offset, rhs_EFN.shape[0], h_exact.shape[0])
            fwd = stats.counts(h_exact, q_h, local)
    if given is None:
        given = _fprop(qh, qw, sizes_E, offset, opts, h_exact.dtype, rhs_EFN.dtype)
    # the activation's inputs under their checkpoint names (remat keeps or recomputes these fp8
    # bytes as the policy places the names)
    qg, qu = (jax.tree.map(lambda a, n=n: remat.tag(a, n), q) for q, n in zip((qg, qu), names))
    tags = (jnp.zeros((0,), gate_MF.dtype), jnp.zeros((0,), rhs_EFN.dtype))
    return given, (qg, qu, qw, sizes_E, offset, tags, fwd)


def _glu_backward(opts, act, names, res, dy_MN):
    recipe = opts[0]
    qg, qu, qw, sizes_E, offset, (x_tag, w_tag), fwd = res
    gate, up = (recipes.dequantize(q, x_tag.dtype, 1, TILE) for q in (qg, qu))
    h, act_vjp = jax.vjp(act, gate, up)
    w = _dequantize_weights(qw, w_tag.dtype)
    dy_MN = dy_MN.astype(h.dtype)
    q_dy = recipes.quantize(dy_MN, recipe, 1, TILE)
    dh, q_dy_n = _dgrad(q_dy, qw, h, w, sizes_E, offset, opts), q_dy[0]
    dgate, dup = act_vjp(dh)
    local = _local_rows(sizes_E, offset, w.shape[0], h.shape[0])
    h_local, dy_local = jnp.where(local, _tiles(h, recipe, 1, TILE), 0), jnp.where(local, dy_MN, 0)
    dw, q_h_m, q_dy_m = _wgrad(h_local, dy_local, w, sizes_E, offset, opts)
    cts = None
    if fwd is not None:
        bwd_k = stats.counts(h_local, q_h_m)
        bwd_n = stats.total((dy_MN, q_dy_n), rows=local) + stats.counts(dy_local, q_dy_m)
        cts = _cotangents(fwd, bwd_k, bwd_n)
    return dgate, dup, dw.astype(w_tag.dtype), None, None, None, None, cts


@functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9, 10))
def _glu(gate_MF, up_MF, rhs_EFN, sizes_E, offset, given, held, probes, opts, act, names):
    args = (gate_MF, up_MF, rhs_EFN, sizes_E, offset, given, held, None)
    return _glu_forward(*args, opts, act, names)[0]


def _glu_fwd(gate_MF, up_MF, rhs_EFN, sizes_E, offset, given, held, probes, opts, act, names):
    args = (gate_MF, up_MF, rhs_EFN, sizes_E, offset, given, held, probes)
    return _glu_forward(*args, opts, act, names)


_glu.defvjp(_glu_fwd, _glu_backward)
