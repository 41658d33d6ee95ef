"""Blockwise causal MLA attention whose keys and values are up-projected one key block at a time.

The same function as `blockwise.attend_blockwise` over MLA's keys and values (mla.py): keys
[S, H, Qn+Qr] = (latent @ wkv_b's key half, the shared RoPE key broadcast over heads), values
[S, H, O] = latent @ wkv_b's value half. Those are H * (Qn+Qr+O) values per key row (40,960 for
DeepSeek-V3) from Rkv+Qr = 576 gathered ones; under context parallelism (context.py) every
device would hold them for the whole sequence. Here they exist one key block at a time:
- forward: the loops are key-block outer, query-block inner. Each key block's latent
  [B, bk, Rkv] is up-projected once into [B, H, bk, Qn] no-RoPE keys and [B, H, bk, O] values,
  and the query blocks from the diagonal on fold it into their running row max, row sum and
  float32 output accumulator (FlashAttention's online softmax, arXiv:2205.14135 Alg. 1, with the
  loops swapped). The RoPE key stays [B, bk, Qr]: its scores are one product against all heads'
  RoPE queries, never broadcast to heads.
- backward (FlashAttention-2, arXiv:2307.08691 Alg. 2, key-block outer like blockwise.py): each
  key block is up-projected again, its dK and dV accumulated over the query blocks, and pulled
  back through the up-projection once: d latent block = dK_nope W_UK^T + dV W_UV^T, d RoPE key
  block = the sum over heads of dK's RoPE part (accumulated directly, [B, bk, Qr]), and
  d wkv_b += latent block^T [dK_nope, dV], a float32 [Rkv, H, Qn+O] carry.

Why key-outer in the forward too (blockwise.py's forward is query-outer): with query-outer loops
each query block would up-project every key block it visits, about nq/2 times per key block;
for DeepSeek-V3 dims (Rkv 512, Qn+O 256, Q 192, O 128) that up-projection costs as much as the
attention of a 512-row block pair, so the forward's FLOPs would nearly double. Key-outer, every
key block is up-projected exactly once per pass, the same up-projection FLOPs as the
up-project-then-attend path. The price: the running max, sum and output accumulator are held
for all local queries ([B, H, T, O] float32, the size of the backward's dQ buffer that
blockwise.py already holds) and read and written once per visited block pair instead of
staying in the loop's registers.

Temporaries: the gathered latent and RoPE key (O(S x (Rkv+Qr))), the local queries' float32
accumulators (O(T x H x (Q+O))), and one key block's keys and values (O(bk x H x (Q+O))).
Segment ids, positions and the causal skip follow blockwise.py (the same trip formulas).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from expertax.nn.attention import mask
from expertax.nn.attention.blockwise import (
    DEFAULT_BLOCK,
    MASKED_SCORE,
    PAD_POSITION,
    _to_blocks,
    _trips,
    balanced_block,
)
from expertax.nn.attention.mask import CAUSAL, MaskSpec
from expertax.nn.moe.vma import varying_alike, varying_like


class LatentBlocks(NamedTuple):
    """Inputs cut into blocks on a leading axis: queries [nq, B, H, bq, Qn+Qr], latent
    [nk, B, bk, Rkv], rotated RoPE key [nk, B, bk, Qr], `wkv_b` [Rkv, H, Qn+O], segment ids
    ([n, B, b] or None) and positions ([n, B|1, b])."""

    q: jax.Array
    latent: jax.Array
    rope: jax.Array
    wkv_b: jax.Array
    seg_q: jax.Array | None
    seg_k: jax.Array | None
    pos_q: jax.Array
    pos_k: jax.Array


def _up(latent_BSR, wkv_b_RHZ, nope: int):
    """One key block's no-RoPE keys [B, H, bk, Qn] and values [B, H, bk, O]."""
    kv_BHSZ = jnp.einsum("bsr,rhz->bhsz", latent_BSR, wkv_b_RHZ)
    return kv_BHSZ[..., :nope], kv_BHSZ[..., nope:]


def _scores(x: LatentBlocks, i, k_nope, rope_blk, seg_k_blk, pos_k_blk, nope, spec, scale):
    """Scaled float32 scores [B, H, bq, bk] of query block i against a key block, and the mask
    [B, 1, bq, bk] (True where the pair attends)."""
    q_blk = x.q[i]
    f32 = jnp.float32
    s = jnp.einsum("bhtq,bhsq->bhts", q_blk[..., :nope], k_nope, preferred_element_type=f32)
    s += jnp.einsum("bhtq,bsq->bhts", q_blk[..., nope:], rope_blk, preferred_element_type=f32)
    seg_q_blk = None if x.seg_q is None else x.seg_q[i]
    ok = mask.allowed(spec, x.pos_q[i], pos_k_blk, seg_q_blk, seg_k_blk)
    return s * jnp.float32(scale), ok[:, None]


