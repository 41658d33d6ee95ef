"""The keys of how a model is trained and laid out: mesh, optimizer and precision, data,
rematerialization, processes, observability."""

from __future__ import annotations

from typing import Literal

from expertax.config.keys import DATA, LAYOUT, RUN, TRAINING, DType, _key, _Section


class ParallelSection(_Section):
    ici_pipeline_parallelism: int = _key(
        LAYOUT,
        1,
        gt=0,
        description="Pipeline stages (the `pipeline` mesh axis); > 1 pipelines the layer stack "
        "chosen by pipeline_parallel_layers (models/pipeline.py).",
    )
    ici_data_parallelism: int = _key(
        LAYOUT, 1, ge=-1, description="Data-parallel axis size (-1: the rest)."
    )
    ici_fsdp_parallelism: int = _key(
        LAYOUT, -1, ge=-1, description="FSDP axis size (-1: the rest)."
    )
    ici_context_parallelism: int = _key(
        LAYOUT,
        1,
        ge=-1,
        description="Context-parallel axis size (-1: the rest): each sequence split along its "
        "tokens over this many devices (nn/attention/context.py; docs/design/context.md).",
    )
    ici_expert_parallelism: int = _key(
        LAYOUT, 1, ge=-1, description="Expert-parallel axis size (-1: the rest)."
    )
    ici_tensor_parallelism: int = _key(
        LAYOUT, 1, ge=-1, description="Tensor-parallel axis size (-1: the rest)."
    )
    dcn_pipeline_parallelism: int = _key(
        LAYOUT, 1, gt=0, description="Pipeline stages across hosts/slices (times the ici size)."
    )
    num_pipeline_microbatches: int = _key(
        LAYOUT,
        -1,
        ge=-1,
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
        ge=-1,
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
    dcn_data_parallelism: int = _key(
        LAYOUT, 1, ge=-1, description="Data-parallel across hosts/slices."
    )
    dcn_fsdp_parallelism: int = _key(LAYOUT, 1, ge=-1, description="FSDP across hosts/slices.")
    dcn_context_parallelism: int = _key(
        LAYOUT, 1, ge=-1, description="Context parallelism across hosts/slices."
    )
    context_parallel_load_balance: bool = _key(
        LAYOUT,
        True,
        description="Under context parallelism, reorder each sequence once per batch so that "
        "device i holds chunks i and 2cp-1-i of 2cp (causal attention's work even); "
        "positions, segment ids, targets and MTP targets move with the tokens.",
    )
    context_parallel_strategy: Literal["all_gather", "ring"] = _key(
        LAYOUT,
        "all_gather",
        description="Under context parallelism, how attention reaches the other devices' keys: "
        "all_gather (the sequence's key state gathered whole, one collective per layer) or ring "
        "(MLA's latent passed round the context axis, cp steps: no device holds more than two "
        "shares of it; MLA with the blockwise kernel only; nn/attention/latent_ring.py).",
    )
    dcn_expert_parallelism: int = _key(
        LAYOUT, 1, ge=-1, description="Expert parallelism across hosts/slices."
    )
    dcn_tensor_parallelism: int = _key(
        LAYOUT, 1, ge=-1, description="Tensor parallelism across hosts/slices."
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
    quantization: Literal["", "fp8_tensorwise", "fp8_blockwise"] = _key(
        TRAINING,
        "",
        description="fp8 training GEMMs (fp8/matmul.py, docs/design/fp8.md): the decoder layers' "
        "linears (attention projections, dense and shared-expert MLPs) and the routed experts' "
        "grouped GEMMs multiply e4m3 operands in fprop, dgrad and wgrad, scaled per tensor "
        "(fp8_tensorwise) or in DeepSeek-V3's 1x128 / 128x128 tiles (fp8_blockwise); embedding, "
        "router, attention core, output head and MTP's projection stay in dtype. '' = off. "
        "Training only (generate samples in dtype).",
    )
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
    opt_type: Literal["adamw", "muon"] = _key(
        TRAINING,
        "adamw",
        description="The optimizer (MaxText's key): adamw, or muon (train/muon.py: momentum "
        "orthogonalised by Newton-Schulz for the matrices, expert stacks batched; AdamW with "
        "the adam_* keys for embeddings, output head, norms, biases and 1-D parameters).",
    )
    muon_beta: float = _key(
        TRAINING, 0.95, ge=0, lt=1, description="Muon's momentum decay (Nesterov)."
    )
    muon_weight_decay: float = _key(
        TRAINING,
        0.1,
        ge=0,
        description="Muon's decoupled weight decay of the matrices, times the learning rate "
        "(as adam_weight_decay: with the consistent-RMS update both carry over).",
    )
    muon_consistent_rms: float = _key(
        TRAINING,
        0.2,
        ge=0,
        description="Scale each orthogonalised update by this x sqrt(max(fan_in, fan_out)) so "
        "its RMS matches AdamW's (Moonlight's rule; 0.2 keeps AdamW's learning rate); 0 = "
        "Keller Jordan's width scaling sqrt(max(1, fan_out / fan_in)) (MaxText's None).",
    )
    muon_include_routers: bool = _key(
        TRAINING,
        True,
        description="Whether Muon also updates the MoE router matrices (else AdamW does).",
    )
    muon_ns_steps: int = _key(
        TRAINING, 5, ge=1, le=20, description="Newton-Schulz iterations (the quintic one)."
    )
    muon_ns_dtype: DType = _key(
        TRAINING,
        "float32",
        description="The dtype Newton-Schulz multiplies in: float32, or bfloat16 as Keller "
        "Jordan's and Moonlight's recipes (the momentum stays in mu_dtype).",
    )
    use_qk_clip: bool = _key(
        TRAINING,
        False,
        description="Kimi-K2's QK-clip (MuonClip with opt_type=muon; MaxText's key): after each "
        "step, every MLA head whose largest attention logit of the step passed "
        "qk_clip_threshold has its query and key projections scaled so that it would not "
        "(nn/attention/qk_clip.py); the logits are measured beside the attention kernel, one "
        "more Q K^T per layer in the forward.",
    )
    qk_clip_threshold: float = _key(
        TRAINING, 100.0, gt=0, description="QK-clip's threshold tau on a head's largest logit."
    )
    num_vocab_tiling: int = _key(
        LAYOUT,
        1,
        ge=1,
        description="Compute the output logits and cross-entropy this many sequence tiles at a "
        "time (recomputed in backward), so the float32 [B, T, V] logits never exist at once; "
        "must divide max_target_length.",
    )
    init_weights_seed: int = _key(
        TRAINING, 0, ge=0, lt=2**32, description="Seed of the parameter initialization."
    )
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
        RUN, "runs", min_length=1, description="Runs are written under this folder."
    )
    run_name: str = _key(
        RUN,
        "",
        description="Run folder name (one folder: letters, digits and - _ . + @, at most 255 "
        "bytes); empty = a timestamp.",
    )
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
        DATA, 0, ge=0, lt=2**32, description="Seed of the data order (and synthetic data)."
    )
    synthetic_noise: float = _key(
        DATA,
        0.0,
        description="dataset_type=synthetic: the probability, in [0, 1), that a target token is "
        "replaced by a uniform random token (a function of seed, step and row; inputs stay "
        "clean); 0 = the plain sequences. It gives the loss a floor, the entropy of the mixture "
        "1-p on the right token + p/V on each: -(1-p+p/V) ln(1-p+p/V) - (V-1)(p/V) ln(p/V) nats "
        "(V = vocab_size; p=0.3, V=512: 2.48), where runs stay comparable; without it the "
        "sequences are memorized and the loss goes towards 0 (data/synthetic.py). The held-out "
        "synthetic stream is replaced alike.",
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
        DATA, "text", min_length=1, description="JSONL key / Parquet column with the text."
    )
    data_num_epochs: int = _key(
        DATA, -1, ge=-1, description="dataset_type=files: passes over the data; -1 repeats forever."
    )
    data_worker_count: int = _key(
        RUN, 0, ge=0, description="dataset_type=files: reader threads (never changes the batches)."
    )
    routing_replay: bool = _key(
        TRAINING,
        False,
        description="Reinforcement learning on MoE: each batch carries `routing`, int32 [B, T, "
        "L_moe, K], the experts the sampler's routers used per token (expertax generate "
        "--record-routing; data/rollouts.py), and every MoE layer of the main stack uses them "
        "instead of its router's top-k (-1: the router's own choice). The router still gets "
        "its gradient through the gates: its scores of the imposed experts; the load-balance "
        "loss and the routing-bias update count the imposed experts (with the router's "
        "probabilities). Needs the plain MoE stack: no pipeline over the MoE layers, "
        "moe_paged_stash=false, dropless capacity_factor=-1.",
    )
    token_advantages: bool = _key(
        TRAINING,
        False,
        description="Each batch carries `advantages`, float32 [B, T] (data/rollouts.py), that "
        "multiply each target token's cross-entropy: loss = sum(weights x advantages x nll) / "
        "max(sum(weights), 1), the policy-gradient surrogate averaged over the batch's target "
        "tokens (`weights` stays the 0/1 mask of the tokens trained on).",
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
        LAYOUT,
        False,
        description="Keep the optimizer state in pinned host memory between steps; AdamW's "
        "update streams it through the device a layer at a time (Muon's, or with the "
        "parameters offloaded too, copies it in whole).",
    )
    parameter_memory_host_offload: bool = _key(
        LAYOUT,
        False,
        description="Keep the parameters in pinned host memory between steps (copied to "
        "device memory whole for the step: no saving at the step's peak).",
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
    distributed_auto_detect: bool = _key(
        RUN,
        True,
        description="Multi-process runs: with none of the three keys above (nor their $JAX_* "
        "variables) set, join the other processes of a SLURM (srun), Open MPI (mpirun), Cloud "
        "TPU or Kubernetes Indexed Job launch through jax.distributed.initialize() with no "
        "arguments; false = each such process runs alone.",
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
