"""Expert biases (`moe_expert_bias`, GPT-OSS): a gate, an up and a down bias per routed expert.

GPT-OSS's experts compute `act(x W_gate + b_gate, x W_up + b_up) W_down + b_down`. The biases
are added after the grouped matmuls by each sorted row's expert (its group), so no grouped
matmul kernel changes: `rows` looks the expert's bias up for every row, zero for the rows past
the groups (the padding of an expert-parallel receive buffer). Under tensor parallelism of the
expert MLP dim F the down bias is counted on one F shard only (`once_over`), the others'
partial outputs are psum-reduced with it.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from expertax.nn.param import ParamSpec, given


class ExpertBias(NamedTuple):
    gate_EF: jax.Array
    up_EF: jax.Array
    down_ED: jax.Array


def specs(e: int, d: int, f: int) -> dict[str, ParamSpec]:
    """The MoE layer's bias fields (`bi_0`, `bi_1`: [E, F]; `bo`: [E, D]), zero at init."""
    gate_up = ParamSpec((e, f), ("exp", "exp_mlp"), "zeros", weight_decay=False)
    return dict(bi_0=gate_up, bi_1=gate_up, bo=ParamSpec((e, d), ("exp", None), "zeros",
                                                             weight_decay=False))  # fmt: skip


def of(p) -> ExpertBias | None:
    """The MoE layer `p`'s expert biases, None where it has none."""
    if given(getattr(p, "bo", None)) is None:
        return None
    return ExpertBias(p.bi_0, p.bi_1, p.bo)


def row_experts(group_sizes_E: jax.Array, m: int, group_offset=None) -> jax.Array:
    """The expert (group) of each of `m` rows sorted by group, int32 [M]; E for the rows past
    the groups. `group_offset`: the groups are experts from that index on."""
    ends = jnp.cumsum(group_sizes_E)
    ids = jnp.searchsorted(ends, jnp.arange(m, dtype=ends.dtype), side="right")
    return ids if group_offset is None else ids + group_offset


def rows(b_EX: jax.Array, ids_M: jax.Array, dtype) -> jax.Array:
    """Each row's expert's bias [M, X] in `dtype`; zero for an id past the experts."""
    return jnp.take(b_EX.astype(dtype), ids_M, axis=0, mode="fill", fill_value=0)


def once_over(bias: ExpertBias | None, axes: tuple[str, ...]) -> ExpertBias | None:
    """Inside a shard_map whose expert MLP dim is split over `axes`: the down bias on the first
    F shard, zero on the others (their partial outputs are summed with it)."""
    if bias is None or not axes:
        return bias
    first = jnp.all(jnp.stack([jax.lax.axis_index(a) == 0 for a in axes]))
    return bias._replace(down_ED=jnp.where(first, bias.down_ED, jnp.zeros_like(bias.down_ED)))
