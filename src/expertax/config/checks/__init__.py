"""Field-against-field checks: small named functions, each raising ConfigError naming keys and
values, run on every loaded config (`run_checks`) before anything is compiled.

By subject: model.py (layers, routing, attention's shape, RoPE, quantization), parallel.py
(pipeline, parallelism sizes, the sparse path, token chunks), run.py (data, evaluation,
profiling, processes, paths); only_with.py (the keys that apply only under another setting, as
one table) runs where the loader knows which keys the user gave. What needs a kernel's
abilities, the remat names, the platform or the mesh is checked by the subsystem that owns it,
collected by `expertax.preflight.check`.
"""

from __future__ import annotations

from collections.abc import Callable

from expertax.config.checks import model, parallel, run
from expertax.config.schema import Config

ALL_CHECKS: tuple[Callable[[Config], None], ...] = (
    parallel.check_gmm_tiles,
    model.check_vocab_tiling,
    model.check_layers,
    model.check_top_k,
    model.check_routing_groups,
    model.check_heads,
    model.check_mla,
    model.check_layer_pattern,
    model.check_rope,
    model.check_capacity,
    model.check_quantization,
    model.check_routing_bias,
    parallel.check_pipeline,
    parallel.check_parallelism_values,
    parallel.check_ragged_buffer,
    parallel.check_ring_of_experts,
    parallel.check_moe_token_chunks,
    parallel.check_attention_token_chunks,
    parallel.check_context,
    parallel.check_paged_stash,
    run.check_data_files,
    run.check_synthetic_noise,
    run.check_routing_replay,
    run.check_qk_clip,
    run.check_eval,
    run.check_profiler,
    run.check_distributed,
    run.check_run_name,
    run.check_coordinator_address,
)


def run_checks(c: Config) -> Config:
    """Every field-against-field check of `c`, in order; returns `c`."""
    for check in ALL_CHECKS:
        check(c)
    return c
