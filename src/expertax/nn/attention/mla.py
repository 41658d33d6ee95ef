"""Multi-head Latent Attention (DeepSeek-V2/V3, arXiv:2405.04434 Sec. 2.1).

Queries: x @ wq_a -> RMSNorm -> @ wq_b (or a plain wq when q_lora_rank is 0), split per head into
a no-RoPE part [Qn] and a RoPE part [Qr] (Q = Qn+Qr). Keys/values: x @ wkv_a -> split into the
latent [R] and a single RoPE key [Qr] shared by all heads; the latent is normed and expanded by
wkv_b into per-head no-RoPE keys [Qn] and values [O]. Z: a concatenated width ([Rkv+Qr], [Qn+O]).

With a cache (decoding, cache.py), in either form: `KV` holds the per-head keys and values as
training computes them; `Latent` holds only the latent and the rotated RoPE key, and `wkv_b` is
absorbed (DeepSeek-V2 Sec. 2.1.3): with W_UK, W_UV its key and value halves, q_nope . (W_UK c_j)
= (W_UK^T q_nope) . c_j and sum_j p_j W_UV c_j = W_UV (sum_j p_j c_j), so the queries are taken
into the latent space once per step and the output leaves it once per step, instead of expanding
every cached token to H heads. Decoding may hold `wkv_b` as its two halves (`Absorbed`) and
`wq_a` joined with `wkv_a` (`linear.Joint`: one product of the layer input).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from expertax.config.schema import Config
from expertax.nn import norm, rope
from expertax.nn.attention import chunks, context, kernel, latent_blockwise, qk_clip
from expertax.nn.attention.cache import KV, Latent, constrain_layer, slot_positions, write
from expertax.nn.linear import is_joint, per_head, project
from expertax.nn.param import Param, params_dataclass, projection
from expertax.parallel import remat
from expertax.sharding import constrain

# the low-rank activations' layout: tokens split like the layer input, the rank dim whole
LOW_RANK_BTR = ("batch", "length", None)


@params_dataclass
class MLA:
    wq: Param  # [D, H, Qn+Qr] when q_lora_rank == 0; None when absent
    wq_a: Param  # [D, Rq]; None when absent
    q_norm: Param  # [Rq]; None when absent
    wq_b: Param  # [Rq, H, Qn+Qr]; None when absent
    wkv_a: Param  # [D, Rkv+Qr]
    kv_norm: Param  # [Rkv]
    wkv_b: Param  # [Rkv, H, Qn+O]
    wo: Param  # [H, O, D]


def spec(c: Config) -> MLA:
    d, h = c.base_emb_dim, c.base_num_query_heads
    qk, rq, rkv = c.qk_head_dim, c.q_lora_rank, c.kv_lora_rank
    low_rank_q = rq > 0
    return MLA(
        wq=None if low_rank_q else projection((d, h, qk), ("embed", "heads", "kv"), d),
        wq_a=projection((d, rq), ("embed", "q_lora"), d) if low_rank_q else None,
        q_norm=norm.spec(rq, "q_lora") if low_rank_q else None,
        wq_b=projection((rq, h, qk), ("q_lora", "heads", "kv"), rq) if low_rank_q else None,
        wkv_a=projection((d, rkv + c.qk_rope_head_dim), ("embed", "kv_lora"), d),
        kv_norm=norm.spec(rkv, "kv_lora"),
        wkv_b=projection(
            (rkv, h, c.qk_nope_head_dim + c.v_head_dim), ("kv_lora", "heads", "kv"), rkv
        ),
        wo=projection((h, c.v_head_dim, d), ("heads", "kv", "embed"), h * c.v_head_dim),
    )


class Absorbed(NamedTuple):
    """`wkv_b` [Rkv, H, Qn+O] as its key half `uk` [H, Qn, Rkv] and value half `uv` [H, Rkv, O],
    the layouts of the absorbed products (decoding/weights.py holds it so: sliced inside the
    step, each half is a strided copy per layer and step, XLA's batched matmul wanting the head
    axis first; measured on deepseek3-small, 24 copies of 1 MiB in every decode step)."""

    uk: Any
    uv: Any


def absorb(wkv_b_RHZ, nope: int) -> Absorbed:
    return Absorbed(
        jnp.transpose(wkv_b_RHZ[..., :nope], (1, 2, 0)),
        jnp.transpose(wkv_b_RHZ[..., nope:], (1, 0, 2)),
    )


def absorb_spec(spec, nope: int) -> Absorbed:
    """`absorb`'s parameter declarations (shapes and logical axes) for `wkv_b`'s spec."""
    (r, h, z), (ar, ah, az) = spec.shape, spec.axes
    return Absorbed(
        dataclasses.replace(spec, shape=(h, nope, r), axes=(ah, az, ar)),
        dataclasses.replace(spec, shape=(h, r, z - nope), axes=(ah, ar, az)),
    )


def _halves(wkv_b, nope: int, dtype) -> Absorbed:
    """`wkv_b`'s absorbed halves in `dtype`, however it is held."""
    halves = wkv_b if isinstance(wkv_b, Absorbed) else absorb(wkv_b, nope)
    return Absorbed(halves.uk.astype(dtype), halves.uv.astype(dtype))


