"""Field-against-field checks of the model: layers, experts and routing, attention's shape
and options, RoPE, the vocabulary's tiles, quantization."""

from __future__ import annotations

from expertax.config.checks.hints import divisors
from expertax.config.schema import Config
from expertax.errors import ConfigError


def check_layers(c: Config) -> None:
    if c.num_experts > 1 and c.first_num_dense_layers > c.base_num_decoder_layers:
        raise ConfigError(
            f"first_num_dense_layers={c.first_num_dense_layers} exceeds "
            f"base_num_decoder_layers={c.base_num_decoder_layers}; use at most that many"
        )


def check_top_k(c: Config) -> None:
    if c.num_experts > 1 and c.num_experts_per_tok > c.num_experts:
        raise ConfigError(
            f"num_experts_per_tok={c.num_experts_per_tok} exceeds num_experts={c.num_experts}; "
            f"choose 1..{c.num_experts}"
        )


def check_routing_groups(c: Config) -> None:
    g, kg = c.n_routing_groups, c.topk_routing_group
    for key, value in (("n_routing_groups", g), ("topk_routing_group", kg)):
        if value == 0:
            raise ConfigError(f"{key}=0: use -1 (off) or a positive count of groups")
    if g in (-1, 1):
        if kg not in (-1, 1):
            raise ConfigError(
                f"topk_routing_group={kg} needs n_routing_groups > 1 (got {g}); set both or neither"
            )
        return
    if c.num_experts % g:
        raise ConfigError(
            f"n_routing_groups={g} does not divide num_experts={c.num_experts}; "
            f"use a divisor of {c.num_experts}"
        )
    if not 1 <= kg <= g:
        raise ConfigError(f"topk_routing_group={kg} must be in 1..n_routing_groups={g}")
    if c.num_experts_per_tok > kg * (c.num_experts // g):
        raise ConfigError(
            f"num_experts_per_tok={c.num_experts_per_tok} exceeds the experts in the kept groups "
            f"(topk_routing_group={kg} x {c.num_experts // g} experts per group)"
        )


def check_heads(c: Config) -> None:
    if c.attention_type == "gqa" and c.base_num_query_heads % c.base_num_kv_heads:
        raise ConfigError(
            f"base_num_query_heads={c.base_num_query_heads} is not a multiple of "
            f"base_num_kv_heads={c.base_num_kv_heads}"
        )


LAYER_KINDS = ("full", "sliding")


def check_layer_pattern(c: Config) -> None:
    """`attention_layer_pattern` and `sliding_window_size` (models/layer_pattern.py)."""
    text = c.attention_layer_pattern
    kinds = [k.strip() for k in text.split(",")] if text.strip() else []
    for kind in kinds:
        if kind not in LAYER_KINDS:
            raise ConfigError(
                f"attention_layer_pattern={text!r}: {kind!r} is not a layer kind; use a "
                "comma-separated cycle of full and sliding (e.g. sliding,full)"
            )
    if "sliding" in kinds and not c.sliding_window_size:
        raise ConfigError(
            f"attention_layer_pattern={text!r} has sliding layers and sliding_window_size=0; "
            "set sliding_window_size to the window in positions"
        )
    windows = c.attention_windows
    if all(w is None for w in windows):
        return
    if c.attention_type == "mla":
        raise ConfigError(
            f"sliding_window_size={c.sliding_window_size} with attention_type=mla: only GQA "
            "layers slide; use attention_type=gqa or sliding_window_size=0"
        )
    if c.mtp_num_layers:
        raise ConfigError(
            f"sliding_window_size={c.sliding_window_size} with mtp_num_layers="
            f"{c.mtp_num_layers}: the MTP block has no layer kind; use one or the other"
        )
    if len(set(windows)) == 1:
        return
    n = len(windows)
    for name, count in (("dense", c.num_dense_layers), ("MoE", c.num_moe_layers)):
        if count % n:
            raise ConfigError(
                f"attention_layer_pattern={text!r} is a cycle of {n} layers, which does not "
                f"divide the {count} {name} layers (base_num_decoder_layers="
                f"{c.base_num_decoder_layers}, first_num_dense_layers={c.first_num_dense_layers});"
                " use a cycle whose length divides both stacks"
            )
    # The pipeline runs layer j of every stage visit as kind j mod n (models/pipeline.py): a
    # visit must hold whole cycles, else a stage's kinds would differ by stage and repeat (a
    # switch on a traced kind, every kind's attention computed under the stages' vmap).
    s, r, layers = c.pipeline_stages, c.num_pipeline_repeats, c.pipelined_layers
    if s > 1 and layers > 0 and layers % (s * r) == 0 and (layers // (s * r)) % n:
        name = "MoE" if c.is_moe else "dense"
        fits = [str(k) for k in range(1, layers + 1) if layers % (s * k * n) == 0]
        hint = (
            f"valid num_pipeline_repeats with {s} stages: {', '.join(fits)}"
            if fits
            else f"no num_pipeline_repeats fits {s} stages (change the stages, "
            "pipeline_parallel_layers or the layer count)"
        )
        raise ConfigError(
            f"attention_layer_pattern={text!r} (a cycle of {n} layers) with "
            f"ici_pipeline_parallelism x dcn_pipeline_parallelism = {s} stages and "
            f"num_pipeline_repeats={r}: a stage visit runs {layers // (s * r)} of the {layers} "
            f"pipelined {name} layers (pipeline_parallel_layers={c.pipeline_parallel_layers}; "
            f"base_num_decoder_layers={c.base_num_decoder_layers}, first_num_dense_layers="
            f"{c.first_num_dense_layers}), not whole cycles; the pipelined layers must be a "
            f"multiple of stages x repeats x {n}: {hint}"
        )


# GQA's optional pieces (nn/attention/gqa.py), refused with MLA: key -> what it is.
GQA_ONLY = {
    "attention_qk_norm": "the per-head q/k norm (MLA normalizes its low-rank latents instead)",
    "attention_qkv_bias": "the q/k/v projection bias",
    "attention_out_bias": "the output projection bias",
    "attention_sinks": "the learned attention sinks (GPT-OSS)",
}


def check_mla(c: Config) -> None:
    if c.attention_type != "mla":
        return
    for key, what in GQA_ONLY.items():
        if getattr(c, key):
            raise ConfigError(
                f"{key}=true with attention_type=mla: {what} is a GQA option here; use "
                f"attention_type=gqa or {key}=false"
            )
    for key in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        if getattr(c, key) <= 0:
            raise ConfigError(f"{key}={getattr(c, key)}: attention_type=mla needs a positive value")
    if c.qk_rope_head_dim % 2:
        raise ConfigError(f"qk_rope_head_dim={c.qk_rope_head_dim} must be even (RoPE pairs)")


def check_rope(c: Config) -> None:
    rope_dim = c.qk_rope_head_dim if c.attention_type == "mla" else c.head_dim
    if c.attention_type == "gqa" and rope_dim % 2:
        raise ConfigError(f"head_dim={c.head_dim} must be even (RoPE pairs)")
    if c.partial_rotary_factor != 1.0:
        if c.attention_type == "mla":
            raise ConfigError(
                f"partial_rotary_factor={c.partial_rotary_factor} with attention_type=mla: MLA "
                "rotates its own qk_rope_head_dim; use attention_type=gqa or factor 1"
            )
        rot = int(c.head_dim * c.partial_rotary_factor)
        if rot < 2 or rot % 2:
            raise ConfigError(
                f"partial_rotary_factor={c.partial_rotary_factor} x head_dim={c.head_dim} = {rot} "
                "rotated dims: RoPE needs an even count of at least 2"
            )
    if c.rope_type == "yarn" and c.rope_factor <= 1.0:
        raise ConfigError(f"rope_type=yarn needs rope_factor > 1 (got {c.rope_factor})")


def check_capacity(c: Config) -> None:
    cf = c.capacity_factor
    if cf != -1 and cf <= 0:
        raise ConfigError(f"capacity_factor={cf}: use -1 (dropless) or a positive factor")
    if c.sparse_matmul and cf != -1:
        raise ConfigError(
            f"capacity_factor={cf} applies to the dense path only: the sparse path "
            "(sparse_matmul=true) is dropless; set sparse_matmul=false or capacity_factor=-1"
        )


def check_routing_bias(c: Config) -> None:
    if c.routed_bias and c.routed_score_func != "sigmoid":
        raise ConfigError(
            "routed_bias=true is DeepSeek-V3 balancing and needs routed_score_func=sigmoid "
            f"(got {c.routed_score_func})"
        )


def check_vocab_tiling(c: Config) -> None:
    n, t = c.num_vocab_tiling, c.max_target_length
    if t % n:
        raise ConfigError(
            f"num_vocab_tiling={n} does not divide max_target_length={t}; use a divisor such as "
            f"{divisors(t)}"
        )


def check_quantization(c: Config) -> None:
    if c.quantization and c.num_experts > 1 and not c.sparse_matmul:
        raise ConfigError(
            f"quantization={c.quantization} quantizes the routed experts' grouped GEMMs "
            "(sparse_matmul=true); the dense capacity path (sparse_matmul=false) has no fp8 "
            "GEMM: set sparse_matmul=true or quantization=''"
        )
