"""The all-to-all exchange of expert parallelism: the plan every expert shard computes identically
(who sends how many rows where, `make_plan`) and the exchange itself with
`jax.lax.ragged_all_to_all`'s semantics: the native ragged all-to-all where the backend has it
(GPU, TPU), `padded_all_to_all` elsewhere (XLA:CPU has none): `jax.lax.all_to_all` over per-peer
blocks padded to a static size, in rounds (docs/design/ep.md).

Shape letters (docs/notation.md): M routed rows, P shards on the expert axis (EP), E experts.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from expertax.config.schema import Config
from expertax.nn.moe import rows as rows_mod
from expertax.nn.moe.strategy import EXPERT
from expertax.nn.moe.vma import varying_axes, varying_over
from expertax.nn.param import params_dataclass

# ---------------------------------------------------------------------------------------------
# The exchange plan: who sends how many rows where, known identically on every expert shard.


@params_dataclass
class ExchangePlan:
    """Offsets and sizes of one shard's forward and reverse all-to-all (all int32).

    Forward: rows `[fwd_in_off[j], +fwd_send[j])` of the expert-sorted rows go to peer j, at row
    `fwd_out_off[j]` of its receive buffer; `fwd_recv[i]` rows arrive from peer i. Reverse: the
    same exchange mirrored. `recv_counts_PX[i, x]`: rows from peer i for local expert x.
    """

    fwd_in_off: jax.Array  # [P]
    fwd_send: jax.Array  # [P]
    fwd_out_off: jax.Array  # [P]
    fwd_recv: jax.Array  # [P]
    rev_in_off: jax.Array  # [P]
    rev_send: jax.Array  # [P]
    rev_out_off: jax.Array  # [P]
    rev_recv: jax.Array  # [P]
    recv_counts_PX: jax.Array  # [P, X]
    longest: jax.Array  # scalar int32: the most rows any shard sends any peer (either way)
    dropped: jax.Array  # scalar int32: rows of this expert group that did not fit, all shards


def exclusive_cumsum(a, axis):
    return jnp.cumsum(a, axis=axis) - a


def make_plan(counts_PE: jax.Array, me: jax.Array, buffer_rows: int) -> ExchangePlan:
    """The exchange from the all-gathered per-expert counts `counts_PE[src, e]`.

    Each receiver fills its `buffer_rows` rows in (source, local expert) order; the rows that do
    not fit are the tail of each source's chunk (its last experts) and are counted in `dropped`.
    """
    p, e = counts_PE.shape
    x = e // p
    full_PPX = counts_PE.reshape(p, p, x).astype(jnp.int32)  # [src, dst, local expert]
    per_dst = full_PPX.transpose(1, 0, 2).reshape(p, p * x)  # [dst, (src, x)]
    room = jnp.clip(buffer_rows - exclusive_cumsum(per_dst, 1), 0, None)
    kept_PPX = jnp.minimum(per_dst, room).reshape(p, p, x).transpose(1, 0, 2)
    sent_PP = kept_PPX.sum(-1)
    chunk_start_PP = exclusive_cumsum(full_PPX.sum(-1), 1)  # in the sender's sorted rows
    recv_off_PP = exclusive_cumsum(sent_PP, 0)  # in the receiver's buffer
    return ExchangePlan(
        fwd_in_off=chunk_start_PP[me],
        fwd_send=sent_PP[me],
        fwd_out_off=recv_off_PP[me],
        fwd_recv=sent_PP[:, me],
        rev_in_off=recv_off_PP[:, me],
        rev_send=sent_PP[:, me],
        rev_out_off=chunk_start_PP[:, me],
        rev_recv=sent_PP[me],
        recv_counts_PX=kept_PPX[:, me, :],
        longest=jnp.max(sent_PP),
        dropped=jnp.sum(full_PPX) - jnp.sum(kept_PPX),
    )


def buffer_rows(c: Config, num_rows_routed: int, num_tokens: int, ep: int) -> int:
    """Receive-buffer rows M: the worst case, or `ragged_buffer_factor` x the rows routed."""
    x = c.num_experts // ep
    worst = ep * num_tokens * min(c.num_experts_per_tok, x)
    if c.ragged_buffer_factor <= 0:
        return worst
    return max(1, min(worst, math.ceil(c.ragged_buffer_factor * num_rows_routed)))


# ---------------------------------------------------------------------------------------------
# All-to-all implementations with `jax.lax.ragged_all_to_all`'s semantics.


# Rows per peer block in one round of the padded all-to-all, in units of the mean rows one peer
# gets (N*K/P). A pair's chunk larger than the block goes in further rounds, so balanced routing
# moves about this factor x the routed rows in one round, and a skewed pair costs rounds, not a
# worst-case block for every pair. 2 never moves more than the single worst-case block did while
# X >= K (the static block was N*min(K, X) = P x the mean).
PADDED_ROUND_FACTOR = 2


def _rows_mask(mask, ndim: int):
    """A mask over leading (row) dims, broadcastable against an array of `ndim` dims."""
    return mask.reshape(mask.shape + (1,) * (ndim - mask.ndim))


def _exchange_rounds(
    operand, output, in_off, send, recv_off, recv, longest, *, axis_name, block_rows
):
    """The padded exchange: in round q, peer j gets rows `[q*block, (q+1)*block)` of this shard's
    chunk for it (`operand[in_off[j]:][:send[j]]`, zero-padded); the receiver writes the first
    `recv[i]` rows of source i's chunk at `recv_off[i]` of `output` (its own offsets). Rounds run
    until the longest chunk of any pair (`longest`, the same on every shard) has moved."""
    n, m = operand.shape[0], output.shape[0]
    r = jnp.arange(block_rows, dtype=jnp.int32)
    rounds = (longest + block_rows - 1) // block_rows
    # The loop's carry varies over every manual axis any input (and the exchange) varies over.
    axes = {axis_name}.union(
        *(varying_axes(a) for a in (operand, output, in_off, send, recv_off, recv))
    )
    # Each source's block is written in place with a static-size update. A block that would
    # run past the buffer's end is written at `m - block` instead, its rows shifted down by the
    # difference (a gather of the block), so the buffer needs no spare rows (and no copy into
    # a larger one): only a buffer smaller than one block is padded.
    spare = max(0, block_rows - m)
    out = output
    if spare:
        out = jnp.concatenate([output, jnp.zeros((spare, *output.shape[1:]), output.dtype)])
    out = varying_over(out, axes)
    last = out.shape[0] - block_rows

    def one_round(q, out):
        start = q * block_rows
        valid = start + r[None, :] < send[:, None]  # [P, block]
        src = jnp.clip(in_off[:, None] + start + r[None, :], 0, n - 1)
        blocks = jnp.where(_rows_mask(valid, operand.ndim + 1), jnp.take(operand, src, axis=0), 0)
        got = jax.lax.all_to_all(blocks, axis_name, 0, 0, tiled=True)  # [P, block, ...] by source
        for i in range(send.shape[0]):
            at = recv_off[i] + start
            at_c = jnp.minimum(at, last)
            shift = at - at_c  # > 0 only for a block that reaches the buffer's end
            rows = jnp.take(got[i], jnp.clip(r - shift, 0, block_rows - 1), axis=0)
            keep = _rows_mask((r >= shift) & (start + r - shift < recv[i]), out.ndim)
            old = jax.lax.dynamic_slice_in_dim(out, at_c, block_rows)
            out = jax.lax.dynamic_update_slice_in_dim(out, jnp.where(keep, rows, old), at_c, 0)
        return out

    out = jax.lax.fori_loop(0, rounds, one_round, out)
    return out[:m] if spare else out


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9))
def _padded(operand, output, in_off, send, recv_off, recv, longest, axis_name, block_rows, n_rows):
    return _padded_fwd(
        operand, output, in_off, send, recv_off, recv, longest, axis_name, block_rows, n_rows
    )[0]


def _padded_fwd(
    operand, output, in_off, send, recv_off, recv, longest, axis_name, block_rows, n_rows
):
    out = _exchange_rounds(
        operand,
        output,
        in_off,
        send,
        recv_off,
        recv,
        longest,
        axis_name=axis_name,
        block_rows=block_rows,
    )
    return out, (in_off, send, recv_off, recv, longest)


def _padded_bwd(axis_name, block_rows, n_rows, res, ct_out):
    """The transpose is the mirrored exchange: each receiver sends the cotangents of the rows it
    got back to their source, which puts them where they came from (its own `in_off`). Output
    rows that were written get no cotangent through `output`."""
    in_off, send, recv_off, recv, longest = res
    ct_operand = _exchange_rounds(
        ct_out,
        rows_mod.own_zeros((n_rows, *ct_out.shape[1:]), ct_out.dtype, ct_out),
        recv_off,
        recv,
        in_off,
        send,
        longest,
        axis_name=axis_name,
        block_rows=block_rows,
    )
    pos = jnp.arange(ct_out.shape[0], dtype=jnp.int32)[None, :]
    written = jnp.any((pos >= recv_off[:, None]) & (pos < (recv_off + recv)[:, None]), axis=0)
    ct_output = jnp.where(_rows_mask(written, ct_out.ndim), jnp.zeros((), ct_out.dtype), ct_out)
    return ct_operand, ct_output, None, None, None, None, None


_padded.defvjp(_padded_fwd, _padded_bwd)


def padded_all_to_all(
    operand,
    output,
    input_offsets,
    send_sizes,
    output_offsets,
    recv_sizes,
    *,
    axis_name: str,
    block_rows: int,
    longest=None,
    recv_offsets=None,
):
    """`ragged_all_to_all` from `all_to_all`, in rounds of per-peer blocks of `block_rows` rows.

    Peer j's chunk is `operand[input_offsets[j]:][:send_sizes[j]]`; it travels in zero-padded
    blocks of `block_rows` rows, one per round, for as many rounds as the longest chunk of any
    pair needs (`longest`, known from the exchange plan; one `pmax` over the axis when not
    given; see `PADDED_ROUND_FACTOR`); the receiver writes the first `recv_sizes[i]` rows of
    source i's chunk at the offset source i chose (`output_offsets`, sent along, unless the
    receiver already knows them: `recv_offsets[i]`, as the exchange plan does). Rows of
    `output` nobody writes keep their value. Each round moves P * block_rows rows per shard.
    Its own VJP (the mirrored exchange), since the round count is dynamic.
    """
    # The rows are marked varying over every axis the exchange's result varies over, so the
    # VJP's cotangents have their primals' types (JAX sums them over the added axes).
    args = (operand, output, input_offsets, send_sizes, output_offsets, recv_sizes)
    axes = {axis_name}.union(*(varying_axes(a) for a in args))
    if longest is None:
        longest = jax.lax.pmax(jnp.max(send_sizes), axis_name)
    if recv_offsets is None:
        recv_offsets = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)
    return _padded(
        varying_over(operand, axes),
        varying_over(output, axes),
        input_offsets,
        send_sizes,
        recv_offsets,
        recv_sizes,
        longest,
        axis_name,
        block_rows,
        operand.shape[0],
    )


def all_to_all(
    impl: str,
    operand,
    output,
    in_off,
    send,
    out_off,
    recv,
    *,
    block_rows: int,
    longest=None,
    recv_off=None,
):
    """Ragged all-to-all over `expert` with the chosen implementation (`ragged` | `padded`).
    `longest` (`ExchangePlan.longest`) and `recv_off` (where this shard puts each source's rows)
    save the padded exchange two collectives: the plan already knows them."""
    args = (operand, output, in_off, send, out_off, recv)
    if impl == "ragged":
        return _ragged(operand.shape[0], *args)
    return padded_all_to_all(
        *args, axis_name=EXPERT, block_rows=block_rows, longest=longest, recv_offsets=recv_off
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ragged(n, operand, output, in_off, send, out_off, recv):
    """`jax.lax.ragged_all_to_all` over `expert`, with JAX's own transpose (the mirrored
    exchange) but its zero buffers `rows.own_zeros`: JAX's are one zero fill for every
    exchange of a shape in the backward, which XLA then copies for each, all copies live at
    once (rows.own_zeros). `n`: the operand's rows (static)."""
    del n
    return jax.lax.ragged_all_to_all(operand, output, in_off, send, out_off, recv, axis_name=EXPERT)


