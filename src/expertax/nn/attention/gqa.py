"""Grouped-query attention (Mixtral, Qwen3, Llama): wq, wk, wv, the optional per-head q/k norm
(qk_norm.py), RoPE on the full head, optional learned attention sinks (one logit per query
head, `attention_sinks`: kernel.attend_dot), wo; with an optional key/value cache (cache.py:
decoding's prefill and decode steps)."""

from __future__ import annotations

import jax

from expertax.config.schema import Config
from expertax.nn import rope
from expertax.nn.attention import chunks, context, kernel, qk_norm
from expertax.nn.attention.cache import KV, constrain_layer, slot_positions, write
from expertax.nn.attention.mask import MaskSpec
from expertax.nn.linear import project
from expertax.nn.param import Param, ParamSpec, given, optional, params_dataclass, projection
from expertax.parallel import remat
from expertax.sharding import constrain


@params_dataclass
class GQA:
    """The projections, and the parameters only some models have (`optional()`: not in the tree
    where `ABSENT`, so a model without them keeps the tree and checkpoints it had before)."""

    wq: Param  # [D, H, Q]
    wk: Param  # [D, G, Q]
    wv: Param  # [D, G, O], O = Q here
    wo: Param  # [H, O, D]
    q_norm: Param = optional()  # [Q] per-head query RMSNorm scale (attention_qk_norm)
    k_norm: Param = optional()  # [Q] per-head key RMSNorm scale
    sinks: Param = optional()  # [H] learned sink logit per query head (attention_sinks)
    bq: Param = optional()  # [H, Q] query bias (attention_qkv_bias)
    bk: Param = optional()  # [G, Q] key bias
    bv: Param = optional()  # [G, O] value bias
    bo: Param = optional()  # [D] output bias (attention_out_bias)


def spec(c: Config) -> GQA:
    d, h, g, q = c.base_emb_dim, c.base_num_query_heads, c.base_num_kv_heads, c.head_dim
    projections = dict(
        wq=projection((d, h, q), ("embed", "heads", "kv"), d),
        wk=projection((d, g, q), ("embed", "kv_heads", "kv"), d),
        wv=projection((d, g, q), ("embed", "kv_heads", "kv"), d),
        wo=projection((h, q, d), ("heads", "kv", "embed"), h * q),
    )
    if c.attention_qk_norm:
        projections.update(q_norm=qk_norm.spec(c), k_norm=qk_norm.spec(c))
    if c.attention_sinks:  # zero logits at init: one more unit of weight in every softmax row
        projections.update(sinks=ParamSpec((h,), ("heads",), "zeros", weight_decay=False))
    if c.attention_qkv_bias:  # GLM-4.5, GPT-OSS
        projections.update(bq=_bias((h, q), "heads"), bk=_bias((g, q), "kv_heads"))
        projections.update(bv=_bias((g, q), "kv_heads"))
    if c.attention_out_bias:  # GPT-OSS
        projections.update(bo=ParamSpec((d,), ("embed",), "zeros", weight_decay=False))
    return GQA(**projections)


def _bias(shape: tuple[int, int], heads: str) -> ParamSpec:
    return ParamSpec(shape, (heads, "kv"), "zeros", weight_decay=False)


def _project(x, w, b, dtype, n_in: int = 1):
    """A projection and its bias (None: none), in `dtype`."""
    y = project(x, w.astype(dtype), n_in)
    return y if b is None else y + b.astype(dtype).reshape((1,) * (y.ndim - b.ndim) + b.shape)


def _queries(p: GQA, x_BTD, c: Config, positions_BT, dtype) -> jax.Array:
    q = remat.tag(_project(x_BTD, p.wq, given(p.bq), dtype), remat.QUERY_PROJ)
    q = qk_norm.apply(given(p.q_norm), q, c)
    cos, sin = rope.cos_sin(c, positions_BT, rope.rotary_dim(c))
    return constrain(rope.apply(q, cos, sin), ("batch", "length", "act_heads", None))


def apply(
    p: GQA, x_BTD, c: Config, positions_BT, segment_ids_BT, dtype, cache: KV | None = None,
    window: int | None = None,
):  # fmt: skip
    """The layer's output [B, T, D] and its cache (None without one; with one, the new
    tokens' keys and values written at their positions and every slot read: cache.py).
    `window`: a sliding-window layer's window (mask.MaskSpec; None: causal over all keys)."""
    mask_spec = MaskSpec(window=window)
    t = x_BTD.shape[1]
    k = remat.tag(_project(x_BTD, p.wk, given(p.bk), dtype), remat.KEY_PROJ)
    k = qk_norm.apply(given(p.k_norm), k, c)
    v = remat.tag(_project(x_BTD, p.wv, given(p.bv), dtype), remat.VALUE_PROJ)
    cos, sin = rope.cos_sin(c, positions_BT, rope.rotary_dim(c))
    k = constrain(rope.apply(k, cos, sin), ("batch", "length", "act_kv_heads", None))
    if cache is not None:
        cache = KV(write(cache.k, k, positions_BT), write(cache.v, v, positions_BT))
        cache = constrain_layer(cache, "act_kv_heads")
        out = kernel.attend_dot(
            _queries(p, x_BTD, c, positions_BT, dtype), cache.k, cache.v,
            scale=rope.softmax_scale(c), q_positions_BT=positions_BT,
            kv_positions_BS=slot_positions(cache.k.shape[1]), sink_logits_H=given(p.sinks),
            mask_spec=mask_spec,
        )  # fmt: skip
        return _project(out, p.wo, given(p.bo), dtype, 2), cache
    if context.size() > 1:  # context parallelism: the keys and values cross devices
        out = context.attend(
            _queries(p, x_BTD, c, positions_BT, dtype), (k, v), lambda kv, _: kv, None, c,
            positions_BT=positions_BT, segment_ids_BT=segment_ids_BT,
            scale=rope.softmax_scale(c), sink_logits_H=given(p.sinks), mask_spec=mask_spec,
        )  # fmt: skip
        out = _project(remat.tag(out, remat.ATTENTION_OUT), p.wo, given(p.bo), dtype, 2)
        return remat.tag(out, remat.OUT_PROJ), None
    kv_positions_BS = positions_BT

    def queries_out(x_BTD, positions_BT, q_offset, end):  # a chunk's queries (chunks.py)
        q = _queries(p, x_BTD, c, positions_BT, dtype)
        scale = rope.softmax_scale(c)
        out = chunks.attend_chunk(
            q, k, v, c, segment_ids_BT, q_offset, end, scale, positions_BT, kv_positions_BS,
            given(p.sinks), mask_spec,
        )  # fmt: skip
        return _project(remat.tag(out, remat.ATTENTION_OUT), p.wo, given(p.bo), dtype, 2)

    scan = chunks.scanned(c, t, c.head_dim, c.head_dim, dtype)
    out = chunks.over_queries(queries_out, x_BTD, positions_BT, c, scan=scan)
    # named here, not inside a chunk: a name inside a chunk's checkpoint is saved by the
    # chunk, on device, whatever its placement
    return remat.tag(out, remat.OUT_PROJ), None