def _whole(wkv_b, dtype) -> jax.Array:
    """`wkv_b` [Rkv, H, Qn+O] in `dtype`, however it is held."""
    if not isinstance(wkv_b, Absorbed):
        return wkv_b.astype(dtype)
    uk_HNR, uv_HRO = wkv_b.uk.astype(dtype), wkv_b.uv.astype(dtype)
    return jnp.concatenate([uk_HNR.transpose(2, 0, 1), uv_HRO.transpose(1, 0, 2)], -1)


def queries(p: MLA, x_BTD, c: Config, dtype) -> jax.Array:
    """Per-head queries [B, T, H, Qn+Qr] before RoPE (the low-rank path when q_lora_rank > 0)."""
    if p.wq is not None:
        return project(x_BTD, p.wq.astype(dtype))
    low_BTR = remat.tag(project(x_BTD, p.wq_a.astype(dtype)), remat.QUERY_WA_PROJ)
    # tokens split like x, the low-rank dim whole: else the partitioner may split it over the
    # axes that store wq_b (q_lora: fsdp, context, ...) and reshard x's tokens to match
    low_BTR = constrain(low_BTR, LOW_RANK_BTR)
    low_BTR = norm.rms_norm(p.q_norm, low_BTR, c.normalization_layer_epsilon)
    return project(low_BTR, p.wq_b.astype(dtype))


def _down(p: MLA, x_BTD, c: Config, dtype):
    """(per-head queries [B, T, H, Qn+Qr] before RoPE, `wkv_a`'s output [B, T, Rkv+Qr]); with
    `wq_a` and `wkv_a` joined, one product for both."""
    if not is_joint(p.wq_a):
        return queries(p, x_BTD, c, dtype), project(x_BTD, p.wkv_a.astype(dtype))
    both = project(x_BTD, p.wq_a.w.astype(dtype))
    low_BTR = norm.rms_norm(p.q_norm, both[..., : c.q_lora_rank], c.normalization_layer_epsilon)
    return project(low_BTR, p.wq_b.astype(dtype)), both[..., c.q_lora_rank :]


def apply(p: MLA, x_BTD, c: Config, positions_BT, segment_ids_BT, dtype, cache=None, qk_probe=None):
    """The layer's output [B, T, D] and its cache (None without one; with one, the new
    tokens' entries written at their positions and every slot read: cache.py). `qk_probe`
    (float32 zeros [H], `use_qk_clip`): its gradient becomes each head's largest logit
    (qk_clip.py)."""
    if cache is not None:
        return _cached(p, x_BTD, c, positions_BT, dtype, cache)
    t = x_BTD.shape[1]
    nope, rdim = c.qk_nope_head_dim, c.qk_rope_head_dim
    kv_a = constrain(
        remat.tag(project(x_BTD, p.wkv_a.astype(dtype)), remat.KV_WA_PROJ), LOW_RANK_BTR
    )
    latent_BTR, k_rope_BTQ = kv_a[..., : c.kv_lora_rank], kv_a[..., c.kv_lora_rank :]
    latent_BTR = norm.rms_norm(p.kv_norm, latent_BTR, c.normalization_layer_epsilon)
    if context.size() > 1:
        return _context_parallel(p, x_BTD, c, positions_BT, segment_ids_BT, dtype, kv_a, latent_BTR)
    kv_BTHZ = remat.tag(  # Z = Qn+O: no-RoPE keys, then values
        project(latent_BTR, p.wkv_b.astype(dtype)), remat.MLA_KV
    )
    k_nope, v_BTHO = kv_BTHZ[..., :nope], kv_BTHZ[..., nope:]
    cos, sin = rope.cos_sin(c, positions_BT, rdim)
    k_rope = rope.apply(k_rope_BTQ[:, :, None, :], cos, sin)
    h = k_nope.shape[2]
    k_rope_BTHQ = jnp.broadcast_to(k_rope, (*k_rope.shape[:2], h, rdim))
    k = remat.tag(jnp.concatenate([k_nope, k_rope_BTHQ], -1), remat.KEY_PROJ)
    v = remat.tag(v_BTHO, remat.VALUE_PROJ)
    k = constrain(k, ("batch", "length", "act_heads", None))

    kv_positions_BS = positions_BT

    def queries_out(x_BTD, positions_BT, q_offset, end):  # a chunk's queries (chunks.py)
        q = _queries_roped(p, x_BTD, c, positions_BT, dtype)
        scale = rope.softmax_scale(c)
        out = chunks.attend_chunk(
            q, k, v, c, segment_ids_BT, q_offset, end, scale, positions_BT, kv_positions_BS
        )
        if qk_probe is not None:  # one chunk (config/checks/run.py): the whole sequence
            top_H = qk_clip.max_logits(q, k, scale, positions_BT, segment_ids_BT)
            out = qk_clip.emit(out, qk_probe, top_H)
        return project(remat.tag(out, remat.ATTENTION_OUT), p.wo.astype(dtype), 2)

    scan = chunks.scanned(c, t, c.qk_head_dim, c.v_head_dim, dtype)
    out = chunks.over_queries(queries_out, x_BTD, positions_BT, c, scan=scan)
    # named here, not inside a chunk: a name inside a chunk's checkpoint is saved by the
    # chunk, on device, whatever its placement
    return remat.tag(out, remat.OUT_PROJ), None


