"""The model's keys: its shapes, attention, and the MoE (routing, dispatch, expert parallelism)."""

from __future__ import annotations

from typing import Literal

from expertax.config.keys import LAYOUT, MODEL, RUN, TRAINING, _key, _Section


class ModelSection(_Section):
    model_name: str = _key(
        RUN, "deepseek3-tiny", description="Preset in configs/models/ to start from."
    )
    decoder_block: Literal["deepseek", "mixtral", "qwen3", "gpt_oss", "llama"] = _key(
        MODEL,
        "deepseek",
        description="Model family: DeepSeek (DeepSeek-V3, Kimi-K2, DeepSeek-V2 with MLA; GLM-4.5 "
        "with GQA: DeepSeek's MoE stack), Mixtral (GQA + MoE), Qwen3-MoE (GQA with q/k norm + "
        "MoE), GPT-OSS (GQA with sinks, biases and sliding layers + MoE with biases), Llama. The "
        "layers follow the other keys; the family names the HuggingFace "
        "layout the converter reads and writes.",
    )
    vocab_size: int = _key(MODEL, 512, gt=0, description="Vocabulary size V.")
    base_emb_dim: int = _key(MODEL, 128, gt=0, description="Model width D.")
    base_num_query_heads: int = _key(MODEL, 4, gt=0, description="Query heads H.")
    base_num_kv_heads: int = _key(
        MODEL, 4, gt=0, description="Key/value heads G for GQA (H % G == 0)."
    )
    head_dim: int = _key(
        MODEL,
        32,
        gt=0,
        description="GQA head dimension Q; independent of base_emb_dim / base_num_query_heads.",
    )
    mlp_activation: Literal["swiglu", "swiglu_clamped"] = _key(
        MODEL,
        "swiglu",
        description="The gated MLPs' activation (dense, shared and routed experts alike; "
        "nn/activation.py): swiglu = silu(gate) * up; swiglu_clamped = GPT-OSS's: gate clamped "
        "to <= mlp_activation_limit, up to [-limit, limit], then (up + 1) * gate * "
        "sigmoid(1.702 gate).",
    )
    mlp_activation_limit: float = _key(
        MODEL,
        7.0,
        gt=0,
        description="swiglu_clamped: the clamp of gate (above) and up (both sides); GPT-OSS: 7.",
    )
    attention_qkv_bias: bool = _key(
        MODEL,
        False,
        description="GQA: learned biases of the query, key and value projections (GLM-4.5's "
        "and GPT-OSS's attention_bias); zero at init, not weight-decayed.",
    )
    attention_out_bias: bool = _key(
        MODEL,
        False,
        description="GQA: a learned bias of the output projection (GPT-OSS); zero at init.",
    )
    attention_sinks: bool = _key(
        MODEL,
        False,
        description="GQA: a learned sink logit per query head (GPT-OSS), one more column of "
        "every row's softmax with no value, so a head can give a row less than all its weight "
        "(kernel.attend_dot; every attention_impl but cudnn, which is refused). Zero at init; "
        "training, prefill and decoding alike.",
    )
    sliding_window_size: int = _key(
        MODEL,
        0,
        ge=0,
        description="Sliding-window attention: a query of a sliding layer reads the keys at most "
        "this many positions back, itself included (q - k < window; Mistral's, GPT-OSS's 128); "
        "0: none. Which layers slide: attention_layer_pattern (empty: every layer).",
    )
    attention_layer_pattern: str = _key(
        MODEL,
        "",
        description="GQA: the attention kind of each layer as a cycle, comma-separated kinds "
        "`full` or `sliding` (sliding_window_size), layer l taking entry l mod the cycle's "
        "length; GPT-OSS: sliding,full. Its length divides both layer stacks; the layers are "
        "scanned one cycle at a time, so every layer's mask is static (models/layer_pattern.py), "
        "also in a pipeline stage (each stage visit whole cycles) and in the paged stash's stack. "
        "Empty: every layer sliding when sliding_window_size > 0, else full.",
    )
    attention_qk_norm: bool = _key(
        MODEL,
        False,
        description="GQA: RMSNorm each query and key head over its head_dim (a learned scale "
        "[Q] for queries, one for keys, shared by the heads; epsilon "
        "normalization_layer_epsilon) after the projections and before RoPE, as Qwen3 does "
        "(nn/attention/qk_norm.py). Training, prefill and decoding alike; the cache holds the "
        "normed keys.",
    )
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
    attention_impl: Literal["auto", "dot", "blockwise", "cudnn", "splash"] = _key(
        LAYOUT,
        "auto",
        description="Attention kernel: dot (whole [T, S] score matrices, saved for backward), "
        "blockwise (online softmax over key blocks, recomputed in backward; memory linear in T), "
        "cudnn (cuDNN flash attention: GPU, bfloat16/float16, head dims padded to one multiple "
        "of 8 up to 256, so MLA's v is padded to the q/k dim), splash (Pallas TPU splash "
        "attention: TPU, unequal q/k and v dims as they are), auto (per platform, "
        "nn/attention/evidence.py: CPU dot below kernel.AUTO_BLOCKWISE_MIN_LENGTH positions and "
        "blockwise from there; GPU cudnn where dtype and dims allow, else the CPU rule; TPU dot "
        "below that length and splash from it).",
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
    partial_rotary_factor: float = _key(
        MODEL,
        1.0,
        gt=0.0,
        le=1.0,
        description="GQA: the share of each head's dims RoPE rotates (the first "
        "head_dim x factor, an even count; the rest pass unrotated), as GLM-4.5's 0.5; 1: all.",
    )
    rope_max_timescale: float = _key(MODEL, 10_000.0, gt=0, description="RoPE base (theta).")
    rope_yarn_truncate: bool = _key(
        MODEL,
        True,
        description="YaRN: round the ramp's correction range to whole dims (floor / ceil), as "
        "the paper and DeepSeek do; false keeps the fractional bounds (GPT-OSS's truncate: false).",
    )
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
    router_logit_bias: bool = _key(
        MODEL,
        False,
        description="A trained bias of the router's logits (GPT-OSS: logits = x W + b, top-k "
        "and weights from the biased logits); zero at init, not weight-decayed. Unlike "
        "routed_bias (DeepSeek-V3's selection-only bias, updated outside the optimizer).",
    )
    moe_expert_bias: bool = _key(
        MODEL,
        False,
        description="Routed experts with biases (GPT-OSS): act(x W_gate + b_gate, x W_up + "
        "b_up) W_down + b_down per expert (nn/moe/bias.py); zero at init, not weight-decayed. "
        "Every dispatch path; the fused routed FFN steps aside for the grouped matmuls.",
    )
    routed_scaling_factor: float = _key(
        MODEL, 1.0, gt=0, description="Multiplies the routing weights."
    )
    n_routing_groups: int = _key(
        MODEL,
        -1,
        ge=-1,
        description="Group-limited routing: experts split in this many groups; -1 = off.",
    )
    topk_routing_group: int = _key(
        MODEL,
        -1,
        ge=-1,
        description="Group-limited routing: groups kept per token (by routing_group_score).",
    )
    routing_group_score: Literal["top2_sum", "max"] = _key(
        MODEL,
        "top2_sum",
        description="Group-limited routing: a group's score, the sum of its two best experts' "
        "selection scores (DeepSeek-V3, GLM-4.5) or its best one's (DeepSeek-V2's "
        "group_limited_greedy).",
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
    mtp_num_layers: int = _key(
        MODEL,
        0,
        ge=0,
        description="DeepSeek-V3 multi-token prediction: D modules after the main stack (models/"
        "mtp.py), module k predicting the token k+1 past the next one; 0 = off.",
    )
    mtp_loss_scaling_factor: float = _key(
        TRAINING,
        0.1,
        ge=0,
        description="lambda of the MTP loss: loss += lambda / D x sum over depths of their "
        "cross-entropy (DeepSeek-V3: 0.3, then 0.1).",
    )
    use_random_routing: bool = _key(
        TRAINING,
        False,
        description="Benchmarks: route to uniformly random experts, ignoring the router.",
    )
    float32_weight_sum: bool = _key(
        TRAINING, True, description="Combine the K expert outputs in float32 (else in `dtype`)."
    )
    gmm_impl: Literal[
        "auto",
        "ragged_dot",
        "tiled",
        "tokamax_triton",
        "tokamax_mosaic_gpu",
        "megablox",
        "fp8_hopper",
    ] = _key(
        LAYOUT,
        "auto",
        description="Grouped-matmul backend of the sparse path: tiled (pure JAX loops, any "
        "platform), ragged_dot (jax.lax.ragged_dot), tokamax_triton / tokamax_mosaic_gpu (GPU "
        "kernels, extra 'gpu'), megablox (TPU kernels); auto picks per platform from the "
        "evidence recorded in nn/moe/gmm.py (MEASURED). fp8_hopper (quantization only, Hopper "
        "GPUs, D and F multiples of 64): the routed experts' fp8 fprop, dgrad and wgrad on e4m3 "
        "wgmma (fp8/kernel.py), which auto picks under quantization on a Hopper mesh where the "
        "dims fit.",
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
        "backward loop projects each tile again; the [rows, D] expert outputs only when "
        "moe_mlpwo is kept); false: a separate row gather, grouped matmuls and scatter.",
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
    num_attention_token_chunks: int = _key(
        LAYOUT,
        1,
        ge=1,
        description="Run each attention layer's queries in this many chunks of the sequence "
        "(keys and values once for the whole sequence; per chunk: the query projection, the "
        "kernel against the keys up to the chunk's end, the output projection), each under the "
        "layer's remat policy, so the queries, the kernel's saved output and statistics and the "
        "output projection's input are one chunk's. Must divide max_target_length; not with "
        "attention_impl=cudnn (auto then picks blockwise).",
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
        gt=0,
        description="Stash buffer rows per device = factor x MoE layers x the rows a device "
        "receives on average per layer (its tokens x num_experts_per_tok), plus one page.",
    )
    moe_paged_stash_page_rows: int = _key(
        LAYOUT,
        256,
        gt=0,
        description="Rows copied to/from the stash per loop step; the buffer's slack is one page.",
    )
    ragged_buffer_factor: float = _key(
        TRAINING,
        -1.0,
        description="Receive buffer of the all-to-all EP path: -1 = worst case (dropless); > 0 "
        "caps it at factor x the rows a shard routes; rows past it are counted as dropped.",
    )
