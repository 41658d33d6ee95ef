"""cuDNN flash attention through `jax.nn.dot_product_attention(implementation="cudnn")`, with the
head dims padded to what it takes.

What the call takes (jax 0.10.2): bfloat16 or float16; one head dim for queries, keys and values
(its `value` must have the key's shape); that dim a multiple of 8 and at most 256 on Hopper and
later GPUs, 128 before. GQA is native (kv heads dividing query heads, never repeated).

Padding (`padded_head_dim`): q, k and v are zero-padded in the head dim to D = max(Q, O) rounded
up to a multiple of 8, and the output is sliced back to O. Zero columns add nothing to q.k, and
the softmax scale is passed explicitly (1/sqrt(Q) or the config's), so the scores are unchanged;
zero value columns give zero output columns, dropped. Gradients flow through the pad and slice.
What it costs for MLA (DeepSeek-V3: Q = 192, O = 128, v padded to 192): the attention matmuls per
(query, key) pair go from 2(Q + O) = 640 to 2(Q + Q) = 768 FLOPs forward (x1.20) and, with the
backward's five matmuls (QK^T again, dO V^T, P^T dO, dS K, dS^T Q), from 2(3Q + 2O) = 1664 to
2(5Q) = 1920 (x1.15); v, the output and its gradient are 1.5x the bytes ([B, T, H, 192] instead
of 128), the output being saved for the backward pass. Equal dims (GQA, Q = O multiple of 8) pad
nothing.

Masks: causal is cuDNN's own mask (`is_causal=True`, tiles above the diagonal skipped); a sliding
window of W positions (mask.py) is its sliding-window length W (`local_window_size=(W - 1, 0)`
in the JAX call), tiles before the window skipped too. Packed
documents have no native form in this API (its `query_seq_lengths` are padding lengths, not
segments): they go in as a boolean [B, 1, T, S] mask, which JAX turns into an additive bias, so
that case materializes one [T, S] matrix per sequence (not per head) and reads it in every tile.
The bias path needs even lengths when training; an odd length is padded by one position (a key
after every real query, hidden by causality; its query row dropped).

`head_dim_limit()`: JAX checks the head dim against the GPU of the *tracing process's default
backend*, not the devices a program is compiled for, so a compile for a GPU target from a CPU
machine (`--target gpu:...`) is held to 128 even for an H100: MLA's 192 then cannot use cuDNN
there, though it can on the H100 itself.
"""

from __future__ import annotations

import importlib.util

import jax
import jax.numpy as jnp

from expertax.config.schema import Config
from expertax.errors import ConfigError

DTYPES = (jnp.bfloat16, jnp.float16)
# cuDNN flash attention's head dims (Hopper and later): one dim for q, k and v, a multiple of 8 up
# to 256 (128 before Hopper); `padded_head_dim` pads to it.
MAX_HEAD_DIM = 256
HEAD_DIM_MULTIPLE = 8
PRE_HOPPER_MAX_HEAD_DIM = 128


