"""Cross-field checks: small named functions, each raising ConfigError naming keys and values.

They run on every loaded config before anything is compiled. Checks that need the number of
devices (mesh sizes, divisibility by mesh axes) live with the mesh in `sharding/mesh.py`.
"""

from __future__ import annotations

from collections.abc import Callable

from expertax.config.schema import Config
from expertax.errors import ConfigError
from expertax.fp8 import kernel as fp8_kernel
from expertax.parallel import remat
from expertax.parallel.remat import STASHABLE, stashed_names


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
    if g in (-1, 0, 1):
        if kg not in (-1, 0, 1) and g in (-1, 0):
            raise ConfigError(
                f"topk_routing_group={kg} needs n_routing_groups > 1 (got {g}); set both or neither"
            )
        return
    if g < 0:
        raise ConfigError(
            f"n_routing_groups={g}: use -1 (off) or a positive divisor of num_experts"
        )
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


# Attention kernels that run on one platform only; declared here, read by nn/attention/kernel.py.
ATTENTION_PLATFORMS = {"cudnn": "gpu", "splash": "tpu"}
# cuDNN flash attention's head dims (Hopper and later): one dim for q, k and v, a multiple of 8 up
# to 256; nn/attention/cudnn.py pads to it.
CUDNN_MAX_HEAD_DIM = 256
CUDNN_HEAD_DIM_MULTIPLE = 8


