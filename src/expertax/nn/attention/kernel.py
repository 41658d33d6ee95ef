"""Causal dot-product attention with the causal and document masks computed inside, and the choice
of implementation (`attention_impl`).

`dot`: the mask is never materialized as [B, 1, T, T]: it is a comparison of iotas (causal) and of
segment ids, fused by XLA into the select on the scores (seed 3922, item "causal mask"). The
scores themselves are [B, H, T, S] float32, saved for the backward pass.
`blockwise`: `blockwise.attend_blockwise`, no [T, S] matrix at all (online softmax, recomputing
backward); temporaries linear in T.
`cudnn`: cuDNN flash attention through `jax.nn.dot_product_attention` (GPU, bf16/fp16, equal
query/key and value head dims).
`auto`: `dot` below `AUTO_BLOCKWISE_MIN_LENGTH` query positions, `blockwise` from there on.
Keys/values may have fewer heads than queries (GQA): the H query heads are viewed as G groups
of J = H/G heads, keys never repeated.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from expertax import platform
from expertax.nn.attention.blockwise import MASKED_SCORE, attend_blockwise

IMPLEMENTATIONS = ("auto", "dot", "blockwise", "cudnn")

# Sequence length from which `auto` picks `blockwise`. Measured 2026-11 with
# benchmarks/attention.py on the shared 2-core x86 CPU host (load average 7-9 from other jobs, so
# repeated runs of one setting differed by up to 3x), forward+backward of one attention call with
# deepseek3-small head dims (H=16, Q=96, V=64), B=1, float32. blockwise/dot time: T=128-384
# between 0.4 and 1.3 (no clear winner: one block, same work); T=512 0.3-0.9; T=768 0.5 (block
# 256); T=1024 0.35-0.5; T=2048 0.2; T=4096 0.19 (dot 30 s, 3.1 GiB temps; blockwise 5.5 s,
# 0.18 GiB). Not measured on GPU, where the loops' per-iteration cost may move the crossover up.
AUTO_BLOCKWISE_MIN_LENGTH = 512

# Head dims cuDNN flash attention takes (Hopper and later; 128 before): multiples of 8 up to 256.
CUDNN_MAX_HEAD_DIM = 256
CUDNN_DTYPES = (jnp.bfloat16, jnp.float16)


def attend_dot(q_BTHQ, k_BSGQ, v_BSGO, *, scale: float, segment_ids_BT=None) -> jax.Array:
    """Causal attention with whole score matrices; returns [B, T, H, O]. Softmax in float32."""
    b, t, h, q = q_BTHQ.shape
    g = k_BSGQ.shape[2]
    q_BTGJQ = q_BTHQ.reshape(b, t, g, h // g, q)
    scores = jnp.einsum(
        "btgjq,bsgq->bgjts", q_BTGJQ, k_BSGQ, preferred_element_type=jnp.float32
    ) * jnp.float32(scale)
    s = k_BSGQ.shape[1]
    causal_TS = jax.lax.broadcasted_iota(jnp.int32, (t, s), 0) >= jax.lax.broadcasted_iota(
        jnp.int32, (t, s), 1
    )
    mask = causal_TS[None, None, None]
    if segment_ids_BT is not None:
        same_doc_BTS = segment_ids_BT[:, :, None] == segment_ids_BT[:, None, :]
        mask = jnp.logical_and(mask, same_doc_BTS[:, None, None])
    scores = jnp.where(mask, scores, MASKED_SCORE)
    probs = jax.nn.softmax(scores, axis=-1).astype(v_BSGO.dtype)
    out = jnp.einsum("bgjts,bsgo->btgjo", probs, v_BSGO)
    return out.reshape(b, t, h, v_BSGO.shape[-1])


def attend_cudnn(q_BTHQ, k_BSGQ, v_BSGO, *, scale: float, segment_ids_BT=None) -> jax.Array:
    """cuDNN flash attention. Packed documents go in as a boolean [B, 1, T, S] mask (cuDNN takes
    it as a bias, so that case materializes one [T, S] matrix per sequence, not per head)."""
    on = platform.current()
    if on != "gpu":
        raise ValueError(
            f"attention_impl=cudnn needs a GPU; this run's platform is {on}: "
            "use attention_impl=auto, dot or blockwise"
        )
    qk_dim, v_dim = q_BTHQ.shape[-1], v_BSGO.shape[-1]
    if qk_dim != v_dim:
        raise ValueError(
            f"attention_impl=cudnn needs equal query/key and value head dims (jax.nn."
            f"dot_product_attention); got {qk_dim} and {v_dim}: use attention_impl=blockwise"
        )
    if q_BTHQ.dtype not in CUDNN_DTYPES:
        raise ValueError(
            f"attention_impl=cudnn needs bfloat16 or float16 activations, got {q_BTHQ.dtype}: "
            "set dtype=bfloat16 or use attention_impl=blockwise"
        )
    mask = None
    if segment_ids_BT is not None:
        mask = (segment_ids_BT[:, :, None] == segment_ids_BT[:, None, :])[:, None]
    return jax.nn.dot_product_attention(
        q_BTHQ, k_BSGQ, v_BSGO, mask=mask, scale=scale, is_causal=True, implementation="cudnn"
    )


def attend(
    q_BTHQ: jax.Array,
    k_BSGQ: jax.Array,
    v_BSGO: jax.Array,
    *,
    scale: float,
    segment_ids_BT: jax.Array | None = None,
    impl: str = "dot",
) -> jax.Array:
    """Causal attention by the implementation `impl` (config key `attention_impl`); returns
    [B, T, H, O]. Scores and softmax in float32 for every implementation but cuDNN's own."""
    if impl == "auto":
        impl = "blockwise" if q_BTHQ.shape[1] >= AUTO_BLOCKWISE_MIN_LENGTH else "dot"
    kernels = {"dot": attend_dot, "blockwise": attend_blockwise, "cudnn": attend_cudnn}
    if impl in kernels:
        return kernels[impl](q_BTHQ, k_BSGQ, v_BSGO, scale=scale, segment_ids_BT=segment_ids_BT)
    raise ValueError(f"attention_impl={impl!r}: use one of {', '.join(IMPLEMENTATIONS)}")
