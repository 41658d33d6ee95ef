"""Matrices that read the same input, held side by side for a decode step on one device.

A decode step multiplies one to a few rows by each weight: matrix-vector products, bound by
reading the weights. XLA:CPU runs such a product on one thread when it is small (below about
600k multiply-adds; measured on 2 cores: a [1024, 256] float32 product reads at 11-15 GB/s, a
[1024, 1024] one at 33-37 GB/s on both threads), and it runs independent products one after
the other. Products that read the same input are therefore held as one matrix, concatenated
along the output axis (`Joint`), and run as one product whose output is split:

- MLA's down projections: `wq_a` [D, Rq] and `wkv_a` [D, Rkv + Qr] (both read the normed layer
  input) as `attn.wq_a = Joint([D, Rq + Rkv + Qr])`, `attn.wkv_a = None`;
- every SwiGLU (the dense layers' MLP, the shared experts, each routed expert on one device):
  `wi_0` and `wi_1` [D, F] as `wi_0 = Joint([D, 2F])`, `wi_1 = None`.

Each MoE layer's routed experts are also held apart, one array per expert (`unstack`: the
layout of nn/moe/unstacked.py, which reads the chosen experts' weights in place).

On one CPU device the products are our kernel's (decoding/rowdot.py), which splits any matrix
over the cores; a joined matrix is still one call in place of two.

Only where the decode step runs on one device and the weights are not fp8 (`layered` in
decoding/weights.py): sharded weights keep the layouts their sharding rules name, and fp8 block
scales need not line up with the parts.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from expertax.fp8 import quant
from expertax.nn.linear import Joint, is_joint, join
from expertax.nn.moe.layer import MoE

__all__ = ["Joint", "is_joint", "join", "mla", "mlp", "unstack"]
F32 = jnp.float32


def mla(attn):
    """An MLA's parameters with `wq_a` and `wkv_a` joined (unchanged without the low-rank query
    path, `q_lora_rank = 0`)."""
    if getattr(attn, "wq_a", None) is None or attn.wkv_a is None:
        return attn
    return dataclasses.replace(attn, wq_a=join(attn.wq_a, attn.wkv_a), wkv_a=None)


def mlp(p):
    """A SwiGLU's parameters (nn/mlp.MLP) with `wi_0` and `wi_1` joined."""
    return dataclasses.replace(p, wi_0=join(p.wi_0, p.wi_1), wi_1=None)


def unstack(p: MoE) -> MoE:
    """The layer with each expert matrix ([E, ...], or its Fp8) as a tuple of E per-expert ones;
    float weights with each expert's `wi_0` and `wi_1` joined (`wi_0` a tuple of Joint
    [D, 2F], `wi_1` a tuple of None): the layout of nn/moe/unstacked.py."""

    def split(w):
        e = jax.tree.leaves(w)[0].shape[0]
        return tuple(jax.tree.map(lambda a, i=i: a[i], w) for i in range(e))

    out = dataclasses.replace(p, **{k: split(getattr(p, k)) for k in ("wi_0", "wi_1", "wo")})
    if quant.is_fp8(p.wi_0):
        return out
    wi = tuple(join(a, b) for a, b in zip(out.wi_0, out.wi_1, strict=True))
    return dataclasses.replace(out, wi_0=wi, wi_1=(None,) * len(wi))
