"""Which MoE dispatch runs for a config and a mesh, decided once, and its one-line description.

`moe.layer.apply` runs the sparse path inside `ep.apply`'s `shard_map` exactly when
`uses_shard_map` says so (sparse dispatch and a mesh of more than one device); otherwise the plain
sorted path (one device) or the one-hot einsum path (under GSPMD when a mesh is set) runs. Inside
the `shard_map`, the exchange over the `expert` axis is the ring of experts or the all-to-all
(`use_ring_of_experts`); with an expert axis of size one there is no exchange at all.
`describe_dispatch` states the same decisions for the run's log (docs/design/ep.md).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

from jax.sharding import PartitionSpec

from expertax import platform
from expertax.config.schema import Config
from expertax.errors import ConfigError
from expertax.sharding.rules import Rules

BATCH_AXES = ("data", "fsdp", "expert", "pipeline")
EXPERT = "expert"
CONTEXT = "context"


def uses_shard_map(c: Config, mesh_size: int) -> bool:
    """True when the MoE layer runs `ep.apply` (its `shard_map`): sparse dispatch, mesh > 1."""
    return c.sparse_matmul and mesh_size > 1


def token_axes(rules: Rules | None) -> tuple[str, ...]:
    """Mesh axes the MoE input tokens are sharded over: the rules' `batch` entry (batch axes),
    then `length`'s (the context axis: a sequence's tokens keep their context split)."""
    specs = moe_specs(rules)
    return specs.tokens + specs.seq


@dataclasses.dataclass(frozen=True)
class MoESpecs:
    """The MoE `shard_map`'s layout, read from the rules table (`ep.apply`'s in/out specs).

    tokens: mesh axes of the token rows (rule `batch`); seq: of the sequence dim (rule
    `length`: `context`, so the tokens enter the exchange with their context split); expert:
    the mesh axis of the expert dim E while the layer computes (rule `act_exp`: the
    exchange's collectives run over it); mlp: mesh
    axes of the expert MLP dim F (rule `exp_mlp`), whose partial outputs are psum-reduced. Weights
    stored otherwise (`exp_embed` over fsdp, `shard_exp_on_fsdp`'s `exp`) are resharded to this
    layout at the `shard_map` boundary.
    """

    tokens: tuple[str, ...]
    expert: str
    mlp: tuple[str, ...]
    seq: tuple[str, ...] = ()  # mesh axes of the sequence dim T (rule `length`: context)

    @property
    def x(self) -> PartitionSpec:  # [B, T, D]
        if self.seq:
            return PartitionSpec(self.tokens, self.seq)
        return PartitionSpec(self.tokens)

    @property
    def wi(self) -> PartitionSpec:  # [E, D, F]
        return PartitionSpec(self.expert, None, self.mlp or None)

    @property
    def wo(self) -> PartitionSpec:  # [E, F, D]
        return PartitionSpec(self.expert, self.mlp or None, None)


def moe_specs(rules: Rules | None) -> MoESpecs:
    """The layer's layout from `rules` (defaults without a table); ConfigError when the table
    asks for a layout the layer cannot compute (named key, value and what is valid)."""
    rules = rules or {}
    tokens = tuple(rules.get("batch", BATCH_AXES))
    expert = tuple(rules.get("act_exp", (EXPERT,)))
    mlp = tuple(rules.get("exp_mlp", ("tensor",)))
    seq = tuple(rules.get("length", ()))
    if any(a != CONTEXT for a in seq):
        raise ConfigError(
            f"sharding_rules: length -> {list(seq)}: the sequence dim of the MoE layer's tokens "
            f"is split only over the {CONTEXT!r} mesh axis; valid: [] or [{CONTEXT}]"
        )
    bad = [a for a in tokens if a not in BATCH_AXES]
    if bad:
        raise ConfigError(
            f"sharding_rules: batch -> {list(tokens)}: the MoE layer shards tokens only over "
            f"batch axes; valid: a subset of {list(BATCH_AXES)} ({bad} is not)"
        )
    if expert != (EXPERT,):
        raise ConfigError(
            f"sharding_rules: act_exp -> {list(expert)}: the MoE layer's expert-parallel "
            f"exchange runs over the {EXPERT!r} mesh axis; valid: [{EXPERT}]"
        )
    clash = [a for a in mlp if a in tokens or a in seq or a == EXPERT]
    if clash:
        raise ConfigError(
            f"sharding_rules: exp_mlp -> {list(mlp)}: {clash} already shard the tokens or the "
            f"experts; valid: mesh axes outside batch and act_exp, e.g. [tensor]"
        )
    return MoESpecs(tokens=tokens, expert=EXPERT, mlp=mlp, seq=seq)


# The platforms whose XLA backend implements `ragged_all_to_all` (XLA:CPU does not: a program
# using it compiles, then fails at run time with "UNIMPLEMENTED: HLO opcode ragged-all-to-all").
RAGGED_A2A_PLATFORMS = ("gpu", "tpu")


def a2a_impls(backend: str) -> tuple[str, ...]:
    """The all-to-all implementations platform `backend` has, the preferred one first."""
    has_ragged = platform.normalize(backend) in RAGGED_A2A_PLATFORMS
    return ("ragged", "padded") if has_ragged else ("padded",)


def resolve_a2a_impl(c: Config, backend: str | None = None) -> str:
    """`ragged` or `padded`: `auto` picks ragged where XLA implements it (GPU, TPU)."""
    if c.a2a_impl != "auto":
        return c.a2a_impl
    return a2a_impls(backend or platform.current())[0]


def check_exchange(c: Config, on: str, mesh_shape: Mapping[str, int]) -> None:
    """ConfigError when the expert exchange `c` asks for cannot run on platform `on` with a mesh
    of `mesh_shape`: `a2a_impl=ragged` where XLA has no ragged all-to-all (before any
    compilation, which would take minutes and then fail at run time)."""
    ep = mesh_shape.get(EXPERT, 1)
    runs = c.is_moe and uses_shard_map(c, math.prod(mesh_shape.values()))
    if not runs or ep == 1 or c.use_ring_of_experts:
        return
    valid = a2a_impls(on)
    if c.a2a_impl != "auto" and c.a2a_impl not in valid:
        raise ConfigError(
            f"a2a_impl={c.a2a_impl} with expert parallelism ({EXPERT}={ep}) on {on}: XLA on "
            f"{on} has no ragged all-to-all (only {', '.join(RAGGED_A2A_PLATFORMS)} do); valid "
            f"here: a2a_impl={' or '.join(('auto', *valid))}, or use_ring_of_experts=true"
        )


def _capacity(c: Config) -> str:
    return "dropless" if c.capacity_factor == -1 else f"capacity_factor={c.capacity_factor}"


def _buffer(c: Config) -> str:
    if c.ragged_buffer_factor <= 0:
        return "worst-case receive buffer (dropless)"
    return f"receive buffer {c.ragged_buffer_factor} x routed rows (overflow counted as dropped)"


def describe_dispatch(
    c: Config, mesh_shape: Mapping[str, int], rules: Rules, *, backend: str | None = None
) -> str:
    """One line for the run's log: the MoE dispatch that runs for `c` on a mesh of `mesh_shape`.

    `mesh_shape` maps mesh axis names to sizes (`sharding.mesh.mesh_shape(c, ...)` or
    `dict(mesh.shape)`); `rules` is the run's rules table (`config.config_rules(c)`); `backend`
    is the mesh's platform (`expertax.platform`; it picks `a2a_impl=auto`), by default the one
    being traced for.
    """
    if not c.is_moe:
        return "MoE dispatch: none (dense model)"
    mesh_size = math.prod(mesh_shape.values())
    if not c.sparse_matmul:
        where = " under GSPMD" if mesh_size > 1 else " on one device"
        return f"MoE dispatch: one-hot einsum (capacity_einsum){where} ({_capacity(c)})"
    if not uses_shard_map(c, mesh_size):
        return "MoE dispatch: sparse, sorted grouped matmuls on one device (dropless, no exchange)"
    ep = mesh_shape.get(EXPERT, 1)
    axes = [a for a in token_axes(rules) if mesh_shape.get(a, 1) > 1]
    tokens = "tokens over " + ",".join(axes) if axes else "tokens replicated"
    head = f"MoE dispatch: sparse, shard_map ({tokens}), expert={ep}"
    if ep == 1:
        line = f"{head}: all {c.num_experts} experts on every shard, no exchange"
        if not c.use_ring_of_experts and 0 < c.ragged_buffer_factor < 1:
            line += f", {_buffer(c)}"
        return line
    if c.use_ring_of_experts:
        split = EXPERT in token_axes(rules)
        steps = "all-gather, local experts, reduce-scatter" if split else "local experts, psum"
        return f"{head}: ring of experts ({steps})"
    impl = resolve_a2a_impl(c, backend)
    on = backend or platform.current()
    return f"{head}: all-to-all a2a_impl={c.a2a_impl} -> {impl} on {on}, {_buffer(c)}"
