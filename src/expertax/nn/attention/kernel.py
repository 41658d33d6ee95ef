"""Causal dot-product attention with the causal and document masks computed inside, and the choice
of implementation (`attention_impl`).

`dot`: the mask is never materialized as [B, 1, T, T]: it is a comparison of iotas (causal) and of
segment ids, fused by XLA into the select on the scores (seed 3922, item "causal mask"). The
scores themselves are [B, H, T, S] float32, saved for the backward pass.
`blockwise`: `blockwise.attend_blockwise`, no [T, S] matrix at all (online softmax, recomputing
backward); temporaries linear in T. Every backend; the CPU's long-sequence path.
`cudnn`: cuDNN flash attention (`cudnn.attend_cudnn`): GPU, bfloat16/float16, head dims padded to
one multiple of 8 (MLA's v padded to the q/k dim; the cost is in that module).
`splash`: the Pallas TPU splash-attention kernel (`splash.attend_splash`): TPU, any float dtype,
unequal q/k and v head dims taken as they are.
`auto`: per platform traced for (`expertax.platform`), from `evidence.AUTO` (docs/design/
attention.md): CPU `dot` below `AUTO_BLOCKWISE_MIN_LENGTH` query positions, `blockwise` from
there; GPU `cudnn` where dtype and head dims allow it, else the CPU rule; TPU `splash` from
`AUTO_BLOCKWISE_MIN_LENGTH` positions, `dot` below.
Keys/values may have fewer heads than queries (GQA): the H query heads are viewed as G groups
of J = H/G heads, keys never repeated.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from expertax import platform
from expertax.config.checks import ATTENTION_PLATFORMS
from expertax.nn.attention import cudnn, evidence
from expertax.nn.attention.blockwise import MASKED_SCORE, attend_blockwise
from expertax.nn.attention.splash import attend_splash

IMPLEMENTATIONS = ("auto", "dot", "blockwise", "cudnn", "splash")
# Kernels whose causal mask takes a query offset known only at run time (chunks.py scans them)
SCANNED = ("dot", "blockwise")

# Sequence length from which `auto` picks `blockwise` (CPU, GPU without cuDNN) or `splash` (TPU).
# Measured 2026-11 with benchmarks/attention.py on the shared 2-core x86 CPU host (load average
# 7-9 from other jobs, so repeated runs of one setting differed by up to 3x), forward+backward of
# one attention call with deepseek3-small head dims (H=16, Q=96, V=64), B=1, float32.
# blockwise/dot time: T=128-384 between 0.4 and 1.3 (no clear winner: one block, same work);
# T=512 0.3-0.9; T=768 0.5 (block 256); T=1024 0.35-0.5; T=2048 0.2; T=4096 0.19 (dot 30 s,
# 3.1 GiB temps; blockwise 5.5 s, 0.18 GiB). Not measured on GPU or TPU (see evidence.AUTO).
AUTO_BLOCKWISE_MIN_LENGTH = 512


def attend_dot(
    q_BTHQ, k_BSGQ, v_BSGO, *, scale: float, segment_ids_BT=None, q_offset=None
) -> jax.Array:
    """Causal attention with whole score matrices; returns [B, T, H, O]. Softmax in float32.

    Query row r sits at key position `q_offset` + r (default S - T: the queries are the last T
    of the S >= T keys; a traced value in a scan over query chunks); `segment_ids_BT` are the
    keys' [B, S]."""
    b, t, h, q = q_BTHQ.shape
    g = k_BSGQ.shape[2]
    q_BTGJQ = q_BTHQ.reshape(b, t, g, h // g, q)
    scores = jnp.einsum(
        "btgjq,bsgq->bgjts", q_BTGJQ, k_BSGQ, preferred_element_type=jnp.float32
    ) * jnp.float32(scale)
    s = k_BSGQ.shape[1]
    offset = s - t if q_offset is None else q_offset
    causal_TS = offset + jax.lax.broadcasted_iota(jnp.int32, (t, s), 0) >= jax.lax.broadcasted_iota(
        jnp.int32, (t, s), 1
    )
    mask = causal_TS[None, None, None]
    if segment_ids_BT is not None:
        seg_q_BT = jax.lax.dynamic_slice_in_dim(segment_ids_BT, offset, t, axis=1)
        same_doc_BTS = seg_q_BT[:, :, None] == segment_ids_BT[:, None, :]
        mask = jnp.logical_and(mask, same_doc_BTS[:, None, None])
    scores = jnp.where(mask, scores, MASKED_SCORE)
    probs = jax.nn.softmax(scores, axis=-1).astype(v_BSGO.dtype)
    out = jnp.einsum("bgjts,bsgo->btgjo", probs, v_BSGO)
    return out.reshape(b, t, h, v_BSGO.shape[-1])


def resolve(
    impl: str,
    *,
    length: int,
    qk_dim: int,
    v_dim: int,
    dtype,
    on: str | None = None,
    chunked: bool = False,
):
    """The concrete implementation `impl` stands for on platform `on` (default: the platform
    being traced for); anything but `auto` is returned as it is. `chunked`: the queries are a
    token chunk after earlier keys (`num_attention_token_chunks`), which cuDNN cannot take."""
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"attention_impl={impl!r}: use one of {', '.join(IMPLEMENTATIONS)}")
    if impl != "auto":
        return impl
    on = on or platform.current()
    choice = evidence.AUTO.get(on, evidence.AUTO["cpu"])
    usable = not chunked and cudnn.unusable_because(qk_dim, v_dim, dtype) is None
    if choice.kernel == "cudnn" and usable:
        return "cudnn"
    return choice.long if length >= AUTO_BLOCKWISE_MIN_LENGTH else choice.short


