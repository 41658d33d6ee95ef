"""The parameters as decoding holds them: one buffer per layer, not stacked over the layers.

Training stacks each layer stack's weights along a leading axis and scans over it. A decode step
reads each weight once for a handful of tokens; sliced out of a stacked array inside a scan, a
layer's routed-expert weights [E, D, F] are copied whole every step before the grouped matmul's
loop reads the few experts the tokens chose (measured on deepseek3-small: decode time followed
all 398M parameters, not the active ones), and the cache slices likewise. Decoding therefore
unstacks the layers once, before the decode program (`layered`), and the program runs them
unrolled with one cache buffer per layer (decoding/model.py), updated in place.

`layered` is the same Decoder dataclass with `dense_layers` and `moe_layers` as lists of Block
trees and `mtp` as MTP module 1 alone (the one that drafts); with `fp8_weights`, the layers'
matrices are quantized on the way (decoding/quantized.py). Each layer is cut from the stacked
array by one small jitted program per stack into that layer's own sharding (the stacked one less
the layer axis). More layouts for the decode step, made on the way:
- MLA's `wkv_b` as its absorbed halves (`mla.Absorbed`: [H, Qn, Rkv] and [H, Rkv, O]),
  with fp8 blocks along those halves' second to last axes;
- the output head `lm_head` over its vocabulary axis (`model.head_spec`);
- on one device, each MoE layer's experts as separate arrays (nn/moe/unstacked.py), and float
  matrices that read the same input joined into one (decoding/joint.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from expertax.config.schema import Config
from expertax.decoding import joint, model, quantized
from expertax.fp8 import quant
from expertax.models import decoder
from expertax.nn import param
from expertax.nn.attention import mla
from expertax.nn.moe import bias as expert_bias


def layer_specs(c: Config, *, fp8_weights: bool):
    """(dense Block spec, MoE Block spec, MTP module spec) of one layer; None where absent."""
    dense = decoder.block_spec(c, moe=False) if c.num_dense_layers else None
    moe = decoder.block_spec(c, moe=True) if c.num_moe_layers else None
    mtp = decoder.mtp_spec(c) if c.mtp_num_layers else None
    dense, moe, mtp = (_absorbed(t, c, mla.absorb_spec) for t in (dense, moe, mtp))
    if fp8_weights:
        dense, moe = quantized.spec(dense), quantized.spec(moe)
        mtp = quantized.spec(mtp, prefix=("mtp",))
    return dense, moe, mtp


def _absorbed(layer, c: Config, how):
    """A layer's tree (Block or MTP module; specs or arrays) with MLA's `wkv_b` as
    `mla.Absorbed` (`how`: `mla.absorb` or `absorb_spec`)."""
    if layer is None or c.attention_type != "mla":
        return layer
    if hasattr(layer, "block"):  # an MTP module
        return dataclasses.replace(layer, block=_absorbed(layer.block, c, how))
    attn = dataclasses.replace(layer.attn, wkv_b=how(layer.attn.wkv_b, c.qk_nope_head_dim))
    return dataclasses.replace(layer, attn=attn)


def _top_specs(c: Config) -> decoder.Decoder:
    whole = decoder.spec(c)
    return dataclasses.replace(whole, dense_layers=None, moe_layers=None, mtp=None)


def layered(params: decoder.Decoder, c: Config, mesh, rules, *, fp8_weights: bool = False):
    """`params` (stacked, any placement) as decoding's per-layer tree on `mesh`."""
    dense_spec, moe_spec, mtp_spec = layer_specs(c, fp8_weights=fp8_weights)
    params = jax.device_put(params, param.shardings(decoder.spec(c), mesh, rules))
    out = dataclasses.replace(params, dense_layers=None, moe_layers=None, mtp=None)
    if out.lm_head is not None:
        head = jax.device_put(out.lm_head, _head_sharding(mesh, rules, out.lm_head.shape))
        out = dataclasses.replace(out, lm_head=head)

    def cut(stacked, spec, n: int, prefix=()):
        if stacked is None or spec is None:
            return None
        take = _cutter(spec, c, mesh, rules, fp8_weights, prefix)
        return [take(stacked, jnp.int32(i)) for i in range(n)]

    mtp = cut(params.mtp, mtp_spec, 1, ("mtp",)) if params.mtp is not None else None
    out = dataclasses.replace(
        out,
        dense_layers=cut(params.dense_layers, dense_spec, c.num_dense_layers),
        moe_layers=cut(params.moe_layers, moe_spec, c.num_moe_layers),
        mtp=None if mtp is None else mtp[0],
    )
    return _one_device(out, c) if mesh.size == 1 else out


