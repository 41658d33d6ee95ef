"""Blockwise causal attention: online softmax over key blocks, recomputed in the backward pass.

The same function as `kernel.attend_dot` (the mask from the queries' and keys' positions under a
causal mask spec, mask.py: plain causal, sliding window, chunked, sinks; optional packed-document
segment ids, GQA, query/key head dim Q different from value head dim O as in MLA, scores and
softmax in float32),
but no [T, S] score matrix per head is ever held: queries are cut into blocks of `block_q` rows
and keys into blocks of `block_k` columns, and each query block walks the key blocks keeping a
running row max, row sum and output accumulator (FlashAttention, arXiv:2205.14135 Alg. 1).

Causality is a real skip, not a mask over a full computation: query block i visits only the key
blocks up to the diagonal (a `fori_loop` with a trip count computed from i), and in the backward
pass key block j visits only the query blocks from the diagonal on. About half the block pairs
are never computed. The skip follows where the rows sit (query row r at key row offset + r);
the mask inside a visited block follows the positions, so the skip is exact for any positions
that do not decrease along a document (training's, a query chunk's): a key row after the query
row is then a later position or another document, masked either way.

Backward (FlashAttention-2, arXiv:2307.08691 Alg. 2): the forward saves only its inputs, the
output and the row log-sum-exp; the backward recomputes each block's probabilities from them.
One pass over key blocks accumulates dK and dV in registers of the loop and adds each block's dQ
into a [T, Q] float32 buffer, so every block pair costs five matmuls (QK^T, dO V^T, P^T dO,
dS^T Q, dS K) instead of the seven of a separate dQ pass.

All temporaries are O(T) plus O(block_q * block_k) per head; `tests/unit/nn/attention` checks that
the compiled temp bytes of forward+backward grow linearly in T.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from expertax import scopes
from expertax.nn.attention import mask
from expertax.nn.attention.mask import CAUSAL, MaskSpec
from expertax.nn.moe.vma import varying_like

# Score given to masked (non-causal, other-document) pairs. Finite, so that a row of a block whose
# pairs are all masked has a finite max and no inf - inf; the probabilities of masked pairs are set
# to 0 explicitly, so this value never leaks into a sum.
MASKED_SCORE = -0.7 * float(jnp.finfo(jnp.float32).max)

DEFAULT_BLOCK = 512

# The position of a padding key (past the last key row): after every query's position.
PAD_POSITION = int(jnp.iinfo(jnp.int32).max)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def balanced_block(length: int, max_block: int) -> int:
    """The block size actually used: as many blocks as `max_block` needs, each as even as
    possible (rounded up to a multiple of 8), so that a length just above a multiple of the block
    pads a few rows, not a whole block (T = 768, max 512: two blocks of 384, not 1024 rows)."""
    if length <= max_block:
        return length
    n = _cdiv(length, max_block)
    return min(max_block, 8 * _cdiv(_cdiv(length, n), 8))


def _block_scores(q_blk, k_blk, seg_q_blk, seg_k_blk, pos_q_blk, pos_k_blk, spec, scale,
                  keys_first=False):  # fmt: skip
    """Scaled float32 scores [B, G, J, bq, bk] of a query block against a key block, and the
    mask (True where the pair attends: `spec` from the positions, mask.py, and same segment);
    with `keys_first`, both transposed: [B, G, bk, J, bq]."""
    if keys_first:
        scores = jnp.einsum("bgsq,bgjtq->bgsjt", k_blk, q_blk, preferred_element_type=jnp.float32)
    else:
        scores = jnp.einsum("bgjtq,bgsq->bgjts", q_blk, k_blk, preferred_element_type=jnp.float32)
    mask_BTS = mask.allowed(spec, pos_q_blk, pos_k_blk, seg_q_blk, seg_k_blk)
    if keys_first:
        return scores * jnp.float32(scale), jnp.swapaxes(mask_BTS, 1, 2)[:, None, :, None]
    return scores * jnp.float32(scale), mask_BTS[:, None, None]


def _num_key_blocks(i, bq: int, bk: int, nk: int, offset: int):
    """Key blocks query block i needs: those holding a column <= its last row's key position
    (the diagonal; query row r sits at key position `offset` + r)."""
    return jnp.minimum(nk, (offset + (i + 1) * bq - 1) // bk + 1)


def _trips(total: float, loops: int) -> str:
    """The `trips~N` scope of a causal inner loop: its mean trip count over the `loops` runs of
    its enclosing scan (`total` trips in all), so that the compiled program's FLOP count
    (planner/flops.py) multiplies its body by the trips it really makes."""
    return scopes.TRIPS.label(f"{total / loops:.6g}")


def _first_query_block(j, bq: int, bk: int, offset: int):
    """First query block that sees key block j: the one holding key position j * bk."""
    return jnp.maximum(0, (j * bk - offset) // bq)


class Blocks(NamedTuple):
    """Attention's inputs cut into blocks on a leading axis: queries [nq, B, G, J, bq, Q], keys
    [nk, B, G, bk, Q], values [nk, B, G, bk, O], the queries' and keys' segment ids ([n, B, b]
    or None) and positions ([n, B|1, b]); and the sink logits ([G, J] float32, or None)."""

    q: jax.Array
    k: jax.Array
    v: jax.Array
    seg_q: jax.Array | None
    seg_k: jax.Array | None
    pos_q: jax.Array
    pos_k: jax.Array
    sinks_GJ: jax.Array | None


def _varying(carry, blocks: Blocks):
    """Loop carries made varying over the manual axes of any input (inside a `shard_map` under
    context parallelism, nn/moe/vma.py: a `while_loop` needs its carry's type to equal its
    body's output's, which varies with the local queries)."""
    refs = [a for a in blocks if a is not None]
    return jax.tree.map(lambda a: varying_like(a, *refs), carry)


def _forward(blocks: Blocks, offset, scale, hint, spec):
    """Blocked inputs -> (out [nq, B, G, J, bq, O] in v's dtype, lse [nq, B, G, J, bq] float32).

    Learned sink logits (`blocks.sinks_GJ`) are one more column of every row's softmax, with no
    value: the running max starts at the sink and the running sum at exp(0) = 1, so the sink is
    in the row's log-sum-exp, from which the backward recomputes the probabilities; the sink's
    own gradient is -p_sink * rowsum(dO * O)."""
    nq, b, g, r, bq, _ = blocks.q.shape
    nk, bk, vd = blocks.k.shape[0], blocks.k.shape[3], blocks.v.shape[-1]

    def one_query_block(_, xs):
        i, q_blk, seg_q_blk, pos_q_blk = xs

        def one_key_block(j, carry):
            m_BGJT, l_BGJT, acc_BGJTO = carry
            seg_k_blk = None if blocks.seg_k is None else blocks.seg_k[j]
            s, ok = _block_scores(
                q_blk, blocks.k[j], seg_q_blk, seg_k_blk, pos_q_blk, blocks.pos_k[j], spec, scale
            )
            s = jnp.where(ok, s, MASKED_SCORE)
            m_new = jnp.maximum(m_BGJT, s.max(-1))
            p = jnp.where(ok, jnp.exp(s - m_new[..., None]), 0.0)
            alpha = jnp.exp(m_BGJT - m_new)
            l_new = alpha * l_BGJT + p.sum(-1)
            pv = jnp.einsum(
                "bgjts,bgso->bgjto",
                p.astype(blocks.v.dtype),
                blocks.v[j],
                preferred_element_type=jnp.float32,
            )
            return m_new, l_new, alpha[..., None] * acc_BGJTO + pv

        if blocks.sinks_GJ is None:
            m0, l0 = jnp.full((b, g, r, bq), MASKED_SCORE, jnp.float32), 0.0
        else:
            m0, l0 = jnp.broadcast_to(blocks.sinks_GJ[None, :, :, None], (b, g, r, bq)), 1.0
        l_init = jnp.full((b, g, r, bq), l0, jnp.float32)
        init = _varying((m0, l_init, jnp.zeros((b, g, r, bq, vd), jnp.float32)), blocks)
        visits = sum(min(nk, (hint + (n + 1) * bq - 1) // bk + 1) for n in range(nq))
        with jax.named_scope(_trips(visits, nq)):
            trips = _num_key_blocks(i, bq, bk, nk, offset)
            m, row_sum, acc = jax.lax.fori_loop(0, trips, one_key_block, init)
        # a row that reads no key (a padding row of the last block) gives 0, not 0 / 0
        row_sum = jnp.where(row_sum > 0, row_sum, 1.0)
        out = (acc / row_sum[..., None]).astype(blocks.v.dtype)
        return None, (out, m + jnp.log(row_sum))

    xs = (jnp.arange(nq), blocks.q, blocks.seg_q, blocks.pos_q)
    _, (out, lse) = jax.lax.scan(one_query_block, None, xs)
    return out, lse


def _backward(scale, hint, spec, res, d_out):
    """FlashAttention-2's backward, computed in the transposed (keys-first) layout.

    Each block pair's probabilities and their gradient are formed as [bk, J * bq] (keys first),
    so the dV and dK matmuls contract their left operand's last dims; dQ is accumulated
    transposed ([Q, J * bq]: K^T dS^T) and transposed once at the end. In the queries-first
    layout XLA:CPU copied P and dS into that layout for every block pair (two transposing
    passes over each float32 block, outside the fast matmul library); the five matmuls are the
    same. `benchmarks/attention.py` (2-core CPU, float32, H=16, Q=96, O=64, blocks of 512):
    forward+backward 0.64-0.74x the queries-first time at T=1024-4096, within noise at T=512
    (BENCHMARKS.md).
    """
    blocks, offset, out, lse = res
    nq, bq = blocks.q.shape[0], blocks.q.shape[4]
    nk, bk = blocks.k.shape[0], blocks.k.shape[3]
    # D_i = rowsum(dO_i * O_i) (FlashAttention-2 Alg. 2 line 4): dS = P * (dP - D).
    delta = jnp.einsum("nbgjto,nbgjto->nbgjt", d_out, out, preferred_element_type=jnp.float32)

    def one_key_block(dq_acc, xs):
        j, k_blk, v_blk, seg_k_blk, pos_k_blk = xs
        k_t = jnp.swapaxes(k_blk, 2, 3)  # [B, G, Q, bk], for dQ^T = K^T dS^T

        def one_query_block(i, carry):
            dq_acc, dk_BGSQ, dv_BGSO = carry
            q_blk, do_blk = blocks.q[i], d_out[i]
            seg_q_blk = None if blocks.seg_q is None else blocks.seg_q[i]
            s, ok = _block_scores(
                q_blk, k_blk, seg_q_blk, seg_k_blk, blocks.pos_q[i], pos_k_blk, spec, scale,
                keys_first=True,
            )  # fmt: skip
            p = jnp.where(ok, jnp.exp(s - lse[i][:, :, None]), 0.0)
            dv_BGSO += jnp.einsum(
                "bgsjt,bgjto->bgso",
                p.astype(do_blk.dtype),
                do_blk,
                preferred_element_type=jnp.float32,
            )
            dp = jnp.einsum("bgso,bgjto->bgsjt", v_blk, do_blk, preferred_element_type=jnp.float32)
            ds = p * (dp - delta[i][:, :, None]) * jnp.float32(scale)
            dk_BGSQ += jnp.einsum(
                "bgsjt,bgjtq->bgsq",
                ds.astype(q_blk.dtype),
                q_blk,
                preferred_element_type=jnp.float32,
            )
            dq_t = jnp.einsum(
                "bgqs,bgsjt->bgqjt",
                k_t,
                ds.astype(k_blk.dtype),
                preferred_element_type=jnp.float32,
            )
            return dq_acc.at[i].add(dq_t), dk_BGSQ, dv_BGSO

        zeros = (jnp.zeros(k_blk.shape, jnp.float32), jnp.zeros(v_blk.shape, jnp.float32))
        init = (dq_acc, *_varying(zeros, blocks))
        first = _first_query_block(j, bq, bk, offset)
        visits = sum(nq - max(0, (n * bk - hint) // bq) for n in range(nk))
        with jax.named_scope(_trips(visits, nk)):
            dq_acc, dk, dv = jax.lax.fori_loop(first, nq, one_query_block, init)
        return dq_acc, (dk.astype(k_blk.dtype), dv.astype(v_blk.dtype))

    _, b, g, r, _, qd = blocks.q.shape
    dq0 = _varying(jnp.zeros((nq, b, g, qd, r, bq), jnp.float32), blocks)  # dQ^T per query block
    dq_t, (dk, dv) = jax.lax.scan(
        one_key_block, dq0, (jnp.arange(nk), blocks.k, blocks.v, blocks.seg_k, blocks.pos_k)
    )
    dq = jnp.moveaxis(dq_t, 3, 5)  # [nq, B, G, J, bq, Q]
    d_sinks = None
    if (
        blocks.sinks_GJ is not None
    ):  # d lse / d sink = its probability; d out / d sink = -p_sink out
        p_sink = jnp.exp(blocks.sinks_GJ[None, None, :, :, None] - lse)  # [nq, B, G, J, bq]
        d_sinks = -jnp.sum(p_sink * delta, axis=(0, 1, 4))
    return Blocks(dq.astype(blocks.q.dtype), dk, dv, None, None, None, None, d_sinks), None


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _blocked_attention(blocks, offset, scale, hint, spec):
    """Attention over `Blocks`: the output blocks [nq, B, G, J, bq, O]."""
    return _forward(blocks, offset, scale, hint, spec)[0]


def _blocked_attention_fwd(blocks, offset, scale, hint, spec):
    out, lse = _forward(blocks, offset, scale, hint, spec)
    return out, (blocks, offset, out, lse)


_blocked_attention.defvjp(_blocked_attention_fwd, _backward)


def _to_blocks(x_BTX, block: int, pad_value=0):
    """[B, T, ...] -> [n, B, block, ...], padding T up to a multiple of block."""
    t = x_BTX.shape[1]
    n = _cdiv(t, block)
    pad = [(0, 0)] * x_BTX.ndim
    pad[1] = (0, n * block - t)
    x = jnp.pad(x_BTX, pad, constant_values=pad_value)
    x = x.reshape(x.shape[0], n, block, *x.shape[2:])
    return jnp.moveaxis(x, 1, 0)


def attend_blockwise(
    q_BTHQ: jax.Array,
    k_BSGQ: jax.Array,
    v_BSGO: jax.Array,
    *,
    scale: float,
    segment_ids_BT: jax.Array | None = None,
    block_q: int = DEFAULT_BLOCK,
    block_k: int = DEFAULT_BLOCK,
    q_offset: jax.Array | None = None,
    mean_q_offset: float = 0.0,
    q_positions_BT: jax.Array | None = None,
    kv_positions_BS: jax.Array | None = None,
    mask_spec: MaskSpec = CAUSAL,
    sink_logits_H: jax.Array | None = None,
) -> jax.Array:
    """Attention under a causal mask spec computed block by block; returns [B, T, H, O] in v's
    dtype. `sink_logits_H`: learned attention sinks, one logit per query head (`attend_dot`).

    Same arguments and result as `kernel.attend_dot` (the queries' rows the last T of S key rows,
    or from `q_offset` on; segment ids the keys'; positions [B|1, T] and [B|1, S], by default
    where the rows sit; `mean_q_offset`: the offset's mean over a scan of query chunks, for the
    `trips~N` scopes of the loops, whose counts follow the offset). `mask_spec` must be causal:
    the loops skip the key rows after each query row (see the module docstring).
    `block_q` and `block_k` are the largest
    block sizes; `balanced_block` evens them out over the sequence, and a sequence that is still
    not a multiple of the block is padded internally (padded keys sit at a position after every
    query, so causality hides them; padded query rows are dropped).
    """
    if block_q <= 0 or block_k <= 0:
        raise ValueError(f"block_q={block_q}, block_k={block_k}: blocks must be positive")
    if (why := mask.unsupported(mask_spec, "blockwise")) is not None:
        raise ValueError(why)
    b, t, h, qd = q_BTHQ.shape
    s, g = k_BSGQ.shape[1], k_BSGQ.shape[2]
    # query row r at key position offset + r; `hint`, static, counts the loops' trips
    offset = s - t if q_offset is None else q_offset
    hint = s - t if q_offset is None else round(mean_q_offset)
    bq, bk = balanced_block(t, block_q), balanced_block(s, block_k)
    # Heads before rows inside a block, so each block's matmuls are batched over B, G, J.
    q_BTGJQ = q_BTHQ.reshape(b, t, g, h // g, qd)
    q_blocks = jnp.moveaxis(_to_blocks(q_BTGJQ, bq), 2, 4)  # [nq, B, G, J, bq, Q]
    k_blocks = jnp.moveaxis(_to_blocks(k_BSGQ, bk), 2, 3)  # [nk, B, G, bk, Q]
    v_blocks = jnp.moveaxis(_to_blocks(v_BSGO, bk), 2, 3)  # [nk, B, G, bk, O]
    seg_q_blocks = seg_k_blocks = None
    if segment_ids_BT is not None:
        seg_q = jax.lax.dynamic_slice_in_dim(segment_ids_BT, offset, t, axis=1)
        seg_q_blocks = _to_blocks(seg_q, bq, pad_value=-1)  # [nq, B, bq]
        seg_k_blocks = _to_blocks(segment_ids_BT, bk, pad_value=-1)  # [nk, B, bk]
    if q_positions_BT is None:
        q_positions_BT = offset + jax.lax.broadcasted_iota(jnp.int32, (1, t), 1)
    if kv_positions_BS is None:
        kv_positions_BS = jax.lax.broadcasted_iota(jnp.int32, (1, s), 1)
    pos_q_blocks = _to_blocks(q_positions_BT.astype(jnp.int32), bq)  # [nq, B|1, bq]
    # a padding key sits after every query: the causal mask hides it
    pos_k_blocks = _to_blocks(kv_positions_BS.astype(jnp.int32), bk, pad_value=PAD_POSITION)
    sinks_GJ = None
    if sink_logits_H is not None:
        # varying like the queries inside a shard_map, so that its cotangent may too (the
        # pcast's transpose sums it over those axes)
        sinks_GJ = varying_like(sink_logits_H.astype(jnp.float32).reshape(g, h // g), q_BTHQ)
    blocks = Blocks(
        q_blocks, k_blocks, v_blocks, seg_q_blocks, seg_k_blocks, pos_q_blocks, pos_k_blocks,
        sinks_GJ,
    )  # fmt: skip
    out = _blocked_attention(blocks, jnp.asarray(offset, jnp.int32), scale, hint, mask_spec)
    out_BTGJO = jnp.moveaxis(out, (0, 4), (1, 2)).reshape(b, -1, g, h // g, v_BSGO.shape[-1])
    return out_BTGJO[:, :t].reshape(b, t, h, v_BSGO.shape[-1])
