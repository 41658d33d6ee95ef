"""The typed configuration schema.

One flat namespace of globally unique keys (so `key=value` works on the command line), grouped in
sections for reading. Key names follow MaxText's where the concept is the same. Every field has a
description; derived values are properties, never written back. Cross-field checks that do not
need the device count live in `checks.py`; those that do (mesh sizes) in `sharding/mesh.py`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

DType = Literal["float32", "bfloat16", "float16"]

# The mesh axes, in mesh order; each has ici_<axis>_parallelism and dcn_<axis>_parallelism keys.
MESH_AXES = ("pipeline", "data", "fsdp", "expert", "tensor")

# What a key changes, declared with the key (`_key(KIND, default, ...)`); one classification used
# by the resume check, the `load_parameters_path` check and `--help-keys`:
MODEL = "model"  # the parameters' shapes and what they compute: saved weights need the same values
TRAINING = "training"  # the numbers of later steps (optimizer, precision, drops), not the weights
DATA = "data"  # the data stream (its files, order and sequence length)
LAYOUT = "layout"  # how the same numbers are computed: mesh, kernels, remat, batch per device
RUN = "run"  # where the run goes, how long, logging, checkpoints, processes
KINDS = (MODEL, TRAINING, DATA, LAYOUT, RUN)
# A resumed run (or a restart before its first checkpoint) must agree on these kinds.
SAME_RUN_KINDS = (MODEL, TRAINING, DATA)


def _key(kind: str, default: Any, **kwargs: Any) -> Any:
    """A config field whose metadata says which kind of key it is (see KINDS)."""
    if kind not in KINDS:
        raise ValueError(f"unknown key kind {kind!r}; use one of {KINDS}")
    return Field(default, json_schema_extra={"kind": kind}, **kwargs)


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=True)


class ModelSection(_Section):
    model_name: str = _key(
        RUN, "deepseek3-tiny", description="Preset in configs/models/ to start from."
    )
    decoder_block: Literal["deepseek", "mixtral", "llama"] = _key(
        MODEL,
        "deepseek",
        description="Model family: DeepSeek-V3 (MLA + MoE), Mixtral (GQA + MoE), Llama.",
    )
    vocab_size: int = _key(MODEL, 512, gt=0, description="Vocabulary size V.")
    base_emb_dim: int = _key(MODEL, 128, gt=0, description="Model width D.")
    base_num_query_heads: int = _key(MODEL, 4, gt=0, description="Query heads H.")
    base_num_kv_heads: int = _key(
        MODEL, 4, gt=0, description="Key/value heads G for GQA (H % G == 0)."
    )
    head_dim: int = _key(MODEL, 32, gt=0, description="GQA head dimension Q.")
    base_mlp_dim: int = _key(MODEL, 256, gt=0, description="Hidden size F of the dense MLP layers.")
    base_moe_mlp_dim: int = _key(
        MODEL, 64, gt=0, description="Hidden size F of each routed expert."
    )
    base_num_decoder_layers: int = _key(MODEL, 4, gt=0, description="Total decoder layers L.")
    first_num_dense_layers: int = _key(
        MODEL,
        0,
        ge=0,
        description="DeepSeek layout: this many dense layers first, then MoE layers.",
    )
    attention_impl: Literal["auto", "dot", "blockwise", "cudnn"] = _key(
        LAYOUT,
        "auto",
        description="Attention kernel: dot (whole [T, S] score matrices, saved for backward), "
        "blockwise (online softmax over key blocks, recomputed in backward; memory linear in T), "
        "cudnn (cuDNN flash attention: GPU, bfloat16/float16, equal q/k and v head dims, so not "
        "MLA), auto (dot for short sequences, blockwise from kernel.AUTO_BLOCKWISE_MIN_LENGTH).",
    )
    attention_type: Literal["gqa", "mla"] = _key(
        MODEL,
        "gqa",
        description="Grouped-query attention, or DeepSeek Multi-head Latent Attention.",
    )
    q_lora_rank: int = _key(
        MODEL,
        0,
        ge=0,
        description="MLA query low rank R_q (wq_a -> norm -> wq_b); 0 means a plain wq.",
    )
    kv_lora_rank: int = _key(MODEL, 32, ge=0, description="MLA key/value latent rank R_kv.")
    qk_nope_head_dim: int = _key(
        MODEL, 32, ge=0, description="MLA per-head query/key dims without RoPE."
    )
    qk_rope_head_dim: int = _key(
        MODEL, 16, ge=0, description="MLA decoupled RoPE dims (shared key)."
    )
    v_head_dim: int = _key(MODEL, 32, ge=0, description="MLA per-head value dims.")
    rope_type: Literal["default", "yarn"] = _key(MODEL, "default", description="RoPE variant.")
    rope_max_timescale: float = _key(MODEL, 10_000.0, gt=0, description="RoPE base (theta).")
    rope_factor: float = _key(MODEL, 1.0, ge=1.0, description="YaRN context-extension factor.")
    original_max_position_embeddings: int = _key(
        MODEL, 4096, gt=0, description="YaRN: context length the model was pretrained with."
    )
    beta_fast: float = _key(
        MODEL, 32.0, gt=0, description="YaRN ramp: rotations where extrapolation ends."
    )
    beta_slow: float = _key(
        MODEL, 1.0, gt=0, description="YaRN ramp: rotations where interpolation starts."
    )
    mscale: float = _key(MODEL, 1.0, ge=0, description="YaRN mscale for the RoPE amplitude.")
    mscale_all_dim: float = _key(
        MODEL,
        0.0,
        ge=0,
        description="YaRN mscale_all_dim; > 0 also scales the attention softmax (DeepSeek).",
    )
    normalization_layer_epsilon: float = _key(MODEL, 1e-6, gt=0, description="RMSNorm epsilon.")
    logits_via_embedding: bool = _key(
        MODEL, False, description="Tie the output head to the embedding."
    )


class MoESection(_Section):
    num_experts: int = _key(MODEL, 16, ge=1, description="Routed experts E (1 with a dense model).")
    num_experts_per_tok: int = _key(MODEL, 4, ge=1, description="Experts per token K (top-k).")
    shared_experts: int = _key(
        MODEL, 0, ge=0, description="Shared experts, each of base_moe_mlp_dim, run on every token."
    )
    sparse_matmul: bool = _key(
        TRAINING,
        True,
        description="Dropless sort -> grouped matmul -> unsort; false: dense einsum dispatch.",
    )
    capacity_factor: float = _key(
        TRAINING,
        -1.0,
        description="Dense path only: expert capacity = ceil(T*K/E * factor); -1 = dropless.",
    )
    routed_score_func: Literal["softmax", "sigmoid"] = _key(
        MODEL, "softmax", description="Router scores: softmax (Mixtral) or sigmoid (DeepSeek-V3)."
    )
    routed_bias: bool = _key(
        MODEL,
        False,
        description="DeepSeek-V3 aux-loss-free balancing: a bias used only for selection.",
    )
    routed_bias_update_rate: float = _key(
        TRAINING,
        1e-3,
        ge=0,
        description="Step of the bias update bias += rate*sign(mean load - load).",
    )
    routed_scaling_factor: float = _key(
        MODEL, 1.0, gt=0, description="Multiplies the routing weights."
    )
    n_routing_groups: int = _key(
        MODEL, -1, description="Group-limited routing: experts split in this many groups; -1 = off."
    )
    topk_routing_group: int = _key(
        MODEL, -1, description="Group-limited routing: groups kept per token (by top-2 score sum)."
    )
    norm_topk_prob: bool = _key(
        MODEL, True, description="Normalize the top-k weights to sum to one."
    )
    load_balance_loss_weight: float = _key(
        TRAINING,
        0.0,
        ge=0,
        description="Weight of the Switch-style load-balance loss (global statistics).",
    )
    use_random_routing: bool = _key(
        TRAINING,
        False,
        description="Benchmarks: route to uniformly random experts, ignoring the router.",
    )
    float32_weight_sum: bool = _key(
        TRAINING, True, description="Combine the K expert outputs in float32 (else in `dtype`)."
    )
    gmm_impl: Literal["auto", "ragged_dot", "tiled"] = _key(
        LAYOUT,
        "auto",
        description="Grouped-matmul backend of the sparse path; auto picks per platform from "
        "the measurements recorded in nn/moe/gmm.py.",
    )
    gmm_tile_rows: int = _key(LAYOUT, 512, gt=0, description="tiled gmm: rows per full tile.")
    gmm_tile_rows_min: int = _key(
        LAYOUT,
        8,
        gt=0,
        description="tiled gmm: smallest power-of-two tile for a group's remainder.",
    )
    moe_fused_routed_ffn: bool = _key(
        LAYOUT,
        True,
        description="Sparse path (one device, all-to-all, ring) with the tiled gmm: gather the "
        "routed rows, run the expert FFN and scatter-add its weighted outputs inside the grouped "
        "loops (nn/moe/routed.py: no [rows, D] buffers, no hidden-gradient buffers; when the remat "
        "policy recomputes moe_mlpwi_0 and moe_mlpwi_1, no [rows, F] gate/up either: the "
        "backward loop projects each tile again); false: a separate row gather, grouped "
        "matmuls and scatter. Not with moe_paged_stash.",
    )
    # Expert parallelism (docs/design/ep.md): the sparse path inside one shard_map.
    use_ring_of_experts: bool = _key(
        LAYOUT,
        False,
        description="Sparse EP strategy: all-gather tokens over `expert`, local experts, "
        "reduce-scatter; false: route locally and exchange rows with a ragged all-to-all.",
    )
    a2a_impl: Literal["auto", "ragged", "padded"] = _key(
        LAYOUT,
        "auto",
        description="All-to-all of the sparse EP path: ragged (jax.lax.ragged_all_to_all, GPU/"
        "TPU), padded (all_to_all over padded per-peer blocks, any backend), auto (per backend).",
    )
    shard_exp_on_fsdp: bool = _key(
        LAYOUT,
        False,
        description="Store expert weights sharded over `fsdp` on the expert dim (instead of "
        "`expert`); they are all-gathered at the dispatch shard_map boundary.",
    )
    num_moe_token_chunks: int = _key(
        LAYOUT,
        1,
        ge=1,
        description="Run the MoE layer over its tokens in this many chunks (a scan: route, "
        "dispatch, experts, combine per chunk), so the dropless worst-case buffers (sorted rows, "
        "all-to-all receive buffer, ring's gathered rows, one-hot dispatch) are one chunk's; "
        "the balancing statistics stay global. Must divide the tokens per batch shard "
        "(and max_target_length with sparse_matmul=false).",
    )
    moe_paged_stash: bool = _key(
        LAYOUT,
        False,
        description="Paged stash: keep the routed experts' saved activations (moe_mlpwi_0, "
        "moe_mlpwi_1, moe_mlpwo placed device/offload) by their valid rows only, in one buffer "
        "shared by the MoE stack, instead of per layer at the worst-case row count; exact "
        "gradients (a layer that does not fit is recomputed). Sparse dispatch only.",
    )
    moe_paged_stash_capacity_factor: float = _key(
        LAYOUT,
        1.1,
        description="Stash buffer rows per device = factor x MoE layers x the rows a device "
        "receives on average per layer (its tokens x num_experts_per_tok), plus one page.",
    )
    moe_paged_stash_page_rows: int = _key(
        LAYOUT,
        256,
        description="Rows copied to/from the stash per loop step; the buffer's slack is one page.",
    )
    ragged_buffer_factor: float = _key(
        TRAINING,
        -1.0,
        description="Receive buffer of the all-to-all EP path: -1 = worst case (dropless); > 0 "
        "caps it at factor x the rows a shard routes; rows past it are counted as dropped.",
    )


class ParallelSection(_Section):
    ici_pipeline_parallelism: int = _key(
        LAYOUT,
        1,
        gt=0,
        description="Pipeline stages (the `pipeline` mesh axis); > 1 pipelines the layer stack "
        "chosen by pipeline_parallel_layers (models/pipeline.py).",
    )
    ici_data_parallelism: int = _key(
        LAYOUT, 1, description="Data-parallel axis size (-1: the rest)."
    )
    ici_fsdp_parallelism: int = _key(LAYOUT, -1, description="FSDP axis size (-1: the rest).")
    ici_expert_parallelism: int = _key(
        LAYOUT, 1, description="Expert-parallel axis size (-1: the rest)."
    )
    ici_tensor_parallelism: int = _key(
        LAYOUT, 1, description="Tensor-parallel axis size (-1: the rest)."
    )
    dcn_pipeline_parallelism: int = _key(
        LAYOUT, 1, gt=0, description="Pipeline stages across hosts/slices (times the ici size)."
    )
    num_pipeline_microbatches: int = _key(
        LAYOUT,
        -1,
        description="Microbatches per step in the pipeline; -1 = the number of stages. The global "
        "batch must divide by it; with num_pipeline_repeats > 1 it must be a multiple of the "
        "stages.",
    )
    num_pipeline_repeats: int = _key(
        LAYOUT,
        1,
        gt=0,
        description="Circular pipeline: each stage holds this many non-contiguous groups of "
        "layers (layer groups visit stages 0..S-1 this many times).",
    )
    pipeline_parallel_layers: int = _key(
        LAYOUT,
        -1,
        description="Layers pipelined: -1 = the MoE stack of an MoE model (the first dense "
        "layers run outside, as DeepSeek-V3), every layer of a dense model; n > 0 = the first n "
        "layers of that stack (the rest run after the pipeline, unpipelined).",
    )
    pipeline_shift: Literal["roll", "ppermute"] = _key(
        LAYOUT,
        "roll",
        description="Stage-to-stage shift of the pipeline state: `roll` (a slice+concat the "
        "partitioner turns into one collective-permute) or `ppermute` (explicit, in shard_map).",
    )
    dcn_data_parallelism: int = _key(LAYOUT, 1, description="Data-parallel across hosts/slices.")
    dcn_fsdp_parallelism: int = _key(LAYOUT, 1, description="FSDP across hosts/slices.")
    dcn_expert_parallelism: int = _key(
        LAYOUT, 1, description="Expert parallelism across hosts/slices."
    )
    dcn_tensor_parallelism: int = _key(
        LAYOUT, 1, description="Tensor parallelism across hosts/slices."
    )
    sharding_rules: str = _key(
        LAYOUT,
        "default",
        description="Logical-axis rules preset in configs/parallel/ (e.g. default).",
    )


class TrainSection(_Section):
    steps: int = _key(RUN, 40, gt=0, description="Training steps.")
    per_device_batch_size: float = _key(
        LAYOUT, 2.0, gt=0, description="Sequences per device; the global batch must be whole."
    )
    max_target_length: int = _key(DATA, 128, gt=1, description="Sequence length T.")
    learning_rate: float = _key(TRAINING, 3e-3, gt=0, description="Peak learning rate.")
    warmup_steps_fraction: float = _key(
        TRAINING, 0.1, ge=0, lt=1, description="Fraction of steps of linear warmup."
    )
    cosine_learning_rate_final_fraction: float = _key(
        TRAINING, 0.1, ge=0, le=1, description="Final learning rate as a fraction of the peak."
    )
    adam_b1: float = _key(TRAINING, 0.9, ge=0, lt=1, description="AdamW beta1.")
    adam_b2: float = _key(TRAINING, 0.95, ge=0, lt=1, description="AdamW beta2.")
    adam_eps: float = _key(TRAINING, 1e-8, gt=0, description="AdamW epsilon.")
    adam_weight_decay: float = _key(
        TRAINING, 0.1, ge=0, description="AdamW decoupled weight decay."
    )
    gradient_clipping_threshold: float = _key(
        TRAINING, 1.0, ge=0, description="Clip the global gradient norm to this; 0 = off."
    )
    dtype: DType = _key(TRAINING, "float32", description="Activation/compute dtype.")
    weight_dtype: DType = _key(TRAINING, "float32", description="Parameter storage dtype.")
    grad_dtype: DType = _key(
        TRAINING, "float32", description="Gradient dtype (cast only if different)."
    )
    mu_dtype: DType = _key(TRAINING, "float32", description="AdamW first-moment dtype.")
    nu_dtype: DType = _key(
        TRAINING,
        "float32",
        description="AdamW second-moment dtype (stored; updated in float32). DeepSeek-V3 keeps "
        "both moments in bfloat16 with float32 master weights and gradients.",
    )
    num_vocab_tiling: int = _key(
        LAYOUT,
        1,
        ge=1,
        description="Compute the output logits and cross-entropy this many sequence tiles at a "
        "time (recomputed in backward), so the float32 [B, T, V] logits never exist at once; "
        "must divide max_target_length.",
    )
    init_weights_seed: int = _key(TRAINING, 0, description="Seed of the parameter initialization.")
    load_parameters_path: str = _key(
        RUN,
        "",
        description="Start from the parameters of this expertax model directory (the output of "
        "`expertax convert from-hf`) instead of a random init: fresh optimizer state, step 0. Its "
        "config.yml must agree with the run on every key of kind model. Ignored when the run "
        "resumes from a checkpoint (the checkpoint wins); empty = off.",
    )
    scan_layers: bool = _key(LAYOUT, True, description="Run each layer stack with lax.scan.")
    base_output_directory: str = _key(
        RUN, "runs", description="Runs are written under this folder."
    )
    run_name: str = _key(RUN, "", description="Run folder name; empty = a timestamp.")
    log_period: int = _key(RUN, 1, gt=0, description="Print a console line every this many steps.")
    enable_checkpointing: bool = _key(
        RUN, True, description="Save checkpoints in <run dir>/checkpoints and resume from them."
    )
    checkpoint_period: int = _key(
        RUN,
        100,
        gt=0,
        description="Save a checkpoint every this many steps (and after the last step).",
    )
    max_checkpoints: int = _key(RUN, 3, gt=0, description="Keep this many most recent checkpoints.")
    async_checkpointing: bool = _key(
        RUN, True, description="Write checkpoints on a background thread while training continues."
    )
    skip_nonfinite_steps: bool = _key(
        RUN,
        False,
        description="On a NaN/Inf loss or gradient, skip that update (params and optimizer state "
        "unchanged, counted in skipped_steps) instead of stopping the run.",
    )
    debug_inject_nan_step: int = _key(
        RUN,
        -1,
        ge=-1,
        description="Debugging/tests only: make the loss NaN at this step; -1 = off.",
    )


class DataSection(_Section):
    dataset_type: Literal["synthetic", "files"] = _key(
        DATA,
        "synthetic",
        description="synthetic: learnable arithmetic token sequences; files: local JSONL/Parquet/"
        "text files (dataset_path), tokenized with tokenizer_path and packed.",
    )
    data_shuffle_seed: int = _key(
        DATA, 0, description="Seed of the data order (and synthetic data)."
    )
    dataset_path: str = _key(
        DATA,
        "",
        description="dataset_type=files: a file, a directory or a glob of .jsonl/.parquet/.txt.",
    )
    tokenizer_path: str = _key(
        DATA, "", description="dataset_type=files: a HuggingFace tokenizer.json (or its directory)."
    )
    data_text_field: str = _key(
        DATA, "text", description="JSONL key / Parquet column with the text."
    )
    data_num_epochs: int = _key(
        DATA, -1, ge=-1, description="dataset_type=files: passes over the data; -1 repeats forever."
    )
    data_worker_count: int = _key(
        RUN, 0, ge=0, description="dataset_type=files: reader threads (never changes the batches)."
    )


Placement = Literal["device", "offload", "remat"]


def _placement(default: str, what: str):
    return _key(
        LAYOUT,
        default,
        description=f"remat_policy=custom: where {what} is kept (device, "
        "offload = pinned host, remat = recomputed).",
    )


class RematSection(_Section):
    """Rematerialization and memory placement (parallel/remat.py, docs/design/remat.md)."""

    remat_policy: Literal[
        "full", "minimal", "save_qkv_proj", "save_dot_except_mlp", "save_out_proj", "none", "custom"
    ] = _key(
        LAYOUT,
        "full",
        description="What each layer keeps for the backward pass: full (layer input only), "
        "minimal (all named tensors but the MLP/expert gate and up hiddens), save_qkv_proj, "
        "save_dot_except_mlp (attention projections), save_out_proj, none (everything, no "
        "remat), custom (the per-name keys below).",
    )
    decoder_layer_input: Placement = _placement("device", "each decoder layer's input")
    query_proj: Placement = _placement("remat", "the per-head queries")
    key_proj: Placement = _placement("remat", "the per-head keys")
    value_proj: Placement = _placement("remat", "the per-head values")
    qkv_proj: Placement = _placement("remat", "a fused q/k/v projection (none is computed)")
    attention_out: Placement = _placement("remat", "the attention kernel's output")
    out_proj: Placement = _placement("remat", "the attention output projection")
    mlpwi_0: Placement = _placement("remat", "the dense MLP gate")
    mlpwi_1: Placement = _placement("remat", "the dense MLP up projection")
    mlpwo: Placement = _placement("remat", "the dense MLP output")
    moe_mlpwi_0: Placement = _placement("remat", "the routed experts' gate")
    moe_mlpwi_1: Placement = _placement("remat", "the routed experts' up projection")
    moe_mlpwo: Placement = _placement("remat", "the routed experts' output")
    query_wa_proj: Placement = _placement("remat", "MLA's query down projection")
    kv_wa_proj: Placement = _placement("remat", "MLA's key/value down projection")
    mla_q: Placement = _placement("remat", "MLA's per-head queries before RoPE")
    mla_kv: Placement = _placement("remat", "MLA's up-projected keys and values")
    optimizer_memory_host_offload: bool = _key(
        LAYOUT, False, description="Keep the optimizer state in pinned host memory between steps."
    )
    parameter_memory_host_offload: bool = _key(
        LAYOUT, False, description="Keep the parameters in pinned host memory between steps."
    )
    use_iota_embed: bool = _key(
        LAYOUT,
        False,
        description="Embed by a one-hot matmul when the one-hot is below 2 GiB (else "
        "always by gather, which needs no [B, T, V] temporary).",
    )


class DistributedSection(_Section):
    coordinator_address: str = _key(
        RUN,
        "",
        description="Multi-process runs: host:port of process 0 for jax.distributed.initialize; "
        "empty = $JAX_COORDINATOR_ADDRESS, or a single process when that is unset too.",
    )
    num_processes: int = _key(
        RUN, -1, ge=-1, description="Multi-process runs: processes in all; -1 = $JAX_NUM_PROCESSES."
    )
    process_id: int = _key(
        RUN,
        -1,
        ge=-1,
        description="Multi-process runs: this process's index; -1 = $JAX_PROCESS_ID.",
    )


class ObserveSection(_Section):
    """Evaluation, TensorBoard and profiles of a run (docs/design/observe.md)."""

    eval_interval: int = _key(
        RUN,
        0,
        ge=0,
        description="Evaluate on held-out data every this many steps (and after the last step); "
        "0 = off. Adds eval_loss and eval_perplexity to metrics.jsonl and the console.",
    )
    eval_steps: int = _key(
        RUN, 4, gt=0, description="Batches (of the global batch size) per evaluation."
    )
    eval_dataset_path: str = _key(
        RUN,
        "",
        description="Held-out files (like dataset_path; tokenized with tokenizer_path and packed "
        "on their own); empty = a held-out synthetic stream (a seed other than the training "
        "data's). Every evaluation reads the same first eval_steps batches.",
    )
    enable_tensorboard: bool = _key(
        RUN,
        True,
        description="Write TensorBoard event files in <run dir>/tensorboard (process 0): the "
        "scalars of metrics.jsonl, device memory, per-MoE-layer expert loads, the config.",
    )
    profiler: Literal["", "xplane"] = _key(
        RUN,
        "",
        description="xplane: a jax.profiler trace of profiler_steps steps in <run dir>/profile "
        "(TensorBoard's profile plugin, or the .trace.json.gz in Perfetto); empty = off.",
    )
    skip_first_n_steps_for_profiler: int = _key(
        RUN,
        1,
        ge=0,
        description="Profile after this many steps of this process's run (compile and warm-up "
        "excluded).",
    )
    profiler_steps: int = _key(RUN, 5, gt=0, description="Steps in the profile.")


class Config(
    ModelSection,
    MoESection,
    ParallelSection,
    TrainSection,
    RematSection,
    DataSection,
    DistributedSection,
    ObserveSection,
):
    """The whole configuration; see the sections for the keys."""

    @property
    def num_dense_layers(self) -> int:
        if self.num_experts <= 1:
            return self.base_num_decoder_layers
        return self.first_num_dense_layers

    @property
    def num_moe_layers(self) -> int:
        return self.base_num_decoder_layers - self.num_dense_layers

    @property
    def is_moe(self) -> bool:
        return self.num_moe_layers > 0

    @property
    def pipeline_stages(self) -> int:
        """Stages S: the `pipeline` mesh axis (ici x dcn)."""
        return self.ici_pipeline_parallelism * self.dcn_pipeline_parallelism

    @property
    def pipelined_stack(self) -> str:
        """The layer stack the pipeline runs: "moe" for an MoE model, else "dense"."""
        return "moe" if self.is_moe else "dense"

    @property
    def pipelined_layers(self) -> int:
        """Layers run by the pipeline (the first ones of `pipelined_stack`); 0 without one."""
        if self.pipeline_stages == 1:
            return 0
        stack = self.num_moe_layers if self.is_moe else self.num_dense_layers
        return stack if self.pipeline_parallel_layers == -1 else self.pipeline_parallel_layers

    @property
    def pipeline_microbatches(self) -> int:
        """Microbatches M per step (num_pipeline_microbatches, -1 = the stages)."""
        m = self.num_pipeline_microbatches
        return self.pipeline_stages if m == -1 else m

    @property
    def pipeline_bubble_fraction(self) -> float:
        """Idle share of the pipelined layers' time: (S - 1) / (M * R + S - 1)."""
        s = self.pipeline_stages
        return (s - 1) / (self.pipeline_microbatches * self.num_pipeline_repeats + s - 1)

    @property
    def uses_routing_groups(self) -> bool:
        return self.n_routing_groups > 1

    @property
    def qk_head_dim(self) -> int:
        """Per-head query/key width used by the attention scores."""
        if self.attention_type == "mla":
            return self.qk_nope_head_dim + self.qk_rope_head_dim
        return self.head_dim

    @property
    def attn_v_head_dim(self) -> int:
        return self.v_head_dim if self.attention_type == "mla" else self.head_dim


