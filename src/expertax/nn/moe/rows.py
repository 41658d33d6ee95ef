"""Row gathers, weighted scatter-adds and row-wise maps whose work is the dynamic row count.

Expert parallelism keeps static, worst-case-sized row buffers (R rows: every assignment that
could land on this shard), but only `count` of their rows are real. `gather_rows` and
`scatter_rows` loop over `ceil(count / chunk)` chunks of `chunk` rows (a `fori_loop` with a
dynamic trip count), so their cost, forward and backward, is O(count x D) plus one zero fill of
the output, never O(R x D). A loop with a dynamic trip count is not reverse-differentiable, so
both carry a `custom_vjp` whose backward is the mirrored loop: the gradient of a gather is a
scatter-add over the same `count` rows, the gradient of a weighted scatter-add is a gather.

The last chunk is clamped to end at row R (no padding of the buffers to a multiple of `chunk`)
and masked to the rows `[i * chunk, count)`, so rows are never written (or added) twice.
Rows `>= count` of a gathered buffer are zero; indices of rows `>= count` are never read.
(The SwiGLU between the grouped matmuls runs inside the second one, on its work items' rows:
`gmm.gmm_glu`.)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from expertax.nn.moe.vma import varying_like

ROW_CHUNK = 256  # rows per loop iteration (read at trace time, when `chunk` is not given)


def own_zeros(shape, dtype, like) -> jax.Array:
    """Zeros of `shape` that the compiler cannot merge with another call's, for the init of a
    loop or of an in-place collective's output (the buffer it updates). XLA's common-
    subexpression elimination makes identical zero fills one buffer, and copy insertion then
    gives each loop or collective a copy of it, placed where that one buffer is made: all the
    copies live at once, long before their users run. Here the fill is the bits of `like`'s
    first element shifted right by their width (zero, by the shift's definition), which the
    compiler does not fold, so each call site's buffer is its own, made when `like` (the data
    the loop or collective reads: it runs after it anyway) exists."""
    if like.size == 0 or like.dtype == jnp.bool_:
        return jnp.zeros(shape, dtype)
    first = jnp.ravel(like)[0]
    width = 8 * jnp.dtype(first.dtype).itemsize
    bits = jax.lax.bitcast_convert_type(first, jnp.dtype(f"uint{width}"))
    fill = jax.lax.shift_right_logical(bits, jnp.asarray(width, bits.dtype)).astype(dtype)
    return jax.lax.broadcast(fill, tuple(shape))


def _chunk(r: int, chunk: int | None) -> int:
    return max(1, min(ROW_CHUNK if chunk is None else chunk, r))


def _trips(count, chunk: int):
    return (count + chunk - 1) // chunk


def _rows(i, count, chunk: int, r: int):
    """Start of chunk i of the rows `[0, count)` (clamped so that it ends inside R)
    and the mask of its own rows."""
    row0 = i * chunk
    start = jnp.minimum(row0, r - chunk)
    rows = start + jnp.arange(chunk, dtype=jnp.int32)
    return start, (rows >= row0) & (rows < count)


def _same_varying(*args):
    """All args varying over the same manual axes, before they enter a custom VJP (as in gmm):
    autodiff then transposes the implicit broadcast of a replicated operand (a psum) itself."""
    return tuple(varying_like(a, *args) for a in args)


def gather_rows(x_ND, idx_R, count, chunk: int | None = None):
    """`out[r] = x[idx[r]]` for r < count, zero for r >= count: [R, D] in O(count x D)."""
    args = _same_varying(x_ND, idx_R.astype(jnp.int32), jnp.asarray(count, jnp.int32))
    return _gather(*args, x_ND.shape[0], _chunk(idx_R.shape[0], chunk))


def _gather_loop(x_ND, idx_R, count, chunk):
    r = idx_R.shape[0]
    out = varying_like(own_zeros((r, x_ND.shape[1]), x_ND.dtype, x_ND), x_ND, idx_R, count)

    def body(i, out):
        start, mask = _rows(i, count, chunk, r)
        ids = jax.lax.dynamic_slice_in_dim(idx_R, start, chunk)
        got = jnp.take(x_ND, ids, axis=0, mode="clip")
        old = jax.lax.dynamic_slice_in_dim(out, start, chunk)
        return jax.lax.dynamic_update_slice_in_dim(
            out, jnp.where(mask[:, None], got, old), start, 0
        )

    return jax.lax.fori_loop(0, _trips(count, chunk), body, out)


def _scatter_loop(y_RD, idx_R, w_R, count, n: int, chunk: int):
    """`out[idx[r]] += w[r] * y[r]` for r < count, in w's dtype (y's when w is None)."""
    r = idx_R.shape[0]
    acc = y_RD.dtype if w_R is None else w_R.dtype
    refs = (y_RD, idx_R, count) if w_R is None else (y_RD, idx_R, w_R, count)
    out = varying_like(own_zeros((n, y_RD.shape[1]), acc, y_RD), *refs)

    def body(i, out):
        start, mask = _rows(i, count, chunk, r)
        ids = jax.lax.dynamic_slice_in_dim(idx_R, start, chunk)
        y = jax.lax.dynamic_slice_in_dim(y_RD, start, chunk).astype(acc)
        if w_R is not None:
            y = y * jax.lax.dynamic_slice_in_dim(w_R, start, chunk)[:, None]
        y = jnp.where(mask[:, None], y, jnp.zeros((), acc))
        return out.at[ids].add(y, mode="drop")

    return jax.lax.fori_loop(0, _trips(count, chunk), body, out)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _gather(x_ND, idx_R, count, n, chunk):
    del n  # x's rows, static, for the backward pass
    return _gather_loop(x_ND, idx_R, count, chunk)


def _gather_fwd(x_ND, idx_R, count, n, chunk):
    del n
    return _gather_loop(x_ND, idx_R, count, chunk), (idx_R, count)


def _gather_bwd(n, chunk, res, dout_RD):
    idx_R, count = res
    return _scatter_loop(dout_RD, idx_R, None, count, n, chunk), None, None


_gather.defvjp(_gather_fwd, _gather_bwd)


def scatter_rows(y_RD, idx_R, w_R, count, n: int, chunk: int | None = None):
    """`out[idx[r]] += w[r] * y[r]` for r < count: [n, D] in w's dtype, in O(count x D).

    The weighted combine of expert outputs back into their tokens; accumulation (and the
    output) in `w_R`'s dtype, so a float32 `w_R` gives a float32 [n, D] accumulator while the
    rows stay in their own dtype. Gradients for y and w (not for the indices).
    """
    args = _same_varying(y_RD, idx_R.astype(jnp.int32), w_R, jnp.asarray(count, jnp.int32))
    return _scatter(*args, n, _chunk(idx_R.shape[0], chunk))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _scatter(y_RD, idx_R, w_R, count, n, chunk):
    return _scatter_loop(y_RD, idx_R, w_R, count, n, chunk)


def _scatter_fwd(y_RD, idx_R, w_R, count, n, chunk):
    return _scatter_loop(y_RD, idx_R, w_R, count, n, chunk), (y_RD, idx_R, w_R, count)


def _scatter_bwd(n, chunk, res, dout_ND):
    """dy[r] = w[r] * dout[idx[r]], dw[r] = <dout[idx[r]], y[r]> for r < count, else zero."""
    y_RD, idx_R, w_R, count = res
    r = idx_R.shape[0]
    acc = w_R.dtype
    dy = varying_like(own_zeros(y_RD.shape, y_RD.dtype, dout_ND), y_RD, idx_R, w_R, count, dout_ND)
    dw = varying_like(own_zeros(w_R.shape, w_R.dtype, dout_ND), y_RD, idx_R, w_R, count, dout_ND)

    def body(i, carry):
        dy, dw = carry
        start, mask = _rows(i, count, chunk, r)
        ids = jax.lax.dynamic_slice_in_dim(idx_R, start, chunk)
        g = jnp.take(dout_ND, ids, axis=0, mode="clip").astype(acc)
        y = jax.lax.dynamic_slice_in_dim(y_RD, start, chunk).astype(acc)
        w = jax.lax.dynamic_slice_in_dim(w_R, start, chunk)
        gy = jnp.where(mask[:, None], g * w[:, None], 0).astype(y_RD.dtype)
        gw = jnp.where(mask, jnp.sum(g * y, axis=-1), 0).astype(w_R.dtype)
        old_y = jax.lax.dynamic_slice_in_dim(dy, start, chunk)
        old_w = jax.lax.dynamic_slice_in_dim(dw, start, chunk)
        dy = jax.lax.dynamic_update_slice_in_dim(dy, jnp.where(mask[:, None], gy, old_y), start, 0)
        dw = jax.lax.dynamic_update_slice_in_dim(dw, jnp.where(mask, gw, old_w), start, 0)
        return dy, dw

    dy, dw = jax.lax.fori_loop(0, _trips(count, chunk), body, (dy, dw))
    return dy, None, dw, None


_scatter.defvjp(_scatter_fwd, _scatter_bwd)