def padded_head_dim(qk_dim: int, v_dim: int) -> int:
    """The one head dim q, k and v are zero-padded to for cuDNN: the larger, up to a multiple
    of 8."""
    return -(-max(qk_dim, v_dim) // HEAD_DIM_MULTIPLE) * HEAD_DIM_MULTIPLE


def check(c: Config) -> None:
    """What cuDNN flash attention (through jax.nn.dot_product_attention) cannot take, once the
    head dims are padded to one multiple of 8 (MLA's v to the q/k dim); the platform is checked
    against the mesh's devices (`kernel.check_platform`)."""
    if c.attention_impl != "cudnn":
        return
    qk, v = c.qk_head_dim, c.attn_v_head_dim
    padded = padded_head_dim(qk, v)
    if padded > MAX_HEAD_DIM:
        raise ConfigError(
            f"attention_impl=cudnn takes head dims up to {MAX_HEAD_DIM}; attention_type="
            f"{c.attention_type} has q/k {qk} and v {v} (padded: {padded}): use "
            "attention_impl=blockwise, dot or auto"
        )
    if c.dtype not in ("bfloat16", "float16"):
        raise ConfigError(
            f"attention_impl=cudnn (a GPU kernel) needs dtype=bfloat16 or float16 (got dtype="
            f"{c.dtype}): on a GPU change dtype; elsewhere use attention_impl=blockwise, dot or "
            "auto"
        )
    n = c.num_attention_token_chunks
    if n != 1:
        raise ConfigError(
            f"num_attention_token_chunks={n} with attention_impl=cudnn: cuDNN's causal mask "
            "(through jax.nn.dot_product_attention) is aligned to the first key, and a chunk's "
            "queries sit after earlier keys; use num_attention_token_chunks=1, or "
            "attention_impl=auto or blockwise"
        )


def head_dim_limit() -> int:
    """The largest head dim `jax.nn.dot_product_attention` accepts in this process: 256 when
    JAX's default backend is a GPU of compute capability 9.0 or more, else 128."""
    if jax.default_backend() != "gpu":
        return PRE_HOPPER_MAX_HEAD_DIM
    capability = getattr(jax.devices()[0], "compute_capability", "0.0")
    major = int(str(capability).split(".")[0])
    return MAX_HEAD_DIM if major >= 9 else PRE_HOPPER_MAX_HEAD_DIM


def available() -> bool:
    """Whether this process can trace a cuDNN call: a GPU backend starts only with cuDNN; a
    compile for a GPU target from another machine needs the `nvidia-cudnn-cu12` wheel (the
    `gpu` extra), from which the CUDA plugin loads it."""
    if jax.default_backend() == "gpu":
        return True
    try:
        return importlib.util.find_spec("nvidia.cudnn") is not None
    except ModuleNotFoundError:  # no `nvidia` namespace at all
        return False


def unusable_because(qk_dim: int, v_dim: int, dtype, limit: int | None = None) -> str | None:
    """Why cuDNN cannot take these dims and dtype (after padding) in this process, or None."""
    if not available():
        return "needs cuDNN, not installed here (pip install 'expertax[gpu]')"
    if jnp.dtype(dtype) not in [jnp.dtype(d) for d in DTYPES]:
        return f"needs bfloat16 or float16 activations, got {jnp.dtype(dtype).name}"
    d = padded_head_dim(qk_dim, v_dim)
    limit = head_dim_limit() if limit is None else limit
    if d > limit:
        where = "this process" if limit < MAX_HEAD_DIM else "cuDNN"
        return (
            f"head dims q/k {qk_dim}, v {v_dim} pad to {d}, above the {limit} that {where} "
            "takes" + (" (JAX checks the default backend's GPU)" if limit < MAX_HEAD_DIM else "")
        )
    return None


def _pad_last(x, size: int):
    return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, size - x.shape[-1])])


def _pad_length(x, length: int):
    return jnp.pad(x, [(0, 0), (0, length - x.shape[1])] + [(0, 0)] * (x.ndim - 2))


def _cudnn_flash(q, k, v, mask, scale, window=None):
    return jax.nn.dot_product_attention(
        q, k, v, mask=mask, scale=scale, is_causal=True, implementation="cudnn",
        local_window_size=None if window is None else (window - 1, 0),
    )  # fmt: skip


def attend_cudnn(
    q_BTHQ: jax.Array,
    k_BSGQ: jax.Array,
    v_BSGO: jax.Array,
    *,
    scale: float,
    segment_ids_BT: jax.Array | None = None,
    window: int | None = None,
    flash=_cudnn_flash,
) -> jax.Array:
    """Causal cuDNN flash attention, within a sliding `window` of positions where given, head
    dims padded; returns [B, T, H, O] like `attend_dot`.

    `flash(q, k, v, mask, scale, window)` is the call with equal head dims; tests pass a
    stand-in (the same API's XLA implementation) to check the padding, masks and gradients on a
    CPU."""
    qk_dim, v_dim = q_BTHQ.shape[-1], v_BSGO.shape[-1]
    if k_BSGQ.shape[1] != q_BTHQ.shape[1]:
        raise ValueError(
            f"attention_impl=cudnn with {q_BTHQ.shape[1]} query and {k_BSGQ.shape[1]} key "
            "positions: jax.nn.dot_product_attention aligns cuDNN's causal mask top-left, and "
            "a token chunk's queries need it aligned at the end of the keys; use "
            "num_attention_token_chunks=1 or attention_impl=blockwise"
        )
    if flash is _cudnn_flash:
        why = unusable_because(qk_dim, v_dim, q_BTHQ.dtype)
        if why:
            raise ValueError(f"attention_impl=cudnn {why}: use attention_impl=auto or blockwise")
    d = padded_head_dim(qk_dim, v_dim)
    q, k, v = (_pad_last(x, d) for x in (q_BTHQ, k_BSGQ, v_BSGO))
    t = q.shape[1]
    mask = None
    if segment_ids_BT is not None:
        padded = t + t % 2
        q, k, v = (_pad_length(x, padded) for x in (q, k, v))
        seg = _pad_length(segment_ids_BT, padded)
        mask = (seg[:, :, None] == seg[:, None, :])[:, None]
    return flash(q, k, v, mask, scale, window)[:, :t, :, :v_dim]