def _head_sharding(mesh, rules, shape_DV) -> NamedSharding:
    """The output head over its vocabulary axis (decoding/model.py, `head_spec`)."""
    return NamedSharding(mesh, model.head_spec(mesh, rules, shape_DV))


def _one_device(params: decoder.Decoder, c: Config) -> decoder.Decoder:
    """On one device, every MoE layer's experts as separate arrays (nn/moe/unstacked.py) and, for
    float weights, the matrices that read the same input joined (decoding/joint.py)."""

    def block(b: decoder.Block) -> decoder.Block:
        if b.moe is not None and expert_bias.of(b.moe) is None:  # biased experts stay stacked
            b = dataclasses.replace(b, moe=joint.unstack(b.moe))
        if any(quant.is_fp8(x) for x in jax.tree.leaves(b, is_leaf=quant.is_fp8)):
            return b
        if c.attention_type == "mla":
            b = dataclasses.replace(b, attn=joint.mla(b.attn))
        if b.mlp is not None:
            b = dataclasses.replace(b, mlp=joint.mlp(b.mlp))
        if b.moe is not None and b.moe.shared is not None:
            shared = joint.mlp(b.moe.shared)
            b = dataclasses.replace(b, moe=dataclasses.replace(b.moe, shared=shared))
        return b

    mtp = params.mtp
    if mtp is not None:
        mtp = dataclasses.replace(mtp, block=block(mtp.block))
    dense: Any = params.dense_layers  # lists here (`layered`)
    moe: Any = params.moe_layers
    dense, moe = (layers and [block(b) for b in layers] for layers in (dense, moe))
    return dataclasses.replace(params, dense_layers=dense, moe_layers=moe, mtp=mtp)


_CUTTERS: dict = {}


def _cutter(spec, c: Config, mesh, rules, fp8_weights: bool, prefix):
    """The jitted program that cuts layer i out of a stack (one per layer spec and mesh)."""
    key = (repr(spec), mesh, repr(sorted(rules.items())), fp8_weights, prefix)
    if key not in _CUTTERS:

        def one(tree, i):
            layer = _absorbed(jax.tree.map(lambda a: a[i], tree), c, mla.absorb)
            return quantized.quantize(layer, prefix=prefix) if fp8_weights else layer

        _CUTTERS[key] = jax.jit(one, out_shardings=param.shardings(spec, mesh, rules))
    return _CUTTERS[key]


def abstract_layered(c: Config, mesh, rules, *, fp8_weights: bool = False):
    """ShapeDtypeStructs (with shardings) of `layered`'s output, for compile-only targets."""
    dense_spec, moe_spec, mtp_spec = layer_specs(c, fp8_weights=fp8_weights)

    def structs(spec):
        if spec is None:
            return None
        shardings = param.shardings(spec, mesh, rules)
        return jax.tree.map(
            lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh),
            quantized.abstract(spec, c.weight_dtype),
            shardings,
            is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct),
        )

    top = structs(_top_specs(c))
    if (head := top.lm_head) is not None:
        sharding = _head_sharding(mesh, rules, head.shape)
        top = dataclasses.replace(
            top, lm_head=jax.ShapeDtypeStruct(head.shape, head.dtype, sharding=sharding)
        )
    dense, moe = structs(dense_spec), structs(moe_spec)
    return dataclasses.replace(
        top,
        dense_layers=None if dense is None else [dense] * c.num_dense_layers,
        moe_layers=None if moe is None else [moe] * c.num_moe_layers,
        mtp=structs(mtp_spec),
    )


def is_layered(params) -> bool:
    return isinstance(params.dense_layers, list) or isinstance(params.moe_layers, list)