SECTIONS = (
    ModelSection,
    MoESection,
    ParallelSection,
    TrainSection,
    RematSection,
    DataSection,
    DistributedSection,
    ObserveSection,
)


def key_kind(name: str) -> str:
    """The kind (MODEL, TRAINING, DATA, LAYOUT or RUN) declared with config key `name`."""
    extra = Config.model_fields[name].json_schema_extra
    if not isinstance(extra, dict) or extra.get("kind") not in KINDS:
        raise KeyError(f"config key {name!r} declares no kind")
    return str(extra["kind"])


def keys_of_kind(*kinds: str) -> tuple[str, ...]:
    """The config keys of the given kinds, in schema order."""
    return tuple(k for k in Config.model_fields if key_kind(k) in kinds)


def changed_keys(old: Mapping[str, Any], new: Config, kinds: Iterable[str]) -> list[str]:
    """`"key: old -> new"` for each key of `kinds` whose value in `new` differs from `old` (a
    saved config's values; a key missing there counts as its default), in schema order."""
    kinds = tuple(kinds)
    out = []
    for key, field in Config.model_fields.items():
        if key_kind(key) not in kinds:
            continue
        before, after = old.get(key, field.default), getattr(new, key)
        if before != after:
            out.append(f"{key}: {before!r} -> {after!r}")
    return out
