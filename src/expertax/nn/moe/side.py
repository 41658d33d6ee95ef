"""The MoE layer's side channel: what travels beside its tokens, as one optional pytree.

Two things ride beside a MoE layer's input, each optional: the paged stash (stash.py: the
routed experts' kept activations, written in the forward and read in the backward of the
stashed stack) and an imposed routing (`router.route`; `expertax parity --impose-routing`).
Every level of the layer takes one `Side` (or None) and gives back the side it leaves (the
stash written), so no level has a twin for either: `layer.apply`, `ep.apply` and the chunk
scans (chunks.py) thread it whole; the chunks cut `imposed` with the token rows and carry
`stash` from chunk to chunk; below routing only the stash goes on (the grouped matmuls and
the fused routed FFN take `stash=`).

A new per-token input of the layer (a per-token expert mask, a capacity hint) goes here as a
field: one place to add it, the specs (`specs`) and the chunking (`rows`) beside it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from jax.sharding import PartitionSpec as P

from expertax.nn.moe import stash as stash_mod
from expertax.nn.moe.stash import Stash


@dataclasses.dataclass(frozen=True)
class Side:
    """stash: the paged stash or None. imposed: int32 [..., K], the experts to use per token
    and slot where >= 0 ([B, T, K] at the layer, [N, K] per row chunk), or None."""

    stash: Stash | None = None
    imposed: jax.Array | None = None

    def with_stash(self, stash: Stash | None) -> Side:
        return dataclasses.replace(self, stash=stash)

    def rows(self) -> Side:
        """The side of the tokens flattened to rows: `imposed` [B, T, K] -> [B*T, K]."""
        if self.imposed is None or self.imposed.ndim == 2:
            return self
        return dataclasses.replace(self, imposed=self.imposed.reshape(-1, self.imposed.shape[-1]))


jax.tree_util.register_dataclass(Side, data_fields=["stash", "imposed"], meta_fields=[])

NONE = Side()


def of(side: Side | None) -> Side:
    """`side`, or the empty side for None."""
    return NONE if side is None else side


def specs(side: Side, tokens: P, mesh_axis_names) -> Side:
    """shard_map specs of a side: the stash per device (stash.py), `imposed` like the tokens."""
    imposed: Any = None if side.imposed is None else tokens
    return Side(stash=stash_mod.specs(side.stash, mesh_axis_names), imposed=imposed)
