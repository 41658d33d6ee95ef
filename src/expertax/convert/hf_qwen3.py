"""Qwen3-MoE (`model_type: qwen3_moe`) config.json <-> expertax Config keys.

Qwen3-MoE is GQA with a per-head RMSNorm of queries and keys before RoPE (`attention_qk_norm`),
a head dim of its own (`head_dim`, 128 in the published models, not hidden / heads), softmax
top-k routing with optional renormalization (`norm_topk_prob`), no shared experts and no
routing bias. Implemented as published: every layer an MoE layer (`decoder_sparse_step` 1,
`mlp_only_layers` empty), no attention biases, no sliding window; other values are refused
naming the field. The hub's configs name the expert count `num_experts`, transformers 5 writes
`num_local_experts`: either is read (both, when they agree).
"""

from __future__ import annotations

from typing import Any

from expertax.config import Config
from expertax.convert.errors import ConversionError, require, require_keys

MODEL_TYPE = "qwen3_moe"

# transformers' Qwen3MoeConfig values for absent fields (the expert count: `_experts`).
HF_DEFAULTS: dict[str, Any] = {
    "vocab_size": 151936,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "num_hidden_layers": 24,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "rope_theta": 10_000.0,
    "moe_intermediate_size": 768,
    "num_experts_per_tok": 8,
    "norm_topk_prob": False,
    "router_aux_loss_coef": 0.001,
}
_DEFAULT_EXPERTS = 128


def _experts(hf: dict) -> int:
    """The routed expert count from `num_experts` (hub) or `num_local_experts` (transformers 5)."""
    given = {k: hf[k] for k in ("num_experts", "num_local_experts") if hf.get(k) is not None}
    if len(set(given.values())) > 1:
        raise ConversionError(
            f"HF config fields num_experts={given['num_experts']} and num_local_experts="
            f"{given['num_local_experts']} disagree; they name the same count: keep one"
        )
    e = next(iter(given.values()), _DEFAULT_EXPERTS)
    if e < 2:  # expertax's num_experts=1 is a dense model, HF's an MoE layer of one expert
        raise ConversionError(
            f"HF config field num_experts={e} is not supported (supported: num_experts >= 2)"
        )
    return int(e)


def gqa_dims(hf: dict) -> dict[str, Any]:
    """The vocabulary, width and GQA head keys of a config.json (Qwen3-MoE's, GPT-OSS's,
    GLM-4.5's)."""
    heads = hf["num_attention_heads"]
    return {
        "vocab_size": hf["vocab_size"],
        "base_emb_dim": hf["hidden_size"],
        "base_num_query_heads": heads,
        "base_num_kv_heads": hf.get("num_key_value_heads") or heads,
        "head_dim": hf.get("head_dim") or hf["hidden_size"] // heads,
    }


def keys_from_hf(hf: dict) -> tuple[dict[str, Any], set[str]]:
    """(Config keys, the HF fields they account for) of a qwen3_moe config.json (defaults
    applied); refuses what expertax does not implement."""
    require(hf, "hidden_act", ("silu",), "silu")
    require(hf, "attention_bias", (False,), False)
    require(hf, "use_sliding_window", (False,), False)
    require(hf, "decoder_sparse_step", (1,), 1)
    if hf.get("mlp_only_layers"):
        raise ConversionError(
            f"HF config field mlp_only_layers={hf['mlp_only_layers']!r}: dense layers among the "
            "MoE layers are not supported (expertax's dense layers come first); supported: []"
        )
    keys = {
        "decoder_block": "qwen3",
        "model_name": "qwen3-moe-tiny",
        "attention_type": "gqa",
        "attention_qk_norm": True,
        **gqa_dims(hf),
        "base_mlp_dim": hf["intermediate_size"],  # unused: no dense layers
        "base_moe_mlp_dim": hf["moe_intermediate_size"],
        "base_num_decoder_layers": hf["num_hidden_layers"],
        "num_experts": _experts(hf),
        "num_experts_per_tok": hf["num_experts_per_tok"],
        "routed_score_func": "softmax",
        "norm_topk_prob": bool(hf["norm_topk_prob"]),
        "load_balance_loss_weight": float(hf.get("router_aux_loss_coef") or 0.0),
    }
    mapped = {
        "hidden_act",
        "attention_bias",
        "use_sliding_window",
        "sliding_window",  # unused while use_sliding_window is false (transformers too)
        "max_window_layers",  # the same
        "decoder_sparse_step",
        "mlp_only_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "moe_intermediate_size",
        "num_hidden_layers",
        "num_experts",
        "num_local_experts",
        "num_experts_per_tok",
        "norm_topk_prob",
        "router_aux_loss_coef",
    }
    return keys, mapped


def to_hf(c: Config) -> dict[str, Any]:
    """The qwen3_moe fields of config.json for `c` (config_to_hf adds the common ones)."""
    require_keys(
        c,
        "qwen3",
        {
            "attention_type": "gqa",
            "attention_qk_norm": True,
            "routed_score_func": "softmax",
            "routed_bias": False,
            "routed_scaling_factor": 1.0,
            "shared_experts": 0,
            "first_num_dense_layers": 0,
        },
    )
    if c.num_experts < 2:
        raise ConversionError(
            f"decoder_block='qwen3' has no HF equivalent with num_experts={c.num_experts} "
            "(a dense model here; needs num_experts >= 2)"
        )
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": MODEL_TYPE,
        "intermediate_size": c.base_mlp_dim,
        "moe_intermediate_size": c.base_moe_mlp_dim,
        "num_key_value_heads": c.base_num_kv_heads,
        "head_dim": c.head_dim,
        "num_experts": c.num_experts,
        "norm_topk_prob": c.norm_topk_prob,
        "router_aux_loss_coef": c.load_balance_loss_weight,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "attention_bias": False,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": c.base_num_decoder_layers,
    }
