"""Ring MLA attention under context parallelism: the latent travels round the `context` axis.

`context_parallel_strategy=all_gather` (context.py) gathers the whole sequence's normed latent
and RoPE key on every device: 576 values per token for DeepSeek-V3, so a device's attention
temporaries grow with T at fixed tokens per device (the gathered latent, and in the backward its
float32 gradient, whole-sequence buffers). `ring` never holds more than two devices' share of
it: each device keeps its local key state (its `per` chunks of the sequence: 2 with load
balancing) and, for cp steps, attends its queries to the key state it holds, then passes that
state on to the next device (`ppermute`, i -> i + 1), so at step s it holds device (i - s)'s.
Torchtitan's and MaxText's ring attention rotate the up-projected keys and values; here the
payload is the latent (71x smaller for DeepSeek-V3), up-projected one key block at a time inside
latent_blockwise.py's loops.

- forward: per step and per (query chunk, held key chunk) pair, `latent_blockwise.forward_update`
  folds the key chunk into the query chunk's running row max, row sum and float32 accumulator;
  the causal skip comes from where the query blocks and the key chunk sit in the sequence: no
  query block is visited for a key chunk that comes later (its blocks are still up-projected),
  only the upper triangle of the same chunk; the mask inside visited blocks comes from positions
  and segment ids, as in the gathered kernel.
- backward (the ring again, FlashAttention-2 per pair, `backward_update`): the queries' gradient
  stays local; the held key chunk's latent and RoPE-key gradients accumulate in float32 buffers
  that travel with it, and one more `ppermute` after the last step brings them home (the
  state's first step was at home, its last one device behind). `wkv_b`'s gradient is local
  (summed over devices by the shard_map's transpose).

Per device the program holds its local tokens' state twice (the held copy and the one arriving)
plus the float32 gradient buffers: nothing scales with the sequence at fixed tokens per device.
Each ring step's transfer does not depend on that step's compute, so XLA may overlap the two.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from expertax.nn.attention import latent_blockwise as lb
from expertax.nn.attention import mask
from expertax.nn.attention.blockwise import (
    DEFAULT_BLOCK,
    PAD_POSITION,
    _to_blocks,
    _trips,
    balanced_block,
)
from expertax.nn.attention.mask import CAUSAL, MaskSpec
from expertax.nn.moe.vma import varying_alike, varying_like

CONTEXT = "context"  # the mesh axis (context.py takes it from here)


class Held(NamedTuple):
    """The key state that travels round the ring: [per, nk, B, bk, ...] latent, RoPE key,
    segment ids (or None) and positions."""

    latent: jax.Array
    rope: jax.Array
    seg_k: jax.Array | None
    pos_k: jax.Array


def _pair(x: lb.LatentBlocks, held: Held, m) -> lb.LatentBlocks:
    """The local queries (all their blocks) against held key chunk m (a traced index)."""
    seg_k = None if held.seg_k is None else held.seg_k[m]
    return lb.LatentBlocks(
        x.q, held.latent[m], held.rope[m], x.wkv_b, x.seg_q, seg_k, x.pos_q, held.pos_k[m]
    )


def _held(x: lb.LatentBlocks) -> Held:
    """The device's own key state, the first it holds."""
    return Held(x.latent, x.rope, x.seg_k, x.pos_k)


def _send(tree, cp: int):
    """Each device's `tree` to the next device on the ring (i -> i + 1)."""
    perm = [(i, (i + 1) % cp) for i in range(cp)]
    return jax.tree.map(lambda a: jax.lax.ppermute(a, CONTEXT, perm), tree)