def _ragged_fwd(n, operand, output, in_off, send, out_off, recv):
    out = _ragged(n, operand, output, in_off, send, out_off, recv)
    return out, (in_off, send, out_off, recv)


def _ragged_bwd(n, res, ct):
    """`n`: the operand's rows."""
    in_off, send, out_off, recv = res
    # where this shard's rows went in each peer's buffer, and where each peer's rows came from
    # in its own: the offsets as the peers hold them
    out_off_t = jax.lax.all_to_all(out_off, EXPERT, 0, 0, tiled=True)
    in_off_t = jax.lax.all_to_all(in_off, EXPERT, 0, 0, tiled=True)
    zeros = rows_mod.own_zeros((n, *ct.shape[1:]), ct.dtype, ct)
    ct_operand = jax.lax.ragged_all_to_all(
        ct, zeros, out_off_t, recv, in_off_t, send, axis_name=EXPERT
    )
    # the output's rows that the exchange wrote take no cotangent through `output`
    pos = jnp.arange(ct.shape[0], dtype=jnp.int32)[None, :]
    written = jnp.any((pos >= out_off_t[:, None]) & (pos < (out_off_t + recv)[:, None]), axis=0)
    ct_output = jnp.where(_rows_mask(written, ct.ndim), jnp.zeros((), ct.dtype), ct)
    return ct_operand, ct_output, None, None, None, None


_ragged.defvjp(_ragged_fwd, _ragged_bwd)


def padded_block_rows(c: Config, num_tokens: int, ep: int, buffer: int) -> int:
    """Rows per peer block in one round of the padded all-to-all, both ways:
    `PADDED_ROUND_FACTOR` x the mean rows a peer gets (N*K/P), a multiple of 8, never more than
    the most one shard can send one peer (N x min(K, X)) or the receive buffer."""
    k = c.num_experts_per_tok
    worst = num_tokens * min(k, c.num_experts // ep)
    mean = -(-num_tokens * k // ep)
    block = 8 * -(-PADDED_ROUND_FACTOR * mean // 8)
    return max(1, min(block, worst, buffer))
