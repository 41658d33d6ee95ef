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
    fn: ChunkFn, xs: jax.Array, c: Config, stash: Stash | None = None
) -> tuple[jax.Array, Any, Stash | None]:
    """`fn` over the leading (chunk) axis of `xs`: (outputs stacked on that axis, sums summed,
    stash).

    One chunk calls `fn` directly (no loop, the unchunked program). Several run `fn` under `c`'s
    remat policy in a scan. The sums are stacked by the scan and added after it, rather than
    carried: no carry whose varying mesh axes inside a `shard_map` would have to match the chunk's.
    """
    if xs.shape[0] == 1:
        out, sums, stash = fn(xs[0], stash)
        return out[None], sums, stash

    def step(stash, x):
        out, sums, stash = fn(x, stash)
        return stash, (out, sums)

    step = remat.wrap_layer(step, c, prevent_cse=False)
    stash, (outs, sums) = jax.lax.scan(step, stash, xs)
    return outs, jax.tree.map(lambda s: jnp.sum(s, axis=0), sums), stash


def over_rows(
    fn: ChunkFn, x_ND: jax.Array, c: Config, stash: Stash | None = None
) -> tuple[jax.Array, Any, Stash | None]:
    """`fn` over `num_moe_token_chunks` consecutive row chunks [N/chunks, D]; outputs
    concatenated."""
    n, d = x_ND.shape
    num_chunks = c.num_moe_token_chunks
    if n % num_chunks:
        raise ValueError(
            f"num_moe_token_chunks={num_chunks} does not divide the {n} token rows of this shard; "
            "use a divisor of the tokens per batch shard"
        )
    outs, sums, stash = scan_chunks(fn, x_ND.reshape(num_chunks, n // num_chunks, d), c, stash)
    return outs.reshape(n, outs.shape[-1]), sums, stash


def over_positions(
    fn: Callable[[jax.Array], tuple[jax.Array, Any]], x_BTD: jax.Array, c: Config
) -> tuple[jax.Array, Any]:
    """`fn` over `num_moe_token_chunks` chunks of the sequence axis [B, T/chunks, D] (the batch
    axis, sharded under GSPMD, stays whole in every chunk); outputs put back in position order."""
    b, t, d = x_BTD.shape
    num_chunks = c.num_moe_token_chunks
    if t % num_chunks:
        raise ValueError(
            f"num_moe_token_chunks={num_chunks} does not divide the sequence length {t} "
            "(sparse_matmul=false chunks each sequence); use a divisor of max_target_length"
        )
    xs = x_BTD.reshape(b, num_chunks, t // num_chunks, d).transpose(1, 0, 2, 3)
    outs, sums, _ = scan_chunks(lambda x, s: (*fn(x), s), xs, c)
    return outs.transpose(1, 0, 2, 3).reshape(b, t, outs.shape[-1]), sums
