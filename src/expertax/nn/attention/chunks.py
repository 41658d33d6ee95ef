"""Token chunks for attention (`num_attention_token_chunks`): a layer's queries one chunk of the
sequence at a time, against the keys and values of the whole sequence computed once.

Chunk i holds the query positions [i T/n, (i+1) T/n); its causal context is the keys before
its end. Each chunk (query projection, RoPE, kernel, output projection) runs under the layer's
remat policy (`jax.checkpoint` per chunk), so what a chunk holds for its backward pass (the
queries, the kernel's output and statistics, the output projection's input) is one chunk's.
The keys and values are inputs shared by every chunk, one buffer each. The outputs equal the
unchunked layer's: a query's softmax runs over the same keys either way. The cost: the
backward pass replays each chunk's forward once more (`steptime.attention_chunk_share`).

Two loops, by kernel:
- `dot` and `blockwise` take the query offset as a traced value (`kernel.SCANNED`): the chunks
  are a `lax.scan` against all the keys (the kernel masks or skips those after the chunk), so
  one chunk's buffers are alive at a time and the keys' and values' gradients are one
  accumulator, the scan's carry;
- `splash` builds its causal mask at trace time: the chunks are a Python loop, each against the
  keys up to its end (its mask aligned there: `kernel.attend`), unrolled in the layer's program
  and ordered by XLA's scheduler (`prevent_cse`: a chunk's replay must not merge with the
  layer's). cuDNN takes no chunk (`checks.check_attention_token_chunks`).
Names tagged inside a chunk are saved by the chunk's checkpoint, on device: the layers tag
`out_proj` on the chunks' joined output, and refuse host offload of the names a chunk computes
(`remat.QUERY_CHUNK_NAMES`).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from expertax.config.schema import Config
from expertax.nn.attention import kernel
from expertax.nn.attention.mask import CAUSAL, MaskSpec
from expertax.parallel import remat

# fn(x_chunk [B, T/n, D], positions_chunk [B, T/n], q_offset, end) -> [B, T/n, D]: the chunk's
# queries attend to the keys [0, end) (static) from key position q_offset on (None: end - T/n)
ChunkFn = Callable[[jax.Array, jax.Array, jax.Array | None, int], jax.Array]


def over_queries(
    fn: ChunkFn, x_BTD: jax.Array, positions_BT: jax.Array, c: Config, *, scan: bool
) -> jax.Array:
    """`fn` over `num_attention_token_chunks` consecutive chunks of the sequence axis, outputs
    in position order: a `lax.scan` with a traced query offset (`scan`), else a Python loop with
    static key ends. One chunk calls `fn` on the whole sequence directly."""
    n, t = c.num_attention_token_chunks, x_BTD.shape[1]
    if n == 1:
        return fn(x_BTD, positions_BT, None, t)
    if t % n:
        raise ValueError(
            f"num_attention_token_chunks={n} does not divide the sequence length {t}; use a "
            "divisor of max_target_length"
        )
    size = t // n
    if scan:
        b = x_BTD.shape[0]

        def split(a):  # [B, T, ...] -> [n, B, T/n, ...]
            return jnp.moveaxis(a.reshape(b, n, size, *a.shape[2:]), 1, 0)

        def step(_, xs):
            x, pos, offset = xs
            return None, fn(x, pos, offset, t)

        step = remat.wrap_layer(step, c, prevent_cse=False)
        offsets = jnp.arange(n, dtype=jnp.int32) * size
        _, outs = jax.lax.scan(step, None, (split(x_BTD), split(positions_BT), offsets))
        return jnp.moveaxis(outs, 0, 1).reshape(x_BTD.shape[0], t, *outs.shape[3:])
    outs = []
    for i in range(n):
        lo, end = i * size, (i + 1) * size
        chunk = remat.wrap_layer(lambda x, pos, end=end: fn(x, pos, None, end), c, prevent_cse=True)
        outs.append(chunk(x_BTD[:, lo:end], positions_BT[:, lo:end]))
    return jnp.concatenate(outs, axis=1)


def scanned(c: Config, length: int, qk_dim: int, v_dim: int, dtype) -> bool:
    """Whether the chunks of this layer's kernel run in a scan (module docstring)."""
    impl = kernel.resolve(
        c.attention_impl, length=length, qk_dim=qk_dim, v_dim=v_dim, dtype=dtype, chunked=True
    )
    return impl in kernel.SCANNED


def mean_offset(c: Config, length: int) -> float:
    """The chunks' mean query offset (for the blockwise loops' counted trips)."""
    n = c.num_attention_token_chunks
    return (n - 1) * (length // n) / 2


def attend_chunk(
    q, k, v, c: Config, segment_ids_BT, q_offset, end: int, scale: float, q_positions_BT,
    kv_positions_BS, sink_logits_H=None, mask_spec: MaskSpec = CAUSAL,
):  # fmt: skip
    """The kernel call of one chunk's queries `q` (at `q_positions_BT`) against the layer's keys
    and values (at `kv_positions_BS`) up to `end` (`over_queries`' ChunkFn arguments), with the
    layer's learned attention sinks if it has them, under `mask_spec` (a sliding window);
    [B, T/n, H, O]."""
    seg = None if segment_ids_BT is None else segment_ids_BT[:, :end]
    return kernel.attend(
        q,
        k[:, :end],
        v[:, :end],
        scale=scale,
        segment_ids_BT=seg,
        impl=c.attention_impl,
        q_offset=q_offset,
        mean_q_offset=mean_offset(c, k.shape[1]),
        q_positions_BT=q_positions_BT,
        kv_positions_BS=kv_positions_BS[:, :end],
        sink_logits_H=sink_logits_H,
        mask_spec=mask_spec,
    )