def mean_trips(order: tuple[int, ...], per: int, nq: int, nk: int, bq: int, bk: int) -> str:
    """The inner loops' `trips~N` scope: query blocks visited per key block, averaged over the
    cp x per key chunks a device's ring visits (and over devices: without load balancing the
    last device visits the most). Per query chunk (nq blocks): nq for each key block of an
    earlier chunk, its triangle for its own chunk."""
    cp = len(order) // per
    diag = sum(nq - max(0, (j * bk) // bq) for j in range(nk))
    total = 0
    for device in range(cp):
        for n in range(per):
            earlier = order[device * per + n]  # the chunks before it in the sequence
            total += earlier * nq * nk + diag
    return _trips(total / cp, cp * per * nk)


def _ring_loop(x: lb.LatentBlocks, order, chunk, acc, chunk_step):
    """cp ring steps, each a loop over the `per` key chunks held: `chunk_step(acc, pair, rows,
    m) -> acc`, where `pair` is the local queries against held chunk m and `rows` where their
    blocks and the chunk sit in the sequence (`latent_blockwise.forward_update`); after each
    step the held key state, and the travelling part of `acc` (`acc[1]`), go to the next device.
    One loop nest for all steps and chunks, so XLA holds one pair's temporaries (the last step's
    transfer is not needed by the forward; it is what brings the backward's gradients home)."""
    cp = jax.lax.axis_size(CONTEXT)
    per = len(order) // cp
    nq, bq = x.q.shape[0] // per, x.q.shape[3]
    table = jnp.asarray(order, jnp.int32)
    me = jax.lax.axis_index(CONTEXT)
    mine = jnp.asarray([table[me * per + n] for n in range(per)])
    # each local query block's first row in the sequence (the device's chunks in increasing
    # order: chunk_order gives i before 2cp-1-i)
    q_start = (mine[:, None] * chunk + bq * jnp.arange(nq)[None]).reshape(-1)

    def one_step(state, s):
        (local, travelling), held = state
        src = (me - s) % cp  # whose key state this device holds at step s

        def one_chunk(acc, m):
            rows = (q_start, table[src * per + m] * chunk)
            # a key chunk after every local query visits no query block, but is still
            # up-projected: skipping it whole by a `cond` costs 257 MiB of copies of the
            # accumulators at 4,096 tokens per device (DeepSeek-V3 dims, compiled for TPU)
            return chunk_step(acc, _pair(x, held, m), rows, m), None

        (local, travelling), _ = jax.lax.scan(one_chunk, (local, travelling), jnp.arange(per))
        return ((local, _send(travelling, cp)), _send(held, cp)), None

    (acc, _), _ = jax.lax.scan(one_step, (acc, _held(x)), jnp.arange(cp))
    return acc


def _forward(x: lb.LatentBlocks, scale, spec, nope, order, chunk, trips):
    """-> (out [per x nq, B, H, bq, O], lse [per x nq, B, H, bq])."""

    def chunk_step(acc, pair, rows, m):
        carry, none = acc
        return lb.forward_update(pair, rows, scale, trips, spec, nope, carry), none

    init = lb.init_carry(_pair(x, _held(x), 0))
    carry, _ = _ring_loop(x, order, chunk, (init, ()), chunk_step)
    return lb.finish(carry, x.latent.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4, 5, 6))
def _ring(x, scale, spec, nope, order, chunk, trips):
    """Ring attention over `LatentBlocks` (queries [per x nq, ...], key state [per, nk, ...]):
    the output blocks [per x nq, B, H, bq, O]."""
    return _forward(x, scale, spec, nope, order, chunk, trips)[0]


def _ring_fwd(x, scale, spec, nope, order, chunk, trips):
    out, lse = _forward(x, scale, spec, nope, order, chunk, trips)
    return out, (x, out, lse)


def _ring_bwd(scale, spec, nope, order, chunk, trips, res, d_out):
    x, out, lse = res
    delta = lb.row_delta(d_out, out)
    f32 = jnp.float32

    def zeros(a):
        return varying_like(jnp.zeros(a.shape, f32), *(r for r in x if r is not None))

    def chunk_step(acc, pair, rows, m):
        (dq, dw), (d_lat, d_rope) = acc
        dq, dw, dl, dr = lb.backward_update(
            pair, rows, scale, trips, spec, nope, lse, delta, d_out, dq, dw, f32
        )
        return (dq, dw), (d_lat.at[m].add(dl), d_rope.at[m].add(dr))

    # the queries' and wkv_b's gradients stay; the held keys' travel with them, home at the end
    acc = ((zeros(x.q), zeros(x.wkv_b)), (zeros(x.latent), zeros(x.rope)))
    (dq, dw), (d_lat, d_rope) = _ring_loop(x, order, chunk, acc, chunk_step)
    grads = lb.LatentBlocks(
        dq.astype(x.q.dtype),
        d_lat.astype(x.latent.dtype),
        d_rope.astype(x.rope.dtype),
        dw.astype(x.wkv_b.dtype),
        None,
        None,
        None,
        None,
    )
    return (grads,)


_ring.defvjp(_ring_fwd, _ring_bwd)


def attend_latent_ring(
    q_BTHQ: jax.Array,
    latent_BTR: jax.Array,
    k_rope_BTQ: jax.Array,
    wkv_b_RHZ: jax.Array,
    *,
    order: tuple[int, ...],
    scale: float,
    positions_BT: jax.Array,
    segment_ids_BT: jax.Array | None = None,
    mask_spec: MaskSpec = CAUSAL,
    block_q: int = DEFAULT_BLOCK,
    block_k: int = DEFAULT_BLOCK,
) -> jax.Array:
    """MLA attention of a device's local queries [B, Tl, H, Qn+Qr] against the whole sequence,
    inside a `shard_map` manual over `context`: its local normed latent [B, Tl, Rkv], rotated RoPE
    key [B, Tl, Qr], positions and segment ids [B, Tl] are its chunks of the sequence, `order`
    every device's chunk indices one device after the other (context.chunk_order under load
    balancing: device i holds chunks i and 2cp-1-i; else range(cp)), and `wkv_b` [Rkv, H, Qn+O]
    up-projects the latent (latent_blockwise.py). -> [B, Tl, H, O] in the latent's dtype."""
    cp = jax.lax.axis_size(CONTEXT)
    per = len(order) // cp
    b, t, h, qd = q_BTHQ.shape
    qr = k_rope_BTQ.shape[-1]
    nope = qd - qr
    od = wkv_b_RHZ.shape[-1] - nope
    chunk = t // per
    bq, bk = balanced_block(chunk, block_q), balanced_block(chunk, block_k)
    if wkv_b_RHZ.shape[:2] != (latent_BTR.shape[-1], h) or od <= 0:
        raise ValueError(
            f"ring attention: wkv_b {wkv_b_RHZ.shape} does not fit latent {latent_BTR.shape}, "
            f"queries {q_BTHQ.shape} and RoPE key {k_rope_BTQ.shape} ([Rkv, H, Qn+O])"
        )
    if t % per or chunk % bq or chunk % bk:
        raise ValueError(
            f"ring attention: {t} local tokens in {per} chunk(s) do not split into whole "
            f"blocks of {bq} x {bk} rows"
        )
    if (why := mask.unsupported(mask_spec, "blockwise")) is not None:
        raise ValueError(why)
    # every float input varies over the manual axes any of them does (the heads' split over
    # `tensor`: the latent is every head's), so that the custom VJP's cotangents may too; the
    # pcasts' transposes sum them over those axes (d latent over the head shards)
    q_BTHQ, latent_BTR, k_rope_BTQ, wkv_b_RHZ = varying_alike(
        q_BTHQ, latent_BTR, k_rope_BTQ, wkv_b_RHZ
    )

    def cut(a, block, pad_value=0):  # [B, Tl, ...] -> [per, n, B, block, ...]
        parts = [jax.lax.slice_in_dim(a, n * chunk, (n + 1) * chunk, axis=1) for n in range(per)]
        return jnp.stack([_to_blocks(p, block, pad_value) for p in parts])

    def queries(a, pad_value=0):  # [B, Tl, ...] -> [per x nq, B, bq, ...]: whole blocks
        return _to_blocks(a, bq, pad_value)

    positions_BT = jnp.broadcast_to(positions_BT.astype(jnp.int32), (b, t))
    seg = segment_ids_BT
    x = lb.LatentBlocks(
        jnp.moveaxis(queries(q_BTHQ), 2, 3),  # [per x nq, B, H, bq, Q]
        cut(latent_BTR, bk),  # [per, nk, B, bk, Rkv]
        cut(k_rope_BTQ, bk),
        wkv_b_RHZ,
        None if seg is None else queries(seg, -1),
        None if seg is None else cut(seg, bk, -1),
        queries(positions_BT),
        cut(positions_BT, bk, PAD_POSITION),
    )
    trips = mean_trips(order, per, chunk // bq, chunk // bk, bq, bk)
    out = _ring(x, scale, mask_spec, nope, tuple(order), chunk, trips)  # [per x nq, B, H, bq, O]
    return jnp.moveaxis(out, (0, 3), (1, 2)).reshape(b, t, h, od)
