"""Attention over a KV cache: GQA, and MLA with its compressed (absorbed) or plain cache.

A step takes T new tokens per sequence (the whole padded prompt at prefill, one or two tokens at
decode), writes their keys/values into the cache at slots start_b .. start_b + T - 1, and lets
each query read the slots up to its own position (decoding/cache.py). Scores and softmax are in
float32, the probabilities cast to `dtype` before the value product, as training's `dot`
attention (nn/attention/kernel.py).

MLA compressed (DeepSeek-V2 Sec. 2.1.3): with W_UK, W_UV the key and value halves of `wkv_b`
[Rkv, H, Qn+O], q_nope . (W_UK c_j) = (W_UK^T q_nope) . c_j and sum_j p_j W_UV c_j =
W_UV (sum_j p_j c_j), so the cache holds only the latent c_j [Rkv] and the shared RoPE key
[Qr]: the queries are taken into the latent space once per step, and the attention output
leaves it once per step, instead of expanding every cached token to H heads.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from expertax.config.schema import Config
from expertax.decoding import joint, rowdot
from expertax.decoding.cache import LayerCache, constrain_layer, visible, write
from expertax.decoding.rowdot import project
from expertax.nn import norm, rope
from expertax.nn.attention import gqa, mla
from expertax.nn.attention.blockwise import MASKED_SCORE
from expertax.sharding import constrain

F32 = jnp.float32


class Absorbed(NamedTuple):
    """MLA's `wkv_b` [Rkv, H, Qn+O] as decoding holds it (decoding/weights.py): its key half as
    `uk` [H, Qn, Rkv] and its value half as `uv` [H, Rkv, O], the layouts of the absorbed
    products. Sliced from `wkv_b` inside the step, each half is a strided copy per layer and
    step (XLA's batched matmul wants the head axis first): measured on deepseek3-small, 24
    copies of 1 MiB in every decode step."""

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


def step(p, x_BTD, c: Config, positions_BT, start_B, lc: LayerCache, dtype, form: str, slots=None):
    """Attention output [B, T, D] of the new tokens and the updated layer cache. `slots`
    (static): the queries read only the first `slots` slots (a prefill: the prompt's), else
    all."""
    if c.attention_type == "mla":
        return _mla(p, x_BTD, c, positions_BT, start_B, lc, dtype, form, slots)
    return _gqa(p, x_BTD, c, positions_BT, start_B, lc, dtype, slots)


def _read(lc: LayerCache, slots) -> LayerCache:
    return lc if slots is None else LayerCache(lc.k[:, :slots], lc.v[:, :slots])


def _softmax(scores, mask_B1TS, dtype):
    scores = jnp.where(mask_B1TS, scores, MASKED_SCORE)
    return jax.nn.softmax(scores, axis=-1).astype(dtype)


def _attend_heads(q_BTHQ, k_BSGQ, v_BSGO, positions_BT, scale: float):
    """Queries [B, T, H, Q] over cached keys/values with G <= H heads (J = H/G per group)."""
    b, t, h, q = q_BTHQ.shape
    s, g = k_BSGQ.shape[1], k_BSGQ.shape[2]
    q_BTGJQ = q_BTHQ.reshape(b, t, g, h // g, q)
    scores = jnp.einsum("btgjq,bsgq->bgjts", q_BTGJQ, k_BSGQ, preferred_element_type=F32)
    mask = visible(positions_BT, s)[:, :, None]  # [B, 1, 1, T, S]
    probs = _softmax(scores * F32(scale), mask, v_BSGO.dtype)
    out = jnp.einsum("bgjts,bsgo->btgjo", probs, v_BSGO)
    return out.reshape(b, t, h, v_BSGO.shape[-1])


def _gqa(p: gqa.GQA, x_BTD, c: Config, positions_BT, start_B, lc: LayerCache, dtype, slots):
    q = project(x_BTD, p.wq.astype(dtype))
    k = project(x_BTD, p.wk.astype(dtype))
    v = project(x_BTD, p.wv.astype(dtype))
    cos, sin = rope.cos_sin(c, positions_BT, c.head_dim)
    q = constrain(rope.apply(q, cos, sin), ("batch", "length", "act_heads", None))
    k = rope.apply(k, cos, sin)
    lc = constrain_layer(LayerCache(write(lc.k, k, start_B), write(lc.v, v, start_B)), c)
    seen = _read(lc, slots)
    out = _attend_heads(q, seen.k, seen.v, positions_BT, rope.softmax_scale(c))
    return project(out, p.wo.astype(dtype), 2), lc


def _down_projections(p: mla.MLA, x_BTD, c: Config, dtype):
    """(per-head queries [B, T, H, Qn+Qr] before RoPE, `wkv_a`'s output [B, T, Rkv+Qr]); with
    `wq_a` and `wkv_a` joined (decoding/joint.py), one product for both."""
    if not joint.is_joint(p.wq_a):
        return mla.queries(p, x_BTD, c, dtype), project(x_BTD, p.wkv_a.astype(dtype))
    both = project(x_BTD, p.wq_a.w.astype(dtype))
    low_BTR = norm.rms_norm(p.q_norm, both[..., : c.q_lora_rank], c.normalization_layer_epsilon)
    return project(low_BTR, p.wq_b.astype(dtype)), both[..., c.q_lora_rank :]


def _mla(p: mla.MLA, x_BTD, c: Config, positions_BT, start_B, lc, dtype, form: str, slots):
    nope, rdim, r = c.qk_nope_head_dim, c.qk_rope_head_dim, c.kv_lora_rank
    q_BTHQ, kv_a = _down_projections(p, x_BTD, c, dtype)
    q_BTHQ = constrain(q_BTHQ, ("batch", "length", "act_heads", None))
    latent_BTR = norm.rms_norm(p.kv_norm, kv_a[..., :r], c.normalization_layer_epsilon)
    cos, sin = rope.cos_sin(c, positions_BT, rdim)
    q_rope = rope.apply(q_BTHQ[..., nope:], cos, sin)
    k_rope_BTQ = rope.apply(kv_a[..., None, r:], cos, sin)[:, :, 0]
    uk_HNR, uv_HRO = p.wkv_b.uk.astype(dtype), p.wkv_b.uv.astype(dtype)  # decoding/weights.py
    scale = rope.softmax_scale(c)
    if form == "plain":
        wkv_b = jnp.concatenate([uk_HNR.transpose(2, 0, 1), uv_HRO.transpose(1, 0, 2)], -1)
        kv_BTHZ = project(latent_BTR, wkv_b)  # [Rkv, H, Qn+O]
        h = kv_BTHZ.shape[2]
        k_rope_BTHQ = jnp.broadcast_to(k_rope_BTQ[:, :, None], (*k_rope_BTQ.shape[:2], h, rdim))
        k = jnp.concatenate([kv_BTHZ[..., :nope], k_rope_BTHQ], -1)
        lc = LayerCache(write(lc.k, k, start_B), write(lc.v, kv_BTHZ[..., nope:], start_B))
        lc = constrain_layer(lc, c)
        q = jnp.concatenate([q_BTHQ[..., :nope], q_rope], -1)
        seen = _read(lc, slots)
        out = _attend_heads(q, seen.k, seen.v, positions_BT, scale)
        return project(out, p.wo.astype(dtype), 2), lc

    lc = LayerCache(write(lc.k, latent_BTR, start_B), write(lc.v, k_rope_BTQ, start_B))
    lc = constrain_layer(lc, c)
    # The queries in latent space: W_UK^T q_nope per head, [B, T, H, Rkv].
    q_lat = _per_head(q_BTHQ[..., :nope], uk_HNR, F32)
    seen = _read(lc, slots)
    scores = jnp.einsum("bthr,bsr->bhts", q_lat.astype(dtype), seen.k, preferred_element_type=F32)
    scores += jnp.einsum("bthq,bsq->bhts", q_rope, seen.v, preferred_element_type=F32)
    probs_BHTS = _softmax(scores * F32(scale), visible(positions_BT, seen.k.shape[1]), dtype)
    b, h, t, s = probs_BHTS.shape
    out_lat = jnp.einsum(
        "bms,bsr->bmr", probs_BHTS.reshape(b, h * t, s), seen.k, preferred_element_type=F32
    )
    out_lat_BTHR = out_lat.reshape(b, h, t, -1).transpose(0, 2, 1, 3)
    out_BTHO = _per_head(out_lat_BTHR.astype(dtype), uv_HRO, None)
    return project(out_BTHO, p.wo.astype(dtype), 2), lc


def _per_head(x_BTHI, w_HIO, preferred):
    """[B, T, H, I] x [H, I, O] -> [B, T, H, O], one matrix product per head over the B x T
    rows, the heads leading: XLA:CPU runs the batched product with the heads as its batch and
    canonical row-major operands in one library call, where the same einsum with the heads in
    the middle took 3-4 x longer at 8 rows (deepseek3-small, batch 8: 0.36 -> 0.10 ms)."""
    b, t, h, i = x_BTHI.shape
    x_HMI = x_BTHI.reshape(b * t, h, i).transpose(1, 0, 2)
    y_HMO = rowdot.per_group(x_HMI, w_HIO)  # our CPU kernel where it applies
    if y_HMO is None:
        y_HMO = jnp.einsum("hmi,hio->hmo", x_HMI, w_HIO, preferred_element_type=preferred)
    return y_HMO.transpose(1, 0, 2).reshape(b, t, h, -1)
