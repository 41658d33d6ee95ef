"""Grouped-query attention (Mixtral, Llama): wq, wk, wv, RoPE on the full head, wo."""

from __future__ import annotations

import jax

from expertax.config.schema import Config
from expertax.nn import rope
from expertax.nn.attention.kernel import attend
from expertax.nn.linear import project
from expertax.nn.param import Param, params_dataclass, projection
from expertax.parallel import remat
from expertax.sharding import constrain


@params_dataclass
class GQA:
    wq: Param  # [D, H, Q]
    wk: Param  # [D, G, Q]
    wv: Param  # [D, G, O], O = Q here
    wo: Param  # [H, O, D]


def spec(c: Config) -> GQA:
    d, h, g, q = c.base_emb_dim, c.base_num_query_heads, c.base_num_kv_heads, c.head_dim
    return GQA(
        wq=projection((d, h, q), ("embed", "heads", "kv"), d),
        wk=projection((d, g, q), ("embed", "kv_heads", "kv"), d),
        wv=projection((d, g, q), ("embed", "kv_heads", "kv"), d),
        wo=projection((h, q, d), ("heads", "kv", "embed"), h * q),
    )


def apply(p: GQA, x_BTD, c: Config, positions_BT, segment_ids_BT, dtype) -> jax.Array:
    q = remat.tag(project(x_BTD, p.wq.astype(dtype)), remat.QUERY_PROJ)
    k = remat.tag(project(x_BTD, p.wk.astype(dtype)), remat.KEY_PROJ)
    v = remat.tag(project(x_BTD, p.wv.astype(dtype)), remat.VALUE_PROJ)
    cos, sin = rope.cos_sin(c, positions_BT, c.head_dim)
    q = constrain(rope.apply(q, cos, sin), ("batch", "length", "act_heads", None))
    k = constrain(rope.apply(k, cos, sin), ("batch", "length", "act_kv_heads", None))
    out = attend(
        q, k, v, scale=rope.softmax_scale(c), segment_ids_BT=segment_ids_BT, impl=c.attention_impl
    )
    out = remat.tag(out, remat.ATTENTION_OUT)
    return remat.tag(project(out, p.wo.astype(dtype), 2), remat.OUT_PROJ)
