"""The fp8 matmul: one custom VJP for every GEMM a recipe names (config key `quantization`),
a dense linear being the grouped GEMM's case of one group.

- `dense(x, w_KN, recipe)`: a linear, [..., K] x [K, N] (attention projections, dense MLPs,
  shared experts: nn/linear.py);
- `grouped(lhs_MK, rhs_EKN, sizes_E, recipe)`: nn/moe/gmm.py's grouped matmul, rows sorted by
  group (the routed experts);
- `grouped_glu(gate, up, wo, sizes, recipe, act, names)`: the expert FFN's second GEMM with its
  gated activation, as DeepSeek-V3 stores it (Sec. 3.3.3: the SwiGLU's inputs cached in fp8,
  its output recomputed in the backward): the forward computes `act(gate, up)` from the exact
  inputs and multiplies its quantized tiles; what it saves is gate and up in 1 x 128 e4m3 tiles
  (named `names`, the remat names of gate and up: a policy that keeps them keeps these fp8
  bytes, a quarter of the two bf16 arrays plus the scales), from which the backward recomputes
  the hidden rows for the wgrad and takes the activation's gradient.

The three products take e4m3 operands quantized under the recipe (fp8/recipes.py):
- fprop: the rows in 1 x 128 tiles along K (per row, per 128 channels), the weight (each
  expert's) in 128 x 128 blocks (`fp8_tensorwise`: one scale for the rows, one per matrix);
- dgrad: the output gradient in 1 x 128 tiles along N, the weights as held;
- wgrad: the rows and the output gradient re-tiled along the rows (128 rows per scale, per
  channel); for groups, the rows outside the local experts' groups zeroed first (an EP buffer's
  unused rows hold anything, and would share a tile's scale with routed rows).
Where each product runs (dequantized, or on Hopper's kernels): fp8/products.py.

The forward saves the e4m3 values and scales of the rows and weights (what remat then holds),
never the rows in their own dtype. `given=` (the paged stash): the output is known; the value
is `given`, the backward this one's (`gmm.known`).

Probes (fp8/stats.py): the grouped GEMMs take two, whose cotangents are the quantizer counts of
the operands indexed by K (the rows: forward and backward) and by N (the output gradient:
backward); a dense linear passes its one probe as both, and the two cotangents add up.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from expertax.fp8 import kernel, products, recipes, stats
from expertax.fp8.products import Spec
from expertax.nn.moe import tiles
from expertax.nn.moe.gmm import known
from expertax.nn.moe.vma import varying_like
from expertax.parallel import remat

TILE = recipes.TILE
# `backend=HOPPER` (`gmm_impl=fp8_hopper`, or `auto` on a Hopper mesh: fp8/kernel.py): the
# grouped products on Hopper's kernels (fp8/hopper/; on CPU their interpreter)
HOPPER = kernel.HOPPER


def dense(x: jax.Array, w_KN: jax.Array, recipe: str, probe=None) -> jax.Array:
    """`x @ w_KN` ([..., K] x [K, N] -> [..., N], in x's dtype) with fp8 operands in all three
    GEMMs under `recipe` (one of `recipes.RECIPES`), on Hopper's kernels where `kernel.dense`
    says. `probe` (float32 zeros `stats.SHAPE`, optional): its cotangent is this GEMM's
    quantizer counts (fp8/stats.py)."""
    recipes.check_recipe(recipe)
    lead, k = x.shape[:-1], x.shape[-1]
    if w_KN.ndim != 2 or w_KN.shape[0] != k:
        raise ValueError(f"fp8 matmul: x {x.shape} and w {w_KN.shape} do not contract")
    spec = Spec(recipe, grouped=False, hopper=kernel.dense(recipe, k, w_KN.shape[1]))
    probes = None if probe is None else (probe, probe)
    y = _matmul((x.reshape(-1, k),), w_KN, None, None, (None,), probes, spec)
    return y.reshape(*lead, w_KN.shape[1])


def grouped(
    lhs_MK, rhs_EKN, sizes_E, recipe: str, *, group_offset=None, given=None, probes=None, **kw
):
    """`gmm.gmm(lhs_MK, rhs_EKN, sizes_E, group_offset=..., **kw)` with fp8 operands under
    `recipe`; `kw`: `backend`, `tile_rows`, `tile_rows_min`. The output is in lhs_MK's dtype.
    `probes` (optional): the two probes (the module docstring)."""
    arrays = (lhs_MK, rhs_EKN, sizes_E)
    spec, args, probes = _prepare(recipe, group_offset, kw, probes, None, (), *arrays)
    lhs_MK, rhs_EKN, sizes_E, offset = args
    if given is not None:
        given = varying_like(given.astype(lhs_MK.dtype), lhs_MK)
    return _apply((lhs_MK,), rhs_EKN, sizes_E, offset, given, (None,), probes, spec)


def grouped_glu(
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
    """`grouped(act(gate, up), rhs, sizes, recipe)` saving gate and up in fp8 under the
    checkpoint `names` (gate's, up's) for the backward (the module docstring); `act` hashable.

    `held` (the paged stash's read mode): (gate's, up's) quantized tiles as the forward saved
    them (`recipes.quantize(.., 1, TILE)`), or None each: those are the residuals, and the
    values of `gate_MF`/`up_MF` they stand for are not read (the forward's output, when not
    `given`, and the counts come from their dequantized values)."""
    arrays = (gate_MF, up_MF, rhs_EFN, sizes_E)
    spec, args, probes = _prepare(recipe, group_offset, kw, probes, act, tuple(names), *arrays)
    gate_MF, up_MF, rhs_EFN, sizes_E, offset = args
    if given is not None:
        given = varying_like(given.astype(gate_MF.dtype), gate_MF)
    held = tuple(held) + (None,) * (2 - len(held))
    held = jax.tree.map(lambda a: varying_like(a, gate_MF), held)
    return _apply((gate_MF, up_MF), rhs_EFN, sizes_E, offset, given, held, probes, spec)


def _prepare(recipe, group_offset, kw, probes, act, names, *arrays):
    """(the VJP's `Spec`, `arrays` with int32 sizes last and the group offset appended, all
    with the same varying mesh axes as `gmm._gmm_tiled` gives its operands, and the probes with
    those axes: their cotangents vary where the counts do, and the transpose of that widening
    sums them over the shards)."""
    recipes.check_recipe(recipe)
    offset = jnp.asarray(0 if group_offset is None else group_offset, jnp.int32)
    backend = tuple(sorted(kw.items()))
    # the balanced-routing rows the tile loops are named with (tiles.py), also in the backward
    # products, which are traced later, outside the MoE layer's scope
    expected = tiles.current_expected_rows()
    hopper = kw.get("backend") == HOPPER
    spec = Spec(recipe, True, hopper, group_offset is not None, backend, expected, act, names)
    args = (*arrays[:-1], arrays[-1].astype(jnp.int32), offset)
    args = tuple(varying_like(a, *args) for a in args)
    return spec, args, jax.tree.map(lambda p: varying_like(p, *args), probes)


def _apply(xs, w, sizes, offset, given, held, probes, spec: Spec):
    """The matmul's value (or `given`, when known) with its VJP."""
    if given is None:
        return _matmul(xs, w, sizes, offset, held, probes, spec)
    args = (xs, w, sizes, offset, given, held, probes)
    res = functools.partial(_given_residuals, spec)
    return known(res, functools.partial(_given_backward, spec), given, args)


def _local_rows(sizes_E, offset, e_local: int, m: int):
    """[M, 1] bool: the rows of the groups [offset, offset + e_local) (sorted rows)."""
    g = jnp.arange(sizes_E.shape[0])
    start = jnp.sum(jnp.where(g < offset, sizes_E, 0))
    end = start + jnp.sum(jnp.where((g >= offset) & (g < offset + e_local), sizes_E, 0))
    r = jnp.arange(m)
    return ((r >= start) & (r < end))[:, None]


def _local(spec: Spec, sizes, offset, w, m: int):
    """The rows that belong to the local groups, or None for a dense linear (all of them)."""
    return _local_rows(sizes, offset, w.shape[0], m) if spec.grouped else None


def _forward(xs, w, sizes, offset, given, held, probes, spec: Spec):
    """(the output, or `given`; the residuals): the rows `xs[0]`, or `spec.act(*xs)` from the
    exact inputs (or as `held` stands for them), quantized and multiplied."""
    recipe = spec.recipe
    qw = recipes.quantize(w, recipe, TILE, TILE)  # each expert's matrix on its own
    q_xs = tuple(recipes.quantize(a, recipe, 1, TILE) if q is None else q for a, q in zip(xs, held))
    fwd = None
    if spec.act is None:
        rows, q_rows = xs[0], q_xs[0]
    elif given is None or probes is not None:
        # (with a given output and probes: the hidden rows only for their counts)
        exact = (
            a if h is None else recipes.dequantize(q, a.dtype, 1, TILE)
            for a, h, q in zip(xs, held, q_xs)
        )
        rows = spec.act(*exact)
        q_rows = recipes.quantize(rows, recipe, 1, TILE)
    if probes is not None:
        fwd = stats.counts(rows, q_rows[0], _local(spec, sizes, offset, w, rows.shape[0]))
    if given is None:
        given = products.fprop(spec, q_rows, qw, sizes, offset, rows.dtype, w.dtype)
    # the activation's inputs under their checkpoint names (remat keeps or recomputes these fp8
    # bytes as the policy places the names)
    if spec.names:
        q_xs = tuple(
            jax.tree.map(lambda a, n=n: remat.tag(a, n), q) for q, n in zip(q_xs, spec.names)
        )
    tags = (jnp.zeros((0,), xs[0].dtype), jnp.zeros((0,), w.dtype))
    return given, (q_xs, qw, sizes, offset, tags, fwd)


def _backward(spec: Spec, res, dy_MN):
    """The cotangents of (xs, w, sizes, offset, held, probes)."""
    recipe = spec.recipe
    q_xs, qw, sizes, offset, (x_tag, w_tag), fwd = res
    xs = tuple(recipes.dequantize(q, x_tag.dtype, 1, TILE) for q in q_xs)
    if spec.act is None:
        rows, pull = xs[0], lambda d: (d,)
    else:
        rows, pull = jax.vjp(spec.act, *xs)
    w = recipes.dequantize(qw, w_tag.dtype, TILE, TILE)
    dy_MN = dy_MN.astype(rows.dtype)
    # dgrad: the output gradient in 1 x 128 tiles along N (the contraction), the weights as held
    q_dy = recipes.quantize(dy_MN, recipe, 1, TILE)
    dxs = pull(products.dgrad(spec, q_dy, qw, rows, w, sizes, offset))
    # wgrad: both operands re-tiled along the rows (its contraction), foreign rows zeroed; the
    # hidden rows of a gated activation as the forward multiplied them (their 1 x 128 tiles)
    if spec.act is not None:
        q_rows = recipes.quantize(rows, recipe, 1, TILE)
        rows = recipes.dequantize(q_rows, rows.dtype, 1, TILE)
    local = _local(spec, sizes, offset, w, rows.shape[0])
    rows_local, dy_local = (a if local is None else jnp.where(local, a, 0) for a in (rows, dy_MN))
    dw, q_x_m, q_dy_m = products.wgrad(spec, rows_local, dy_local, w, sizes, offset)
    cts = None
    if fwd is not None:
        bwd_k = stats.counts(rows_local, q_x_m)
        bwd_n = stats.total((dy_MN, q_dy[0]), rows=local) + stats.counts(dy_local, q_dy_m)
        cts = (stats.encode(fwd, bwd_k), stats.encode(jnp.zeros_like(bwd_n), bwd_n))
    return dxs, dw.astype(w_tag.dtype), None, None, None, cts


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _matmul(xs, w, sizes, offset, held, probes, spec: Spec):
    return _forward(xs, w, sizes, offset, None, held, None, spec)[0]


def _matmul_fwd(xs, w, sizes, offset, held, probes, spec: Spec):
    return _forward(xs, w, sizes, offset, None, held, probes, spec)


_matmul.defvjp(_matmul_fwd, _backward)


def _given_residuals(spec: Spec, xs, w, sizes, offset, given, held, probes):
    return _forward(xs, w, sizes, offset, given, held, probes, spec)[1]


def _given_backward(spec: Spec, res, dy_MN):
    dxs, dw, _, _, held, cts = _backward(spec, res, dy_MN)
    return dxs, dw, None, None, None, held, cts
