"""Token chunks: the MoE layer over its tokens one chunk at a time (`num_moe_token_chunks`).

Each chunk is routed, dispatched (sorted, exchanged or gathered), run through the experts and
combined on its own inside one `lax.scan`, so the dropless worst-case temporaries (the sorted
rows, the all-to-all receive buffer and its padded per-peer blocks, the ring's gathered rows, the
einsum's one-hot dispatch tensor) are sized for one chunk, not for all tokens. Routing is per
token, so the outputs equal the unchunked layer's; the per-expert counts, score sums and drops
are summed over the chunks and the balancing statistics are computed once from the sums
(`router.balance_stats`), so they stay global. The chunk function runs under the layer's remat
policy (`jax.checkpoint` per chunk): the scan keeps, per chunk, only its input and the names the
policy saves (`moe_mlpwi_0`, ... stacked by the scan), never a chunk's worst-case buffers, which
would otherwise be stacked over all chunks for the backward pass and undo the chunking (the cost:
the backward recomputes each chunk's forward once more). remat_policy=none saves everything.
The layer's side channel (side.py) goes with the chunks: an imposed routing is cut with the
token rows, and a paged stash (stash.py) is the scan's carry: each chunk writes (or reads) its
rows at the running offset.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from expertax.config.schema import Config
from expertax.nn.moe.side import Side
from expertax.nn.moe.side import of as side_of
from expertax.nn.moe.stash import Stash
from expertax.parallel import remat

# fn(chunk, side) -> (output, sums, side): the sums are added over chunks (counts, score sums,
# drops); the side's `imposed` is the chunk's rows of it, its stash (or None) is carried from
# chunk to chunk
ChunkFn = Callable[[Any, Side], tuple[Any, Any, Side]]


def scan_chunks(
    fn: ChunkFn, xs: Any, imposed: jax.Array | None, c: Config, stash: Stash | None = None
) -> tuple[Any, Any, Stash | None]:
    """`fn` over the leading (chunk) axis of `xs` (an array or a pytree of arrays) and of
    `imposed` (or None): (outputs stacked on that axis, sums summed, stash).

    One chunk calls `fn` directly (no loop, the unchunked program). Several run `fn` under `c`'s
    remat policy in a scan. The sums are stacked by the scan and added after it, rather than
    carried: no carry whose varying mesh axes inside a `shard_map` would have to match the chunk's.
    """
    if jax.tree.leaves(xs)[0].shape[0] == 1:
        first = lambda a: a[0]  # noqa: E731
        out, sums, side = fn(jax.tree.map(first, xs), Side(stash, jax.tree.map(first, imposed)))
        return jax.tree.map(lambda a: a[None], out), sums, side.stash

    def step(stash, chunk):
        x, imposed = chunk
        out, sums, side = fn(x, Side(stash, imposed))
        return side.stash, (out, sums)

    step = remat.wrap_layer(step, c, prevent_cse=False)
    stash, (outs, sums) = jax.lax.scan(step, stash, (xs, imposed))
    return outs, jax.tree.map(lambda s: jnp.sum(s, axis=0), sums), stash


def over_rows(fn: ChunkFn, x_ND: Any, c: Config, side: Side | None = None) -> tuple[Any, Any, Side]:
    """`fn` over `num_moe_token_chunks` consecutive row chunks [N/chunks, D]; outputs
    concatenated, and the side (`imposed` as rows [N, K]) with the stash the chunks left.
    `x_ND` and the outputs may be pytrees of per-row arrays [N, ...] (the output rows with the
    router's own choice)."""
    side = side_of(side).rows()
    n = jax.tree.leaves(x_ND)[0].shape[0]
    num_chunks = c.num_moe_token_chunks
    if n % num_chunks:
        raise ValueError(
            f"num_moe_token_chunks={num_chunks} does not divide the {n} token rows of this shard; "
            "use a divisor of the tokens per batch shard"
        )
    split = lambda a: a.reshape(num_chunks, n // num_chunks, *a.shape[1:])  # noqa: E731
    imposed = jax.tree.map(split, side.imposed)
    outs, sums, stash = scan_chunks(fn, jax.tree.map(split, x_ND), imposed, c, side.stash)
    return jax.tree.map(lambda a: a.reshape(n, *a.shape[2:]), outs), sums, side.with_stash(stash)


def over_positions(
    fn: Callable[[Any, Side], tuple[Any, Any]], x_BTD: Any, c: Config, side: Side | None = None
) -> tuple[Any, Any]:
    """`fn(chunk, side)` over `num_moe_token_chunks` chunks of the sequence axis [B, T/chunks, D]
    (the batch axis, sharded under GSPMD, stays whole in every chunk; the side's `imposed`
    [B, T, K] is cut alike; no stash); outputs put back in position order. `x_BTD` and the
    outputs may be pytrees of per-position arrays [B, T, ...]."""
    b, t = jax.tree.leaves(x_BTD)[0].shape[:2]
    num_chunks = c.num_moe_token_chunks
    if t % num_chunks:
        raise ValueError(
            f"num_moe_token_chunks={num_chunks} does not divide the sequence length {t} "
            "(sparse_matmul=false chunks each sequence); use a divisor of max_target_length"
        )

    def split(a):  # [B, T, ...] -> [chunks, B, T/chunks, ...]
        return jnp.moveaxis(a.reshape(b, num_chunks, t // num_chunks, *a.shape[2:]), 1, 0)

    imposed = jax.tree.map(split, side_of(side).imposed)
    outs, sums, _ = scan_chunks(lambda x, s: (*fn(x, s), s), jax.tree.map(split, x_BTD), imposed, c)
    return jax.tree.map(lambda a: jnp.moveaxis(a, 0, 1).reshape(b, t, *a.shape[3:]), outs), sums
