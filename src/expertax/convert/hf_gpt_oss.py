"""GPT-OSS (`model_type: gpt_oss`) config.json -> expertax Config keys.

GPT-OSS is GQA with q/k/v/o biases (`attention_bias`), a learned sink logit per head, sliding-
window layers (`sliding_window`, `layer_types`) among full ones, YaRN with `truncate: false`, a
router with a trained bias (top-k of the biased logits, softmax over the chosen: the
renormalized top-k of the full softmax), experts with biases and the clamped SwiGLU
((up + 1) * g * sigmoid(1.702 g), gate <= limit, up in [-limit, limit]). Its experts are stored
fused per layer: `gate_up_proj` [E, D, 2F] with gate and up interleaved along the last axis,
`down_proj` [E, F, D], and their biases (hf_read.py reads them by model type; the hub's
checkpoints hold the two weights in MXFP4, mxfp4.py). Other values are refused naming the field.
`to_hf` writes the same layout back (the weights in the model's dtype, no MXFP4).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from expertax.config import Config
from expertax.convert.errors import ConversionError, require, require_keys
from expertax.convert.hf_qwen3 import gqa_dims

MODEL_TYPE = "gpt_oss"
SWIGLU_ALPHA = 1.702  # the only gain nn/activation.py's swiglu_clamped implements

# transformers' GptOssConfig values for absent fields.
HF_DEFAULTS: dict[str, Any] = {
    "num_hidden_layers": 36,
    "num_local_experts": 128,
    "vocab_size": 201088,
    "hidden_size": 2880,
    "intermediate_size": 2880,
    "head_dim": 64,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "sliding_window": 128,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 150000.0,
    "num_experts_per_tok": 4,
    "swiglu_limit": 7.0,
    "router_aux_loss_coef": 0.001,
    "attention_bias": True,
}
_KINDS = {"sliding_attention": "sliding", "full_attention": "full"}
# The leaves each fused expert tensor fills, in the order they interleave.
FUSED_LEAVES = {"gate_up_proj": ("wi_0", "wi_1"), "down_proj": ("wo",),
                "gate_up_proj_bias": ("bi_0", "bi_1"), "down_proj_bias": ("bo",)}  # fmt: skip
# Config keys only GPT-OSS's HF format holds (hf_config's _NOT_IN_HF for the other families).
WRITTEN = (
    "attention_qkv_bias", "attention_out_bias", "attention_sinks", "mlp_activation",
    "rope_yarn_truncate", "attention_layer_pattern", "sliding_window_size", "router_logit_bias",
    "moe_expert_bias",
)  # fmt: skip


def layer_pattern(layer_types: list[str], num_layers: int) -> str:
    """The shortest cycle of `layer_types` (as attention_layer_pattern) whose length divides
    the layers; GPT-OSS's alternation gives "sliding,full"."""
    if len(layer_types) != num_layers:
        raise ConversionError(
            f"HF config field layer_types has {len(layer_types)} entries for "
            f"num_hidden_layers={num_layers}; needs one per layer"
        )
    bad = sorted(set(layer_types) - set(_KINDS))
    if bad:
        raise ConversionError(
            f"HF config field layer_types: {bad[0]!r} is not supported ({', '.join(_KINDS)})"
        )
    for n in range(1, num_layers + 1):
        cycle = layer_types[:n]
        if num_layers % n == 0 and all(t == cycle[i % n] for i, t in enumerate(layer_types)):
            return ",".join(_KINDS[t] for t in cycle)
    raise AssertionError("unreachable: the whole list is a cycle")


def _experts(hf: dict) -> int:
    given = {k: hf[k] for k in ("num_experts", "num_local_experts") if hf.get(k) is not None}
    if len(set(given.values())) > 1:
        raise ConversionError(
            f"HF config fields num_experts and num_local_experts disagree ({given}); keep one"
        )
    return int(next(iter(given.values())))