def _zeros(shape, x: LatentBlocks, fill=0.0):
    """A float32 loop carry varying over the manual axes of any input (inside a `shard_map`,
    vma.py: a `while_loop` needs its carry's type to equal its body's output's)."""
    refs = [a for a in x if a is not None]
    return varying_like(jnp.full(shape, fill, jnp.float32), *refs)


def _key_xs(x: LatentBlocks):
    nk = x.latent.shape[0]
    return (jnp.arange(nk), x.latent, x.rope, x.seg_k, x.pos_k)


def init_carry(x: LatentBlocks):
    """The forward's running row max, row sum and output accumulator for all query blocks of
    `x`, before any key block: ([nq, B, H, bq], [nq, B, H, bq], [nq, B, H, bq, O]) float32."""
    nq, b, h, bq, _ = x.q.shape
    od = x.wkv_b.shape[-1] - (x.q.shape[-1] - x.rope.shape[-1])
    return (
        _zeros((nq, b, h, bq), x, MASKED_SCORE),
        _zeros((nq, b, h, bq), x),
        _zeros((nq, b, h, bq, od), x),
    )


def query_rows(offset, nq: int, bq: int):
    """`Rows` of contiguous queries whose row r sits at key row `offset` + r."""
    return offset + bq * jnp.arange(nq, dtype=jnp.int32), jnp.int32(0)


def _first_visible(j, rows, bq: int, bk: int):
    """The first query block that sees key block j: `rows` = (each query block's first row
    [nq], the key blocks' first row), on one axis of the sequence, the query blocks in
    increasing order (they need not be contiguous: a load-balanced device's two chunks). Every
    later block sees it too (training's positions do not decrease along a document, and a key
    of another document is masked either way); the blocks before end before its first key."""
    q_start, k_start = rows
    return jnp.sum(q_start + (bq - 1) < k_start + j * bk).astype(jnp.int32)


def forward_update(x: LatentBlocks, rows, scale, trips: str, spec, nope, carry):
    """`carry` (`init_carry`) with every key block of `x` folded in, each into the query blocks
    from the first that sees it on (`rows`, `_first_visible`); `trips` names the inner loop's
    mean trip count (`blockwise._trips`)."""
    nq, bq, bk = x.q.shape[0], x.q.shape[3], x.latent.shape[2]

    def one_key_block(carry, xs):
        j, lat_blk, rope_blk, seg_k_blk, pos_k_blk = xs
        k_nope, v_blk = _up(lat_blk, x.wkv_b, nope)

        def one_query_block(i, carry):
            m_N, l_N, acc_N = carry  # N: all query blocks
            s, ok = _scores(x, i, k_nope, rope_blk, seg_k_blk, pos_k_blk, nope, spec, scale)
            s = jnp.where(ok, s, MASKED_SCORE)
            m_new = jnp.maximum(m_N[i], s.max(-1))
            p = jnp.where(ok, jnp.exp(s - m_new[..., None]), 0.0)
            alpha = jnp.exp(m_N[i] - m_new)
            pv = jnp.einsum(
                "bhts,bhso->bhto", p.astype(v_blk.dtype), v_blk, preferred_element_type=jnp.float32
            )
            return (
                m_N.at[i].set(m_new),
                l_N.at[i].set(alpha * l_N[i] + p.sum(-1)),
                acc_N.at[i].set(alpha[..., None] * acc_N[i] + pv),
            )

        first = _first_visible(j, rows, bq, bk)
        with jax.named_scope(trips):
            carry = jax.lax.fori_loop(first, nq, one_query_block, carry)
        return carry, None

    return jax.lax.scan(one_key_block, carry, _key_xs(x))[0]


def finish(carry, dtype):
    """-> (out [nq, B, H, bq, O] in `dtype`, lse [nq, B, H, bq] float32) from a final carry."""
    m, row_sum, acc = carry
    # a row that reads no key (a padding row of the last block) gives 0, not 0 / 0
    row_sum = jnp.where(row_sum > 0, row_sum, 1.0)
    return (acc / row_sum[..., None]).astype(dtype), m + jnp.log(row_sum)


