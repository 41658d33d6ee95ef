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
A paged stash (stash.py), when given, is the scan's carry: each chunk writes (or reads) its rows
at the running offset.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from expertax.config.schema import Config
from expertax.nn.moe.stash import Stash
from expertax.parallel import remat

# fn(chunk, stash) -> (output, sums, stash): the sums are added over chunks (counts, score sums,
# drops); the stash (or None) is carried from chunk to chunk
ChunkFn = Callable[[jax.Array, Stash | None], tuple[jax.Array, Any, Stash | None]]


def scan_chunks(
    fn: ChunkFn, xs: Any, c: Config, stash: Stash | None = None
) -> tuple[Any, Any, Stash | None]:
    """`fn` over the leading (chunk) axis of `xs` (an array or a pytree of arrays): (outputs
    stacked on that axis, sums summed, stash).

    One chunk calls `fn` directly (no loop, the unchunked program). Several run `fn` under `c`'s
    remat policy in a scan. The sums are stacked by the scan and added after it, rather than
    carried: no carry whose varying mesh axes inside a `shard_map` would have to match the chunk's.
    """
    if jax.tree.leaves(xs)[0].shape[0] == 1:
        out, sums, stash = fn(jax.tree.map(lambda a: a[0], xs), stash)
        return jax.tree.map(lambda a: a[None], out), sums, stash

    def step(stash, x):
        out, sums, stash = fn(x, stash)
        return stash, (out, sums)

    step = remat.wrap_layer(step, c, prevent_cse=False)
    stash, (outs, sums) = jax.lax.scan(step, stash, xs)
    return outs, jax.tree.map(lambda s: jnp.sum(s, axis=0), sums), stash


def over_rows(
    fn: ChunkFn, x_ND: Any, c: Config, stash: Stash | None = None
) -> tuple[Any, Any, Stash | None]:
    """`fn` over `num_moe_token_chunks` consecutive row chunks [N/chunks, D]; outputs
    concatenated. `x_ND` and the outputs may be pytrees of per-row arrays [N, ...] (the token
    rows with an imposed routing, the output rows with the router's own choice)."""
    n = jax.tree.leaves(x_ND)[0].shape[0]
    num_chunks = c.num_moe_token_chunks
    if n % num_chunks:
        raise ValueError(
            f"num_moe_token_chunks={num_chunks} does not divide the {n} token rows of this shard; "
            "use a divisor of the tokens per batch shard"
        )
    xs = jax.tree.map(lambda a: a.reshape(num_chunks, n // num_chunks, *a.shape[1:]), x_ND)
    outs, sums, stash = scan_chunks(fn, xs, c, stash)
    return jax.tree.map(lambda a: a.reshape(n, *a.shape[2:]), outs), sums, stash


def over_positions(fn: Callable[[Any], tuple[Any, Any]], x_BTD: Any, c: Config) -> tuple[Any, Any]:
    """`fn` over `num_moe_token_chunks` chunks of the sequence axis [B, T/chunks, D] (the batch
    axis, sharded under GSPMD, stays whole in every chunk); outputs put back in position order.
    `x_BTD` and the outputs may be pytrees of per-position arrays [B, T, ...]."""
    b, t = jax.tree.leaves(x_BTD)[0].shape[:2]
    num_chunks = c.num_moe_token_chunks
    if t % num_chunks:
        raise ValueError(
            f"num_moe_token_chunks={num_chunks} does not divide the sequence length {t} "
            "(sparse_matmul=false chunks each sequence); use a divisor of max_target_length"
        )

    def split(a):  # [B, T, ...] -> [chunks, B, T/chunks, ...]
        return jnp.moveaxis(a.reshape(b, num_chunks, t // num_chunks, *a.shape[2:]), 1, 0)

    outs, sums, _ = scan_chunks(lambda x, s: (*fn(x), s), jax.tree.map(split, x_BTD), c)
    return jax.tree.map(lambda a: jnp.moveaxis(a, 0, 1).reshape(b, t, *a.shape[3:]), outs), sums
