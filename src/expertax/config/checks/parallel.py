"""Field-against-field checks of the layout: pipeline, parallelism sizes, the sparse path's
buffers and tiles, token chunks, context parallelism, the paged stash's sizes."""

from __future__ import annotations

from expertax.config.checks.hints import divisors
from expertax.config.schema import Config
from expertax.errors import ConfigError


def check_pipeline(c: Config) -> None:
    """Pipeline keys that the config alone can refute (the batch is checked by the trainer)."""
    m, r, s = c.num_pipeline_microbatches, c.num_pipeline_repeats, c.pipeline_stages
    if m == 0 or m < -1:
        raise ConfigError(
            f"num_pipeline_microbatches={m}: use a positive count or -1 (= the stages, {s})"
        )
    n = c.pipeline_parallel_layers
    stack = c.num_moe_layers if c.is_moe else c.num_dense_layers
    name = "MoE" if c.is_moe else "dense"
    if n == 0 or n < -1 or n > stack:
        raise ConfigError(
            f"pipeline_parallel_layers={n}: use -1 (the whole {name} stack, {stack} layers) or "
            f"1..{stack}"
        )
    if s == 1:
        if r != 1:
            raise ConfigError(
                f"num_pipeline_repeats={r} needs pipeline stages; set ici_pipeline_parallelism > 1 "
                "or num_pipeline_repeats=1"
            )
        return
    layers = c.pipelined_layers
    if layers % (s * r):
        raise ConfigError(
            f"pipeline_parallel_layers: the {layers} pipelined {name} layers do not divide into "
            f"{s} stages x num_pipeline_repeats={r}; valid repeats divide {layers // s} "
            f"(with {s} stages), or change the stages"
            if layers % s == 0
            else f"ici_pipeline_parallelism x dcn_pipeline_parallelism = {s} stages: the {layers} "
            f"pipelined {name} layers do not divide into {s} stages x {r} repeats"
        )
    if r > 1 and c.pipeline_microbatches % s:
        raise ConfigError(
            f"num_pipeline_microbatches={c.pipeline_microbatches} with num_pipeline_repeats={r}: "
            f"the circular schedule needs a multiple of the {s} stages"
        )
    if c.moe_paged_stash:
        raise ConfigError(
            "moe_paged_stash=true with pipeline stages: the paged stash runs the MoE stack as one "
            "custom-VJP scan, not as pipeline stages; set moe_paged_stash=false or "
            "ici_pipeline_parallelism=1"
        )


def check_parallelism_values(c: Config) -> None:
    for prefix in ("ici", "dcn"):
        axes = ("data", "fsdp", "context", "expert", "tensor")
        keys = [f"{prefix}_{a}_parallelism" for a in axes]
        fills = [k for k in keys if getattr(c, k) == -1]
        if len(fills) > 1:
            raise ConfigError(f"only one {prefix}_*_parallelism may be -1; got {', '.join(fills)}")
        for k in keys:
            if getattr(c, k) == 0 or getattr(c, k) < -1:
                raise ConfigError(f"{k}={getattr(c, k)}: use a positive size or -1 (the rest)")


def check_ragged_buffer(c: Config) -> None:
    rb = c.ragged_buffer_factor
    if rb != -1 and rb <= 0:
        raise ConfigError(f"ragged_buffer_factor={rb}: use -1 (worst case, dropless) or > 0")
    if rb != -1 and (c.use_ring_of_experts or not c.sparse_matmul):
        raise ConfigError(
            f"ragged_buffer_factor={rb} caps the all-to-all receive buffer of the sparse path; it "
            f"does not apply with use_ring_of_experts={c.use_ring_of_experts} "
            f"sparse_matmul={c.sparse_matmul}; set ragged_buffer_factor=-1"
        )


def check_ring_of_experts(c: Config) -> None:
    if c.use_ring_of_experts and not c.sparse_matmul:
        raise ConfigError(
            "use_ring_of_experts=true is a strategy of the sparse path; set sparse_matmul=true "
            "or use_ring_of_experts=false"
        )


def check_gmm_tiles(c: Config) -> None:
    lo, hi = c.gmm_tile_rows_min, c.gmm_tile_rows
    if lo & (lo - 1) or lo > hi:
        raise ConfigError(
            f"gmm_tile_rows_min={lo} must be a power of two no larger than gmm_tile_rows={hi}"
        )


def check_moe_token_chunks(c: Config) -> None:
    """Chunks must split the tokens evenly and leave the numbers unchanged (a layout key): no
    per-chunk caps. Divisibility by the tokens per batch shard needs the mesh (check_mesh_fit)."""
    n = c.num_moe_token_chunks
    if n == 1:
        return
    t = c.max_target_length
    if not c.sparse_matmul and t % n:
        raise ConfigError(
            f"num_moe_token_chunks={n} does not divide max_target_length={t} (sparse_matmul=false "
            f"chunks each sequence); use a divisor such as {divisors(t)}"
        )
    for key, value in (
        ("capacity_factor", c.capacity_factor),
        ("ragged_buffer_factor", c.ragged_buffer_factor),
    ):
        if value != -1:
            raise ConfigError(
                f"num_moe_token_chunks={n} with {key}={value}: a cap would apply per chunk and "
                f"change what is dropped; use num_moe_token_chunks=1 or {key}=-1 (dropless)"
            )


def check_attention_token_chunks(c: Config) -> None:
    """Query chunks split every sequence evenly (what a kernel or an offloaded name cannot take in
    a chunk: nn/attention/cudnn.py, parallel/checks.py)."""
    n, t = c.num_attention_token_chunks, c.max_target_length
    if n == 1:
        return
    if t % n:
        raise ConfigError(
            f"num_attention_token_chunks={n} does not divide max_target_length={t}; use a "
            f"divisor such as {divisors(t)}"
        )


def check_context(c: Config) -> None:
    """Context parallelism already splits each sequence's queries (what the attention kernels
    need of it: nn/attention/context_checks.py)."""
    sizes = {k: getattr(c, k) for k in ("ici_context_parallelism", "dcn_context_parallelism")}
    on = {k: v for k, v in sizes.items() if v != 1}
    if on and c.num_attention_token_chunks != 1:
        key, value = next(iter(on.items()))
        raise ConfigError(
            f"num_attention_token_chunks={c.num_attention_token_chunks} with {key}={value}: "
            "the context axis already splits each sequence's queries; set "
            "num_attention_token_chunks=1"
        )


def check_paged_stash(c: Config) -> None:
    if not c.moe_paged_stash:
        return
    if not c.sparse_matmul:
        raise ConfigError(
            "moe_paged_stash=true needs the sparse (grouped-matmul) dispatch; with "
            "sparse_matmul=false the one-hot einsum has no routed rows to stash: set "
            "sparse_matmul=true or moe_paged_stash=false"
        )
