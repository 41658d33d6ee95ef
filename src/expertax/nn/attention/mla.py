"""Multi-head Latent Attention (DeepSeek-V2/V3, arXiv:2405.04434 Sec. 2.1).

Queries: x @ wq_a -> RMSNorm -> @ wq_b (or a plain wq when q_lora_rank is 0), split per head into
a no-RoPE part [Qn] and a RoPE part [Qr] (Q = Qn+Qr). Keys/values: x @ wkv_a -> split into the
latent [R] and a single RoPE key [Qr] shared by all heads; the latent is normed and expanded by
wkv_b into per-head no-RoPE keys [Qn] and values [O]. Z: a concatenated width ([Rkv+Qr], [Qn+O]).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from expertax.config.schema import Config
from expertax.nn import norm, rope
from expertax.nn.attention import chunks
from expertax.nn.linear import project
from expertax.nn.param import Param, params_dataclass, projection
from expertax.parallel import remat
from expertax.sharding import constrain


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


def queries(p: MLA, x_BTD, c: Config, dtype) -> jax.Array:
    """Per-head queries [B, T, H, Qn+Qr] before RoPE (the low-rank path when q_lora_rank > 0)."""
    if p.wq is not None:
        return project(x_BTD, p.wq.astype(dtype))
    low_BTR = remat.tag(project(x_BTD, p.wq_a.astype(dtype)), remat.QUERY_WA_PROJ)
    low_BTR = norm.rms_norm(p.q_norm, low_BTR, c.normalization_layer_epsilon)
    return project(low_BTR, p.wq_b.astype(dtype))


def apply(p: MLA, x_BTD, c: Config, positions_BT, segment_ids_BT, dtype) -> jax.Array:
    t = x_BTD.shape[1]
    nope, rdim = c.qk_nope_head_dim, c.qk_rope_head_dim
    kv_a = remat.tag(project(x_BTD, p.wkv_a.astype(dtype)), remat.KV_WA_PROJ)
    latent_BTR, k_rope_BTQ = kv_a[..., : c.kv_lora_rank], kv_a[..., c.kv_lora_rank :]
    latent_BTR = norm.rms_norm(p.kv_norm, latent_BTR, c.normalization_layer_epsilon)
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

    def queries_out(x_BTD, positions_BT, q_offset, end):  # a chunk's queries (chunks.py)
        q_BTHQ = remat.tag(queries(p, x_BTD, c, dtype), remat.MLA_Q)
        cos, sin = rope.cos_sin(c, positions_BT, rdim)
        q_rope = rope.apply(q_BTHQ[..., nope:], cos, sin)
        q = remat.tag(jnp.concatenate([q_BTHQ[..., :nope], q_rope], -1), remat.QUERY_PROJ)
        q = constrain(q, ("batch", "length", "act_heads", None))
        out = chunks.attend_chunk(q, k, v, c, segment_ids_BT, q_offset, end, rope.softmax_scale(c))
        return project(remat.tag(out, remat.ATTENTION_OUT), p.wo.astype(dtype), 2)

    scan = chunks.scanned(c, t, c.qk_head_dim, c.v_head_dim, dtype)
    out = chunks.over_queries(queries_out, x_BTD, positions_BT, c, scan=scan)
    # named here, not inside a chunk: a name inside a chunk's checkpoint is saved by the
    # chunk, on device, whatever its placement
    return remat.tag(out, remat.OUT_PROJ)
