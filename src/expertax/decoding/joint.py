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

On one CPU device the products are our kernel's (decoding/rowdot.py), which splits any matrix
over the cores; a joined matrix is still one call in place of two.

Only where the decode step runs on one device and the weights are not fp8 (`layered` in
decoding/weights.py): sharded weights keep the layouts their sharding rules name, and fp8 block
scales need not line up with the parts.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from expertax.decoding.rowdot import project
from expertax.nn.moe.gmm import glu

F32 = jnp.float32


class Joint(NamedTuple):
    """Matrices [D, F_1], [D, F_2], ... concatenated along the output axis: [D, F_1 + F_2 + ...]."""

    w: Any


def join(*ws) -> Joint:
    return Joint(jnp.concatenate(ws, axis=-1))


def is_joint(x) -> bool:
    return isinstance(x, Joint)


def mla(attn):
    """An MLA's parameters with `wq_a` and `wkv_a` joined (unchanged without the low-rank query
    path, `q_lora_rank = 0`)."""
    if getattr(attn, "wq_a", None) is None or attn.wkv_a is None:
        return attn
    return dataclasses.replace(attn, wq_a=join(attn.wq_a, attn.wkv_a), wkv_a=None)


def mlp(p):
    """A SwiGLU's parameters (nn/mlp.MLP) with `wi_0` and `wi_1` joined."""
    return dataclasses.replace(p, wi_0=join(p.wi_0, p.wi_1), wi_1=None)


def glu_mlp(p, x_BTD, dtype):
    """`mlp.apply` for joined parameters: silu(x @ wi_0) * (x @ wi_1) @ wo."""
    h = project(x_BTD, p.wi_0.w.astype(dtype))
    f = h.shape[-1] // 2
    return project(jax.nn.silu(h[..., :f]) * h[..., f:], p.wo.astype(dtype))


def expert_ffn(wi: Joint, wo, x_RD, dtype):
    """One routed expert's SwiGLU on rows [R, D] -> float32 [R, D] (decoding/moe.py's `_ffn`
    for joined weights)."""
    h = project(x_RD, wi.w.astype(dtype), preferred_element_type=F32).astype(dtype)
    f = h.shape[-1] // 2
    return project(glu(h[:, :f], h[:, f:]), wo.astype(dtype), preferred_element_type=F32)