def keys_from_hf(hf: dict) -> tuple[dict[str, Any], set[str]]:
    """(Config keys, the HF fields they account for) of a gpt_oss config.json (defaults
    applied); refuses what expertax does not implement."""
    require(hf, "hidden_act", ("silu",), "silu")
    require(hf, "swiglu_alpha", (SWIGLU_ALPHA, None), SWIGLU_ALPHA)
    require(hf, "attention_bias", (True,), True)
    for alias, field in (("experts_per_token", "num_experts_per_tok"),
                         ("initial_context_length", None)):  # fmt: skip
        if field and hf.get(alias) is not None and hf[alias] != hf[field]:
            raise ConversionError(
                f"HF config fields {alias}={hf[alias]} and {field}={hf[field]} disagree"
            )
    layers = hf["num_hidden_layers"]
    types = hf.get("layer_types") or [
        "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)
    ]
    pattern = layer_pattern(types, layers)
    window = int(hf.get("sliding_window") or 0)
    if "sliding" in pattern and window <= 0:
        raise ConversionError("HF config field sliding_window must be > 0 with sliding layers")
    keys = {
        "decoder_block": "gpt_oss",
        "model_name": "gpt-oss-tiny",
        "attention_type": "gqa",
        "attention_qkv_bias": True,
        "attention_out_bias": True,
        "attention_sinks": True,
        "sliding_window_size": window if "sliding" in pattern else 0,
        "attention_layer_pattern": pattern,
        **gqa_dims(hf),
        "base_moe_mlp_dim": hf["intermediate_size"],
        "base_num_decoder_layers": layers,
        "num_experts": _experts(hf),
        "num_experts_per_tok": hf["num_experts_per_tok"],
        "routed_score_func": "softmax",
        "norm_topk_prob": True,
        "router_logit_bias": True,
        "moe_expert_bias": True,
        "mlp_activation": "swiglu_clamped",
        "mlp_activation_limit": float(hf["swiglu_limit"]),
        "load_balance_loss_weight": float(hf.get("router_aux_loss_coef") or 0.0),
    }
    mapped = {
        "hidden_act", "swiglu_alpha", "swiglu_limit", "attention_bias", "experts_per_token",
        "initial_context_length", "layer_types", "sliding_window", "num_hidden_layers",
        "num_attention_heads", "num_key_value_heads", "vocab_size", "hidden_size",
        "intermediate_size", "num_experts", "num_local_experts", "num_experts_per_tok",
        "router_aux_loss_coef",
    }  # fmt: skip
    return keys, mapped


def fused_shapes(c: Config) -> dict[str, tuple[int, ...]]:
    """The hub shape of each fused expert tensor of one layer."""
    e, d, f = c.num_experts, c.base_emb_dim, c.base_moe_mlp_dim
    return {"gate_up_proj": (e, d, 2 * f), "down_proj": (e, f, d),
            "gate_up_proj_bias": (e, 2 * f), "down_proj_bias": (e, d)}  # fmt: skip


def split_fused(which: str, w: np.ndarray) -> dict[str, np.ndarray]:
    """A fused tensor (or experts of it) as our leaves' slices: gate and up are interleaved
    along the last axis (gate = [..., ::2], up = [..., 1::2]); the rest as stored."""
    if which.startswith("gate_up_proj"):
        gate, up = np.ascontiguousarray(w[..., ::2]), np.ascontiguousarray(w[..., 1::2])
        return dict(zip(FUSED_LEAVES[which], (gate, up), strict=True))
    return {FUSED_LEAVES[which][0]: w}


def join_fused(which: str, leaves: list[np.ndarray]) -> np.ndarray:
    """The inverse of `split_fused`: our leaves' slices (FUSED_LEAVES order) as the hub tensor."""
    if not which.startswith("gate_up_proj"):
        return leaves[0]
    gate, up = leaves
    out = np.empty((*gate.shape[:-1], 2 * gate.shape[-1]), gate.dtype)
    bits = f"u{gate.dtype.itemsize}"  # copied as integers: exact, and faster for bfloat16
    out.view(bits)[..., ::2], out.view(bits)[..., 1::2] = gate.view(bits), up.view(bits)
    return out


def layer_types(c: Config) -> list[str]:
    """HF's `layer_types`: each layer's kind from attention_layer_pattern's cycle."""
    cycle = c.attention_windows
    return [
        "full_attention" if cycle[i % len(cycle)] is None else "sliding_attention"
        for i in range(c.base_num_decoder_layers)
    ]


def to_hf(c: Config) -> dict[str, Any]:
    """The gpt_oss fields of config.json for `c` (config_to_hf adds the common ones)."""
    require_keys(
        c,
        "gpt_oss",
        {
            "attention_type": "gqa",
            "attention_qkv_bias": True,
            "attention_out_bias": True,
            "attention_sinks": True,
            "attention_qk_norm": False,
            "routed_score_func": "softmax",
            "norm_topk_prob": True,
            "router_logit_bias": True,
            "moe_expert_bias": True,
            "routed_bias": False,
            "routed_scaling_factor": 1.0,
            "shared_experts": 0,
            "first_num_dense_layers": 0,
            "mlp_activation": "swiglu_clamped",
        },
    )
    types = layer_types(c)
    return {
        "architectures": ["GptOssForCausalLM"],
        "model_type": MODEL_TYPE,
        "intermediate_size": c.base_moe_mlp_dim,
        "num_key_value_heads": c.base_num_kv_heads,
        "head_dim": c.head_dim,
        "num_local_experts": c.num_experts,
        "router_aux_loss_coef": c.load_balance_loss_weight,
        "layer_types": types,
        "sliding_window": c.sliding_window_size if "sliding_attention" in types else None,
        "swiglu_limit": c.mlp_activation_limit,
        "attention_bias": True,
    }
