"""Dot-product attention with its mask computed inside (from positions and a mask spec, mask.py),
and the choice of implementation (`attention_impl`).

`dot`: the mask is never materialized as [B, 1, T, T]: it is a comparison of the queries' and
keys' positions (causal, and any other kind of `mask.MaskSpec`) and of segment ids, fused by XLA
into the select on the scores (seed 3922, item "causal mask"). The scores themselves are
[B, H, T, S] float32, saved for the backward pass. Training and decoding (a cache's slots) call it
alike.
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
from expertax.config.schema import Config
from expertax.errors import ConfigError
from expertax.nn.attention import cudnn, evidence, mask
from expertax.nn.attention.blockwise import MASKED_SCORE, attend_blockwise
from expertax.nn.attention.mask import CAUSAL, MaskSpec
from expertax.nn.attention.splash import attend_splash

IMPLEMENTATIONS = ("auto", "dot", "blockwise", "cudnn", "splash")
# Kernels that run on one platform only (the planner reads it too)
ATTENTION_PLATFORMS = {"cudnn": "gpu", "splash": "tpu"}
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
    q_BTHQ,
    k_BSGQ,
    v_BSGO,
    *,
    scale: float,
    segment_ids_BT=None,
    q_offset=None,
    q_positions_BT=None,
    kv_positions_BS=None,
    mask_spec: MaskSpec = CAUSAL,
    sink_logits_H: jax.Array | None = None,
) -> jax.Array:
    """Attention with whole score matrices; returns [B, T, H, O]. Softmax in float32.

    The mask is `mask_spec` built from the queries' and keys' positions (mask.py):
    `q_positions_BT` [B|1, T] and `kv_positions_BS` [B|1, S], or, without them, from where the
    rows sit: query row r at key position `q_offset` + r (default S - T: the queries are the
    last T of the S >= T keys; a traced value in a scan over query chunks), key s at s.
    `segment_ids_BT` are the keys' [B, S]; the queries' are theirs from the queries' offset.

    Queries and keys may come in parts (tuples, matched in order): the scores are the sum of the
    parts' products (MLA's absorbed form: the latent part and the RoPE part, mla.py), so that no
    part is concatenated with another (a whole cache copied per step).

    `sink_logits_H`: learned attention sinks (GPT-OSS), one logit per query head: one more
    column of each row's softmax that has no value, so a head can give a row less than all of
    its weight (a row that reads no key gives 0)."""
    q_parts = q_BTHQ if isinstance(q_BTHQ, tuple) else (q_BTHQ,)
    k_parts = k_BSGQ if isinstance(k_BSGQ, tuple) else (k_BSGQ,)
    b, t, h, _ = q_parts[0].shape
    g, s = k_parts[0].shape[2], k_parts[0].shape[1]
    scores = None
    for q_part, k_part in zip(q_parts, k_parts, strict=True):
        if g == 1:  # one kv head (MQA, MLA's absorbed form): no group axis in the products
            part = jnp.einsum(
                "bthq,bsq->bhts", q_part, k_part[:, :, 0], preferred_element_type=jnp.float32
            )[:, None]
        else:
            q_BTGJQ = q_part.reshape(b, t, g, h // g, q_part.shape[-1])
            part = jnp.einsum(
                "btgjq,bsgq->bgjts", q_BTGJQ, k_part, preferred_element_type=jnp.float32
            )
        scores = part if scores is None else scores + part
    scores = scores * jnp.float32(scale)
    offset = s - t if q_offset is None else q_offset
    if q_positions_BT is None:
        q_positions_BT = offset + jax.lax.broadcasted_iota(jnp.int32, (1, t), 1)
    if kv_positions_BS is None:
        kv_positions_BS = jax.lax.broadcasted_iota(jnp.int32, (1, s), 1)
    seg_q_BT = None
    if segment_ids_BT is not None:
        seg_q_BT = jax.lax.dynamic_slice_in_dim(segment_ids_BT, offset, t, axis=1)
    allowed_BTS = mask.allowed(mask_spec, q_positions_BT, kv_positions_BS, seg_q_BT, segment_ids_BT)
    scores = jnp.where(allowed_BTS[:, None, None], scores, MASKED_SCORE)
    probs = _softmax(scores, sink_logits_H).astype(v_BSGO.dtype)
    if g == 1:  # the heads' and queries' rows as one axis: one batched product per sequence
        out_BMO = jnp.einsum("bms,bso->bmo", probs.reshape(b, h * t, s), v_BSGO[:, :, 0])
        return out_BMO.reshape(b, h, t, -1).transpose(0, 2, 1, 3)
    out = jnp.einsum("bgjts,bsgo->btgjo", probs, v_BSGO)
    return out.reshape(b, t, h, v_BSGO.shape[-1])


def _softmax(scores_BGJTS, sink_logits_H):
    """The softmax over the keys of [B, G, J, T, S] float32 scores, with each head's sink logit
    as one more column (dropped from the result) where given."""
    if sink_logits_H is None:
        return jax.nn.softmax(scores_BGJTS, axis=-1)
    g, j = scores_BGJTS.shape[1:3]
    sink = sink_logits_H.astype(jnp.float32).reshape(1, g, j, 1, 1)
    top = jnp.maximum(jnp.max(scores_BGJTS, axis=-1, keepdims=True), sink)
    e = jnp.exp(scores_BGJTS - top)
    return e / (jnp.sum(e, axis=-1, keepdims=True) + jnp.exp(sink - top))


def resolve(
    impl: str,
    *,
    length: int,
    qk_dim: int,
    v_dim: int,
    dtype,
    on: str | None = None,
    chunked: bool = False,
    mask_spec: MaskSpec = CAUSAL,
    sinks: bool = False,
):
    """The concrete implementation `impl` stands for on platform `on` (default: the platform
    being traced for); anything but `auto` is returned as it is, unless it cannot honour
    `mask_spec` or learned `sinks` (a ValueError saying why; `auto` then picks a kernel that
    can). `chunked`: the queries are a token chunk after earlier keys
    (`num_attention_token_chunks`), which cuDNN cannot take."""
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"attention_impl={impl!r}: use one of {', '.join(IMPLEMENTATIONS)}")
    if impl != "auto":
        if (why := mask.unsupported(mask_spec, impl)) is not None:
            raise ValueError(why)
        if sinks and impl == "cudnn":
            raise ValueError(
                "attention_impl=cudnn: jax.nn.dot_product_attention has no learned attention "
                "sinks (attention_sinks=true); use attention_impl=auto, dot or blockwise"
            )
        return impl
    if not mask.by_row(mask_spec):  # dot builds any spec, blockwise a causal one
        long = mask_spec.causal and length >= AUTO_BLOCKWISE_MIN_LENGTH
        return "blockwise" if long else "dot"
    on = on or platform.current()
    choice = evidence.AUTO.get(on, evidence.AUTO["cpu"])
    usable = not chunked and not sinks and cudnn.unusable_because(qk_dim, v_dim, dtype) is None
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
    q_positions_BT: jax.Array | None = None,
    kv_positions_BS: jax.Array | None = None,
    mask_spec: MaskSpec = CAUSAL,
    sink_logits_H: jax.Array | None = None,
) -> jax.Array:
    """Attention by the implementation `impl` (config key `attention_impl`) under `mask_spec`
    (mask.py: `dot` and `blockwise` build it from `q_positions_BT` and `kv_positions_BS` where
    given, `splash` and `cudnn` their causal and sliding-window masks by row, from the queries'
    offset into the keys);
    returns [B, T, H, O]. Scores
    and softmax in float32 for every implementation but cuDNN's own. The queries are the last T
    of the S >= T key positions (S > T: one token chunk of a sequence, `chunks.py`), or, with
    `q_offset` (a traced int in a scan over query chunks: `dot` and `blockwise` only), start at
    key position `q_offset` (`mean_q_offset`: its mean over the scan, for the blockwise loops'
    counted trips); `segment_ids_BT` are the keys' [B, S]; `sink_logits_H`: learned attention
    sinks, one logit per query head (`attend_dot`; every kernel but cuDNN's)."""
    impl = resolve(
        impl,
        length=k_BSGQ.shape[1],
        qk_dim=q_BTHQ.shape[-1],
        v_dim=v_BSGO.shape[-1],
        dtype=q_BTHQ.dtype,
        chunked=k_BSGQ.shape[1] != q_BTHQ.shape[1] or q_offset is not None,
        mask_spec=mask_spec,
        sinks=sink_logits_H is not None,
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
    kw: dict = dict(scale=scale, segment_ids_BT=segment_ids_BT)
    if sink_logits_H is not None:  # resolve refused cudnn
        kw.update(sink_logits_H=sink_logits_H)
    if impl in SCANNED:  # dot, blockwise: the mask from positions
        kw.update(q_offset=q_offset, q_positions_BT=q_positions_BT,
                  kv_positions_BS=kv_positions_BS, mask_spec=mask_spec)  # fmt: skip
    else:  # splash, cudnn: causal by row, and the window (resolve refused any other kind)
        kw.update(window=mask_spec.window)
    if impl == "blockwise" and q_offset is not None:
        kw.update(mean_q_offset=mean_q_offset)
    kernels: dict[str, Callable[..., jax.Array]] = {
        "dot": attend_dot,
        "blockwise": attend_blockwise,
        "cudnn": cudnn.attend_cudnn,
        "splash": attend_splash,
    }
    return kernels[impl](q_BTHQ, k_BSGQ, v_BSGO, **kw)


def check_platform(c: Config, platform_name: str) -> None:
    """A kernel for one platform, asked for on another, is refused before anything is traced
    (`platform_name`: the mesh's devices', `expertax.platform.of_mesh`)."""
    needs = ATTENTION_PLATFORMS.get(c.attention_impl)
    if needs is not None and platform_name != needs:
        valid = ["auto", "dot", "blockwise"] + [
            k for k, p in ATTENTION_PLATFORMS.items() if p == platform_name
        ]
        raise ConfigError(
            f"attention_impl={c.attention_impl} runs on {needs.upper()} only; this run's devices "
            f"are {platform_name}: valid here: {', '.join(valid)}"
        )
