"""Which keys a query reads: the mask spec, and the mask built from positions.

Every attention call says where its queries and keys sit (their positions in the sequence) and
what a query may read (`MaskSpec`); the mask is computed from those, never from where a row sits
in an array. Training passes its batch's positions (each document's from 0, with segment ids
separating packed documents); decoding passes the new tokens' positions and the cache's slot
positions (slot j holds position j). So a query chunk, a cache and a sequence shard (context
parallelism) need no kernel of their own: only other positions.

Kinds (`MaskSpec`), combined: `causal` (a key at or before the query's position); `window`
(sliding window: the key at most `window` - 1 positions back, Mistral's and GPT-OSS's local
layers); `chunk` (chunked attention: the key in the same run of `chunk` positions, Llama 4's
local layers); `sinks` (the first `sinks` positions stay visible through the window or the chunk,
StreamingLLM's attention sinks). Keys of another document (segment id) are never read.

Which kernel honours what: `dot` builds any spec from the positions (`allowed`), and so does
`blockwise` inside each block pair it visits, for a causal spec (it skips the key rows after
each query row). `splash` and `cudnn` take their mask from their library, built at trace time
by row: causal from the queries' offset into the keys, and a sliding window as the library's
own local mask (splash's `LocalMask`, cuDNN's sliding-window length), whose tiles outside the
window are skipped. By row equals by position for what training passes (each document's
positions count up by one from its first row, and segment ids separate the documents): the
row distance of a query and a key of one document is their position distance. Chunks and sinks
are not row distances (a document's chunks start at its own position 0, and its sinks are its
first positions, wherever its rows sit), so these two kernels refuse them. `unsupported` says
why, and `kernel.resolve` calls it before anything is traced.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class MaskSpec:
    causal: bool = True
    window: int | None = None
    chunk: int | None = None
    sinks: int = 0

    def __post_init__(self):
        for name in ("window", "chunk"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"attention mask {name}={value}: a positive number of positions")
        if self.sinks < 0:
            raise ValueError(f"attention mask sinks={self.sinks}: zero or more positions")

    @property
    def plain_causal(self) -> bool:
        """Causal and nothing else (what every kernel honours)."""
        return self.causal and self.window is None and self.chunk is None and self.sinks == 0


CAUSAL = MaskSpec()


def allowed(
    spec: MaskSpec,
    q_positions_BT: jax.Array,
    kv_positions_BS: jax.Array,
    q_segment_ids_BT: jax.Array | None = None,
    kv_segment_ids_BS: jax.Array | None = None,
) -> jax.Array:
    """[B, T, S] booleans: query (b, t) reads key (b, s). Positions broadcast over a batch of 1."""
    q = q_positions_BT[:, :, None]
    kv = kv_positions_BS[:, None, :]
    ok = jnp.ones(jnp.broadcast_shapes(q.shape, kv.shape), bool)
    if spec.causal:
        ok = kv <= q
    local = None
    if spec.window is not None:
        local = q - kv < spec.window
    if spec.chunk is not None:
        same = q // spec.chunk == kv // spec.chunk
        local = same if local is None else local & same
    if local is not None:
        ok = ok & (local | (kv < spec.sinks)) if spec.sinks else ok & local
    if q_segment_ids_BT is not None and kv_segment_ids_BS is not None:
        ok = ok & (q_segment_ids_BT[:, :, None] == kv_segment_ids_BS[:, None, :])
    return ok


def unsupported(spec: MaskSpec, impl: str) -> str | None:
    """Why kernel `impl` cannot honour `spec` (None: it can)."""
    if impl == "dot" or spec.plain_causal:
        return None
    if impl == "blockwise":
        if spec.causal:
            return None
        return (
            f"attention_impl=blockwise skips the keys after each query, so it needs a causal mask; "
            f"{spec} needs attention_impl=dot"
        )
    if spec.causal and spec.chunk is None and spec.sinks == 0:  # causal, sliding window
        return None
    return (
        f"attention_impl={impl} builds its mask by row (causal, sliding window), and {spec} "
        "is not a row rule; it needs attention_impl=dot, or blockwise where the spec is causal"
    )


def by_row(spec: MaskSpec) -> bool:
    """Whether the library kernels (splash, cuDNN) build `spec`: causal, with or without a
    sliding window (see the module docstring)."""
    return unsupported(spec, "splash") is None