def _queries_roped(p: MLA, x_BTD, c: Config, positions_BT, dtype) -> jax.Array:
    """Per-head queries [B, T, H, Qn+Qr] with RoPE on their last Qr dims."""
    nope, rdim = c.qk_nope_head_dim, c.qk_rope_head_dim
    q_BTHQ = remat.tag(queries(p, x_BTD, c, dtype), remat.MLA_Q)
    cos, sin = rope.cos_sin(c, positions_BT, rdim)
    q_rope = rope.apply(q_BTHQ[..., nope:], cos, sin)
    q = remat.tag(jnp.concatenate([q_BTHQ[..., :nope], q_rope], -1), remat.QUERY_PROJ)
    return constrain(q, ("batch", "length", "act_heads", None))


def _context_parallel(p: MLA, x_BTD, c: Config, positions_BT, segment_ids_BT, dtype, kv_a,
                      latent_BTR):  # fmt: skip
    """The layer under context parallelism (context.py): the normed latent [B, T, Rkv] and the
    rotated RoPE key [B, T, Qr] are what crosses devices; each device up-projects the gathered
    latent by `wkv_b` into its keys and values, the whole sequence at once for `dot`, one key
    block at a time inside the loops for `blockwise` (latent_blockwise.py)."""
    rdim = c.qk_rope_head_dim
    cos, sin = rope.cos_sin(c, positions_BT, rdim)
    k_rope_BTQ = rope.apply(kv_a[..., None, c.kv_lora_rank :], cos, sin)[:, :, 0]
    q = _queries_roped(p, x_BTD, c, positions_BT, dtype)
    # gathered whole (over its kv_lora shards) before the shard_map, which takes it so
    wkv_b_RHZ = constrain(p.wkv_b.astype(dtype), (None, "act_heads", None), replicated=True)
    out = context_attend(
        q, latent_BTR, k_rope_BTQ, wkv_b_RHZ, c, positions_BT=positions_BT,
        segment_ids_BT=segment_ids_BT, scale=rope.softmax_scale(c),
    )  # fmt: skip
    out = project(remat.tag(out, remat.ATTENTION_OUT), p.wo.astype(dtype), 2)
    return remat.tag(out, remat.OUT_PROJ), None


def context_attend(q_BTHQ, latent_BTR, k_rope_BTQ, wkv_b_RHZ, c: Config, *, positions_BT,
                   segment_ids_BT, scale: float, fused: bool = True) -> jax.Array:  # fmt: skip
    """MLA's attention under context parallelism: roped queries [B, T, H, Qn+Qr], the normed
    latent [B, T, Rkv] and rotated RoPE key [B, T, Qr] (global shapes, T split over `context`)
    and `wkv_b` [Rkv, H, Qn+O] -> [B, T, H, O]. `dot` up-projects the whole gathered sequence;
    `blockwise` one key block at a time inside its loops (latent_blockwise.py), unless `fused`
    is off (benchmarks/context_parallel.py compares the two)."""
    return context.attend(
        q_BTHQ, (latent_BTR, k_rope_BTQ), functools.partial(expand, c=c), wkv_b_RHZ, c,
        positions_BT=positions_BT, segment_ids_BT=segment_ids_BT, scale=scale,
        latent=attend_latent if fused else None,
    )  # fmt: skip