def causal_trips(x: LatentBlocks, hint: int) -> str:
    """The inner loops' `trips~N` scope for key blocks of `x` against its queries at key row
    offset `hint` (the mean offset where it is only known on the device)."""
    nq, bq = x.q.shape[0], x.q.shape[3]
    nk, bk = x.latent.shape[0], x.latent.shape[2]
    visits = sum(nq - max(0, (n * bk - hint) // bq) for n in range(nk))
    return _trips(visits, nk)


def _forward(x: LatentBlocks, offset, scale, hint, spec, nope):
    """-> (out [nq, B, H, bq, O] in the latent's dtype, lse [nq, B, H, bq] float32)."""
    rows = query_rows(offset, x.q.shape[0], x.q.shape[3])
    carry = forward_update(x, rows, scale, causal_trips(x, hint), spec, nope, init_carry(x))
    return finish(carry, x.latent.dtype)


def backward_update(x: LatentBlocks, rows, scale, trips: str, spec, nope, lse, delta, d_out,
                    dq_acc, dw_RHZ, out_dtype):  # fmt: skip
    """FlashAttention-2's backward over every key block of `x` (each against the query blocks
    that see it, `rows` as in `forward_update`), pulled back through the block's
    up-projection (module docstring): -> (dq_acc + the queries' float32 gradient, dw_RHZ + the
    float32 `wkv_b` gradient, d latent [nk, B, bk, Rkv] and d RoPE key [nk, B, bk, Qr] in
    `out_dtype`). `lse`, `delta` (the rows' sum of d_out * out) and `d_out` are the queries'."""
    nq, bq, bk = x.q.shape[0], x.q.shape[3], x.latent.shape[2]

    def one_key_block(carry, xs):
        dq_acc, dw_RHZ = carry
        j, lat_blk, rope_blk, seg_k_blk, pos_k_blk = xs
        k_nope, v_blk = _up(lat_blk, x.wkv_b, nope)

        def one_query_block(i, carry):
            dq_acc, dk_BHSN, d_rope_BSQ, dv_BHSO = carry
            q_blk, do_blk = x.q[i], d_out[i]
            s, ok = _scores(x, i, k_nope, rope_blk, seg_k_blk, pos_k_blk, nope, spec, scale)
            p = jnp.where(ok, jnp.exp(s - lse[i][..., None]), 0.0)
            f32 = jnp.float32
            dv_BHSO += jnp.einsum(
                "bhts,bhto->bhso", p.astype(do_blk.dtype), do_blk, preferred_element_type=f32
            )
            dp = jnp.einsum("bhto,bhso->bhts", do_blk, v_blk, preferred_element_type=f32)
            ds = (p * (dp - delta[i][..., None]) * f32(scale)).astype(q_blk.dtype)
            dk_BHSN += jnp.einsum(
                "bhts,bhtq->bhsq", ds, q_blk[..., :nope], preferred_element_type=f32
            )
            d_rope_BSQ += jnp.einsum(
                "bhts,bhtq->bsq", ds, q_blk[..., nope:], preferred_element_type=f32
            )
            dq = jnp.concatenate(
                [
                    jnp.einsum("bhts,bhsq->bhtq", ds, k_nope, preferred_element_type=f32),
                    jnp.einsum("bhts,bsq->bhtq", ds, rope_blk, preferred_element_type=f32),
                ],
                -1,
            )
            return dq_acc.at[i].add(dq), dk_BHSN, d_rope_BSQ, dv_BHSO

        init = (dq_acc, _zeros(k_nope.shape, x), _zeros(rope_blk.shape, x), _zeros(v_blk.shape, x))
        first = _first_visible(j, rows, bq, bk)
        with jax.named_scope(trips):
            dq_acc, dk, d_rope, dv = jax.lax.fori_loop(first, nq, one_query_block, init)
        # the block's up-projection, pulled back: [dK_nope, dV] against latent and wkv_b
        dkv_BHSZ = jnp.concatenate([dk, dv], -1).astype(lat_blk.dtype)
        d_lat = jnp.einsum("bhsz,rhz->bsr", dkv_BHSZ, x.wkv_b, preferred_element_type=jnp.float32)
        dw_RHZ += jnp.einsum("bsr,bhsz->rhz", lat_blk, dkv_BHSZ, preferred_element_type=jnp.float32)
        return (dq_acc, dw_RHZ), (d_lat.astype(out_dtype), d_rope.astype(out_dtype))

    (dq_acc, dw_RHZ), (d_lat, d_rope) = jax.lax.scan(one_key_block, (dq_acc, dw_RHZ), _key_xs(x))
    return dq_acc, dw_RHZ, d_lat, d_rope


def row_delta(d_out, out):
    """FlashAttention-2's D: the rows' sum of d_out * out, float32 [..., B, H, bq]."""
    return jnp.einsum("...bhto,...bhto->...bht", d_out, out, preferred_element_type=jnp.float32)


def _backward(scale, hint, spec, nope, res, d_out):
    """FlashAttention-2's backward per key block, pulled back through the block's up-projection
    (module docstring)."""
    x, offset, out, lse = res
    rows = query_rows(offset, x.q.shape[0], x.q.shape[3])
    dq, dw, d_lat, d_rope = backward_update(
        x, rows, scale, causal_trips(x, hint), spec, nope, lse, row_delta(d_out, out), d_out,
        _zeros(x.q.shape, x), _zeros(x.wkv_b.shape, x), x.latent.dtype,
    )  # fmt: skip
    grads = LatentBlocks(
        dq.astype(x.q.dtype), d_lat, d_rope, dw.astype(x.wkv_b.dtype), None, None, None, None
    )
    return grads, None


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def _latent_attention(x, offset, scale, hint, spec, nope):
    """Attention over `LatentBlocks`: the output blocks [nq, B, H, bq, O]."""
    return _forward(x, offset, scale, hint, spec, nope)[0]


def _latent_attention_fwd(x, offset, scale, hint, spec, nope):
    out, lse = _forward(x, offset, scale, hint, spec, nope)
    return out, (x, offset, out, lse)


_latent_attention.defvjp(_latent_attention_fwd, _backward)


def attend_latent_blockwise(
    q_BTHQ: jax.Array,
    latent_BSR: jax.Array,
    k_rope_BSQ: jax.Array,
    wkv_b_RHZ: jax.Array,
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
) -> jax.Array:
    """MLA attention of queries [B, T, H, Qn+Qr] (RoPE applied to their last Qr dims) against
    the keys and values of the normed latent [B, S, Rkv] and rotated RoPE key [B, S, Qr] under
    `wkv_b` [Rkv, H, Qn+O] (no-RoPE key half first, mla.py); returns [B, T, H, O] in the
    latent's dtype. Equal to `attend_blockwise` on the up-projected keys and values; the other
    arguments are its (queries from key row `q_offset` on, by default S - T; segment ids the
    keys' [B, S]; positions [B|1, T] and [B|1, S]; `mask_spec` causal)."""
    if block_q <= 0 or block_k <= 0:
        raise ValueError(f"block_q={block_q}, block_k={block_k}: blocks must be positive")
    if (why := mask.unsupported(mask_spec, "blockwise")) is not None:
        raise ValueError(why)
    b, t, h, qd = q_BTHQ.shape
    s, qr = latent_BSR.shape[1], k_rope_BSQ.shape[-1]
    nope, od = qd - qr, wkv_b_RHZ.shape[-1] - (qd - qr)
    if wkv_b_RHZ.shape[:2] != (latent_BSR.shape[-1], h) or od <= 0:
        raise ValueError(
            f"latent attention: wkv_b {wkv_b_RHZ.shape} does not fit latent {latent_BSR.shape}, "
            f"queries {q_BTHQ.shape} and RoPE key {k_rope_BSQ.shape} ([Rkv, H, Qn+O])"
        )
    offset = s - t if q_offset is None else q_offset
    hint = s - t if q_offset is None else round(mean_q_offset)
    bq, bk = balanced_block(t, block_q), balanced_block(s, block_k)
    # inside a shard_map every float input varies over the manual axes any of them does (the
    # weights are replicated; the heads' split over `tensor` leaves the latent every head's), so
    # that the custom VJP's cotangents may too; the pcasts' transposes sum them over those axes
    q_BTHQ, latent_BSR, k_rope_BSQ, wkv_b_RHZ = varying_alike(
        q_BTHQ, latent_BSR, k_rope_BSQ, wkv_b_RHZ
    )
    q_blocks = jnp.moveaxis(_to_blocks(q_BTHQ, bq), 2, 3)  # [nq, B, H, bq, Q]
    seg_q_blocks = seg_k_blocks = None
    if segment_ids_BT is not None:
        seg_q = jax.lax.dynamic_slice_in_dim(segment_ids_BT, offset, t, axis=1)
        seg_q_blocks = _to_blocks(seg_q, bq, pad_value=-1)
        seg_k_blocks = _to_blocks(segment_ids_BT, bk, pad_value=-1)
    if q_positions_BT is None:
        q_positions_BT = offset + jax.lax.broadcasted_iota(jnp.int32, (1, t), 1)
    if kv_positions_BS is None:
        kv_positions_BS = jax.lax.broadcasted_iota(jnp.int32, (1, s), 1)
    x = LatentBlocks(
        q_blocks,
        _to_blocks(latent_BSR, bk),  # [nk, B, bk, Rkv]
        _to_blocks(k_rope_BSQ, bk),  # [nk, B, bk, Qr]
        wkv_b_RHZ,
        seg_q_blocks,
        seg_k_blocks,
        _to_blocks(q_positions_BT.astype(jnp.int32), bq),
        # a padding key sits after every query: the causal mask hides it
        _to_blocks(kv_positions_BS.astype(jnp.int32), bk, pad_value=PAD_POSITION),
    )
    out = _latent_attention(x, jnp.asarray(offset, jnp.int32), scale, hint, mask_spec, nope)
    out_BTHO = jnp.moveaxis(out, (0, 3), (1, 2)).reshape(b, -1, h, od)
    return out_BTHO[:, :t]