def cudnn_padded_head_dim(qk_dim: int, v_dim: int) -> int:
    """The one head dim q, k and v are zero-padded to for cuDNN: the larger, up to a multiple
    of 8."""
    return -(-max(qk_dim, v_dim) // CUDNN_HEAD_DIM_MULTIPLE) * CUDNN_HEAD_DIM_MULTIPLE


def check_attention_impl(c: Config) -> None:
    """What cuDNN flash attention (through jax.nn.dot_product_attention) cannot take, once the
    head dims are padded to one multiple of 8 (MLA's v to the q/k dim: nn/attention/cudnn.py);
    the platform is checked against the mesh's devices (`check_attention_platform`)."""
    if c.attention_impl != "cudnn":
        return
    qk, v = c.qk_head_dim, c.attn_v_head_dim
    padded = cudnn_padded_head_dim(qk, v)
    if padded > CUDNN_MAX_HEAD_DIM:
        raise ConfigError(
            f"attention_impl=cudnn takes head dims up to {CUDNN_MAX_HEAD_DIM}; attention_type="
            f"{c.attention_type} has q/k {qk} and v {v} (padded: {padded}): use "
            "attention_impl=blockwise, dot or auto"
        )
    if c.dtype not in ("bfloat16", "float16"):
        raise ConfigError(
            f"attention_impl=cudnn needs dtype=bfloat16 or float16 (got dtype={c.dtype}): "
            "change dtype or use attention_impl=blockwise, dot or auto"
        )


def check_attention_platform(c: Config, platform: str) -> None:
    """A kernel for one platform, asked for on another, is refused before anything is traced
    (`platform`: the mesh's devices', `expertax.platform.of_mesh`)."""
    needs = ATTENTION_PLATFORMS.get(c.attention_impl)
    if needs is not None and platform != needs:
        valid = ["auto", "dot", "blockwise"] + [
            k for k, p in ATTENTION_PLATFORMS.items() if p == platform
        ]
        raise ConfigError(
            f"attention_impl={c.attention_impl} runs on {needs.upper()} only; this run's devices "
            f"are {platform}: valid here: {', '.join(valid)}"
        )


# Platforms whose compilers hold host-offloaded residuals in a separate memory space.
OFFLOAD_PLATFORMS = ("gpu", "tpu")


def check_moe_chunk_offload(c: Config, platform: str) -> None:
    """Host offload of a MoE name inside MoE token chunks is refused on GPU and TPU, before
    anything is traced: each chunk's own checkpoint (nn/moe/chunks.scan_chunks) stacks what it
    offloads over the chunks inside the layers' scan, a host buffer neither compiler lays out
    (jax 0.10.2: XLA:GPU fails layout assignment, XLA:TPU its async slices). On a CPU, one memory,
    the offload is a placement only and compiles."""
    if platform not in OFFLOAD_PLATFORMS or c.num_moe_token_chunks == 1:
        return
    place = remat.config_placements(c)
    offloaded = [name for name in remat.STASHABLE if place[name] == remat.OFFLOAD]
    if offloaded:
        raise ConfigError(
            f"num_moe_token_chunks={c.num_moe_token_chunks} with {offloaded[0]}=offload on "
            f"{platform.upper()}: the chunks' offloaded residuals do not compile there; set "
            f"{offloaded[0]}=device or remat, keep them in the paged stash "
            "(moe_paged_stash=true), or num_moe_token_chunks=1"
        )


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


def check_quantization(c: Config) -> None:
    if c.quantization and c.num_experts > 1 and not c.sparse_matmul:
        raise ConfigError(
            f"quantization={c.quantization} quantizes the routed experts' grouped GEMMs "
            "(sparse_matmul=true); the dense capacity path (sparse_matmul=false) has no fp8 "
            "GEMM: set sparse_matmul=true or quantization=''"
        )


def check_routing_bias(c: Config) -> None:
    if c.routed_bias and c.routed_score_func != "sigmoid":
        raise ConfigError(
            "routed_bias=true is DeepSeek-V3 balancing and needs routed_score_func=sigmoid "
            f"(got {c.routed_score_func})"
        )


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


def check_data_files(c: Config) -> None:
    if c.dataset_type != "files":
        return
    missing = [k for k in ("dataset_path", "tokenizer_path") if not getattr(c, k)]
    if missing:
        raise ConfigError(
            f"dataset_type=files needs {' and '.join(missing)}: set "
            + " ".join(f"{k}=..." for k in missing)
            + " (a data file, directory or glob; a tokenizer.json)"
        )


def check_synthetic_noise(c: Config) -> None:
    p = c.synthetic_noise
    if not 0 <= p < 1:
        raise ConfigError(
            f"synthetic_noise={p}: use a probability in [0, 1) (the share of target tokens "
            "replaced by uniform random ones; 0 = off)"
        )
    if p and c.dataset_type != "synthetic":
        raise ConfigError(
            f"synthetic_noise={p} applies to synthetic data only, not dataset_type="
            f"{c.dataset_type}; set synthetic_noise=0"
        )


def check_eval(c: Config) -> None:
    if c.eval_dataset_path and not c.tokenizer_path:
        raise ConfigError(
            f"eval_dataset_path={c.eval_dataset_path!r} needs tokenizer_path (the held-out files "
            "are tokenized like the training files); set tokenizer_path=... or "
            'eval_dataset_path="" (a held-out synthetic stream)'
        )


def check_profiler(c: Config) -> None:
    if c.profiler and c.skip_first_n_steps_for_profiler >= c.steps:
        raise ConfigError(
            f"profiler={c.profiler} with skip_first_n_steps_for_profiler="
            f"{c.skip_first_n_steps_for_profiler} and steps={c.steps} would never profile; use "
            f'skip_first_n_steps_for_profiler in 0..{c.steps - 1}, or profiler="" (off)'
        )


def check_distributed(c: Config) -> None:
    n, i = c.num_processes, c.process_id
    if n == 0:
        raise ConfigError("num_processes=0: use a positive count or -1 (from $JAX_NUM_PROCESSES)")
    if n > 0 and i >= n:
        raise ConfigError(f"process_id={i} must be below num_processes={n}")


def check_gmm_tiles(c: Config) -> None:
    lo, hi = c.gmm_tile_rows_min, c.gmm_tile_rows
    if lo & (lo - 1) or lo > hi:
        raise ConfigError(
            f"gmm_tile_rows_min={lo} must be a power of two no larger than gmm_tile_rows={hi}"
        )


def check_vocab_tiling(c: Config) -> None:
    n, t = c.num_vocab_tiling, c.max_target_length
    if t % n:
        divisors = [d for d in range(1, min(t, 64) + 1) if t % d == 0]
        raise ConfigError(
            f"num_vocab_tiling={n} does not divide max_target_length={t}; use a divisor such as "
            f"{divisors[-4:]}"
        )


def check_moe_token_chunks(c: Config) -> None:
    """Chunks must split the tokens evenly and leave the numbers unchanged (a layout key): no
    per-chunk caps. Divisibility by the tokens per batch shard needs the mesh (check_mesh_fit)."""
    n = c.num_moe_token_chunks
    if n == 1:
        return
    t = c.max_target_length
    if not c.sparse_matmul and t % n:
        divisors = [d for d in range(1, min(t, 64) + 1) if t % d == 0]
        raise ConfigError(
            f"num_moe_token_chunks={n} does not divide max_target_length={t} (sparse_matmul=false "
            f"chunks each sequence); use a divisor such as {divisors[-4:]}"
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
    """Query chunks split every sequence evenly; cuDNN cannot take one (cudnn.attend_cudnn)."""
    n, t = c.num_attention_token_chunks, c.max_target_length
    if n == 1:
        return
    if t % n:
        divisors = [d for d in range(1, min(t, 64) + 1) if t % d == 0]
        raise ConfigError(
            f"num_attention_token_chunks={n} does not divide max_target_length={t}; use a "
            f"divisor such as {divisors[-4:]}"
        )
    place = remat.config_placements(c)
    offloaded = [name for name in remat.QUERY_CHUNK_NAMES if place[name] == remat.OFFLOAD]
    if offloaded:
        raise ConfigError(
            f"num_attention_token_chunks={n} with {offloaded[0]}=offload: {offloaded[0]} is "
            "computed inside a query chunk, whose own checkpoint keeps what it saves on device; "
            f"set {offloaded[0]}=device or remat, or num_attention_token_chunks=1"
        )
    if c.attention_impl == "cudnn":
        raise ConfigError(
            f"num_attention_token_chunks={n} with attention_impl=cudnn: cuDNN's causal mask "
            "(through jax.nn.dot_product_attention) is aligned to the first key, and a chunk's "
            "queries sit after earlier keys; use num_attention_token_chunks=1, or "
            "attention_impl=auto or blockwise"
        )


def check_context(c: Config) -> None:
    """Context parallelism (nn/attention/context.py) needs a kernel that takes its queries'
    offset at run time, and the whole sequence's queries in one call."""
    sizes = {k: getattr(c, k) for k in ("ici_context_parallelism", "dcn_context_parallelism")}
    on = {k: v for k, v in sizes.items() if v != 1}
    if not on:
        return
    key, value = next(iter(on.items()))
    if c.attention_impl == "cudnn":
        raise ConfigError(
            f"attention_impl=cudnn with {key}={value}: cuDNN's causal mask (through jax.nn."
            "dot_product_attention) is aligned to the first key and built by row, and a context "
            "shard's queries sit at offsets known only on the device; use attention_impl=auto, "
            "dot or blockwise"
        )
    if c.attention_impl == "splash":
        cp = sizes["ici_context_parallelism"] * sizes["dcn_context_parallelism"]
        pieces = 2 * cp if c.context_parallel_load_balance else cp
        if c.max_target_length % (pieces * 128):
            raise ConfigError(
                f"attention_impl=splash with {key}={value}: max_target_length="
                f"{c.max_target_length} must split into {pieces} chunks of a multiple of 128 "
                f"rows (the kernel's tiles), i.e. be a multiple of {pieces * 128}"
            )
    if c.num_attention_token_chunks != 1:
        raise ConfigError(
            f"num_attention_token_chunks={c.num_attention_token_chunks} with {key}={value}: "
            "the context axis already splits each sequence's queries; set "
            "num_attention_token_chunks=1"
        )
    if c.context_parallel_strategy == "ring":
        # imported here: nn.attention imports this package (splash's specs)
        from expertax.nn.attention import context  # noqa: PLC0415

        impl = context.kernel_impl(c, c.max_target_length)
        if c.attention_type != "mla" or impl != "blockwise":
            raise ConfigError(
                f"context_parallel_strategy=ring with {key}={value}: the ring passes MLA's "
                "latent through its blockwise kernel, and this model has attention_type="
                f"{c.attention_type} with attention_impl={c.attention_impl} (runs {impl}); use "
                "context_parallel_strategy=all_gather, or attention_impl=blockwise on an MLA "
                "model"
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
    if c.moe_paged_stash_capacity_factor <= 0:
        raise ConfigError(
            f"moe_paged_stash_capacity_factor={c.moe_paged_stash_capacity_factor}: must be > 0 "
            "(e.g. 1.1: 10% above the rows a device receives on average)"
        )
    if c.moe_paged_stash_page_rows <= 0:
        raise ConfigError(
            f"moe_paged_stash_page_rows={c.moe_paged_stash_page_rows}: must be a positive row "
            "count (e.g. 256)"
        )
    if not stashed_names(c):
        raise ConfigError(
            f"moe_paged_stash=true but remat_policy={c.remat_policy} saves none of "
            f"{', '.join(STASHABLE)} (all recomputed): nothing to stash; keep one of them "
            "(remat_policy=custom moe_mlpwo=device, or minimal) or set moe_paged_stash=false"
        )


def check_placements(c: Config) -> None:
    """A name placed on device or offload (remat_policy=custom) that no layer of this config
    saves is refused: the placement would do nothing (parallel/remat.py `unkept`). So is a
    per-name placement under a preset, which places every name itself; and an offloaded name
    under the paged stash, whose buffers are in device memory."""
    if c.remat_policy != "custom":
        fields = type(c).model_fields
        changed = [
            f"{n}={getattr(c, n)}" for n in remat.ALL_NAMES if getattr(c, n) != fields[n].default
        ]
        if changed:
            raise ConfigError(
                f"{', '.join(changed)}: per-name placements are read only with "
                f"remat_policy=custom (remat_policy={c.remat_policy} places every name itself); "
                "add remat_policy=custom or leave them out"
            )
        return
    if c.moe_paged_stash:
        for name in stashed_names(c):
            if getattr(c, name) == remat.OFFLOAD:
                raise ConfigError(
                    f"{name}=offload with moe_paged_stash=true: the stash keeps {name} in its "
                    f"device buffers, never in host memory; set {name}=device (stashed) or "
                    "moe_paged_stash=false"
                )
    unkept = remat.unkept(c)
    for name, place in remat.config_placements(c).items():
        if place != remat.REMAT and name in unkept:
            raise ConfigError(
                f"{name}={place}: no layer of {c.model_name} saves it: {unkept[name]}; "
                f"otherwise set {name}=remat"
            )


ALL_CHECKS: tuple[Callable[[Config], None], ...] = (
    check_gmm_tiles,
    check_vocab_tiling,
    check_layers,
    check_top_k,
    check_routing_groups,
    check_heads,
    check_mla,
    check_layer_pattern,
    check_attention_impl,
    check_rope,
    check_capacity,
    check_quantization,
    fp8_kernel.check,  # gmm_impl=fp8_hopper from the config alone (fp8/kernel.py)
    check_routing_bias,
    check_pipeline,
    check_parallelism_values,
    check_ragged_buffer,
    check_ring_of_experts,
    check_moe_token_chunks,
    check_attention_token_chunks,
    check_context,
    check_paged_stash,
    check_placements,
    check_data_files,
    check_synthetic_noise,
    check_eval,
    check_profiler,
    check_distributed,
)


def run_checks(c: Config) -> Config:
    for check in ALL_CHECKS:
        check(c)
    return c