def expand(kv, wkv_b_RHZ, c: Config):
    """The gathered (latent [B, S, Rkv], rotated RoPE key [B, S, Qr]) up-projected by `wkv_b`:
    keys [B, S, H, Qn+Qr] and values [B, S, H, O] of the whole sequence."""
    nope, rdim = c.qk_nope_head_dim, c.qk_rope_head_dim
    latent_BSR, k_rope_BSQ = kv
    kv_BSHZ = project(latent_BSR, wkv_b_RHZ)
    h = kv_BSHZ.shape[2]
    k_rope_BSHQ = jnp.broadcast_to(k_rope_BSQ[:, :, None], (*k_rope_BSQ.shape[:2], h, rdim))
    return jnp.concatenate([kv_BSHZ[..., :nope], k_rope_BSHQ], -1), kv_BSHZ[..., nope:]


def attend_latent(q_BTHQ, kv, wkv_b_RHZ, **kernel_args) -> jax.Array:
    """The blockwise kernel on the gathered (latent, rotated RoPE key) and `wkv_b`."""
    latent_BSR, k_rope_BSQ = kv
    return latent_blockwise.attend_latent_blockwise(
        q_BTHQ, latent_BSR, k_rope_BSQ, wkv_b_RHZ, **kernel_args
    )


def _cached(p: MLA, x_BTD, c: Config, positions_BT, dtype, cache):
    nope, rdim, r = c.qk_nope_head_dim, c.qk_rope_head_dim, c.kv_lora_rank
    q_BTHQ, kv_a = _down(p, x_BTD, c, dtype)
    q_BTHQ = constrain(q_BTHQ, ("batch", "length", "act_heads", None))
    latent_BTR = norm.rms_norm(p.kv_norm, kv_a[..., :r], c.normalization_layer_epsilon)
    cos, sin = rope.cos_sin(c, positions_BT, rdim)
    q_rope = rope.apply(q_BTHQ[..., nope:], cos, sin)
    k_rope_BTQ = rope.apply(kv_a[..., None, r:], cos, sin)[:, :, 0]
    scale = rope.softmax_scale(c)
    if isinstance(cache, KV):
        kv_BTHZ = project(latent_BTR, _whole(p.wkv_b, dtype))  # [Rkv, H, Qn+O]
        h = kv_BTHZ.shape[2]
        k_rope_BTHQ = jnp.broadcast_to(k_rope_BTQ[:, :, None], (*k_rope_BTQ.shape[:2], h, rdim))
        k = jnp.concatenate([kv_BTHZ[..., :nope], k_rope_BTHQ], -1)
        cache = KV(
            write(cache.k, k, positions_BT), write(cache.v, kv_BTHZ[..., nope:], positions_BT)
        )
        cache = constrain_layer(cache, "act_heads")
        q = jnp.concatenate([q_BTHQ[..., :nope], q_rope], -1)
        out = kernel.attend_dot(
            q, cache.k, cache.v, scale=scale, q_positions_BT=positions_BT,
            kv_positions_BS=slot_positions(cache.k.shape[1]),
        )  # fmt: skip
        return project(out, p.wo.astype(dtype), 2), cache
    assert isinstance(cache, Latent), type(cache)
    latent = write(cache.latent, latent_BTR, positions_BT)
    cache = constrain_layer(Latent(latent, write(cache.rope_key, k_rope_BTQ, positions_BT)))
    uk_HNR, uv_HRO = _halves(p.wkv_b, nope, dtype)
    # The queries in latent space: W_UK^T q_nope per head, [B, T, H, Rkv]; against the cache
    # as one kv head (its latent and RoPE key as the keys' two parts, its latent as the values).
    q_lat = per_head(q_BTHQ[..., :nope], uk_HNR, jnp.float32).astype(dtype)
    latent_BS1R = cache.latent[:, :, None]
    out_lat_BTHR = kernel.attend_dot(
        (q_lat, q_rope), (latent_BS1R, cache.rope_key[:, :, None]), latent_BS1R, scale=scale,
        q_positions_BT=positions_BT, kv_positions_BS=slot_positions(cache.latent.shape[1]),
    )  # fmt: skip
    out_BTHO = per_head(out_lat_BTHR.astype(dtype), uv_HRO, None)
    return project(out_BTHO, p.wo.astype(dtype), 2), cache