def attend(
    q_BTHQ: jax.Array,
    k_BSGQ: jax.Array,
    v_BSGO: jax.Array,
    *,
    scale: float,
    segment_ids_BT: jax.Array | None = None,
    impl: str = "dot",
    q_offset: jax.Array | None = None,
    mean_q_offset: float = 0.0,
) -> jax.Array:
    """Causal attention by the implementation `impl` (config key `attention_impl`); returns
    [B, T, H, O]. Scores and softmax in float32 for every implementation but cuDNN's own. The
    queries are the last T of the S >= T key positions (S > T: one token chunk of a sequence,
    `chunks.py`), or, with `q_offset` (a traced int in a scan over query chunks: `dot` and
    `blockwise` only), start at key position `q_offset` (`mean_q_offset`: its mean over the
    scan, for the blockwise loops' counted trips); `segment_ids_BT` are the keys' [B, S]."""
    impl = resolve(
        impl,
        length=k_BSGQ.shape[1],
        qk_dim=q_BTHQ.shape[-1],
        v_dim=v_BSGO.shape[-1],
        dtype=q_BTHQ.dtype,
        chunked=k_BSGQ.shape[1] != q_BTHQ.shape[1] or q_offset is not None,
    )
    if q_offset is not None and impl not in SCANNED:
        raise ValueError(
            f"attention_impl={impl} builds its causal mask at trace time; a query offset known "
            f"only at run time (a scan over query chunks) needs one of {', '.join(SCANNED)}"
        )
    needs, on = ATTENTION_PLATFORMS.get(impl), platform.current()
    if needs is not None and on != needs:
        raise ValueError(
            f"attention_impl={impl} needs a {needs.upper()}; this program is traced for {on}: "
            "use attention_impl=auto, dot or blockwise"
        )
    kernels: dict[str, Callable[..., jax.Array]] = {
        "dot": attend_dot,
        "blockwise": attend_blockwise,
        "cudnn": cudnn.attend_cudnn,
        "splash": attend_splash,
    }
    if q_offset is None:
        return kernels[impl](q_BTHQ, k_BSGQ, v_BSGO, scale=scale, segment_ids_BT=segment_ids_BT)
    if impl == "blockwise":
        return attend_blockwise(
            q_BTHQ,
            k_BSGQ,
            v_BSGO,
            scale=scale,
            segment_ids_BT=segment_ids_BT,
            q_offset=q_offset,
            mean_q_offset=mean_q_offset,
        )
    return attend_dot(
        q_BTHQ, k_BSGQ, v_BSGO, scale=scale, segment_ids_BT=segment_ids_BT, q_offset=q_offset
    )
