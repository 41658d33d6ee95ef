"""GPT-OSS (`model_type: gpt_oss`) config.json -> expertax Config keys.

GPT-OSS is GQA with q/k/v/o biases (`attention_bias`), a learned sink logit per head, sliding-
window layers (`sliding_window`, `layer_types`) among full ones, YaRN with `truncate: false`, a
router with a trained bias (top-k of the biased logits, softmax over the chosen: the
renormalized top-k of the full softmax), experts with biases and the clamped SwiGLU
((up + 1) * g * sigmoid(1.702 g), gate <= limit, up in [-limit, limit]). Its experts are stored
fused per layer: `gate_up_proj` [E, D, 2F] with gate and up interleaved along the last axis,
`down_proj` [E, F, D], and their biases (hf_read.py reads them by model type). Other values
are refused naming the field.
"""

from __future__ import annotations

from typing import Any

from expertax.convert.errors import ConversionError, require
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
