"""GLM-4.5 (`model_type: glm4_moe`; GLM-4.5, GLM-4.5-Air) config.json <-> expertax Config keys.

GLM-4.5 is DeepSeek-V3's MoE stack (hf_deepseek.moe_keys: sigmoid routing with the
selection-only `e_score_correction_bias`, groups, `routed_scaling_factor`, shared experts,
`first_k_dense_replace` dense layers, `num_nextn_predict_layers` multi-token-prediction layers
after the main stack) on GQA attention: a head dim of its own (`head_dim`), biases on the q, k
and v projections (`attention_bias`; none on o_proj), an optional per-head q/k RMSNorm
(`use_qk_norm`) and RoPE over the first `partial_rotary_factor` of each head's dims, rotated
half-split (transformers' `rotate_half` over the rotary dims), as `nn.rope.apply` does. In
expertax: decoder_block deepseek with attention_type gqa.
"""

from __future__ import annotations

from typing import Any

from expertax.config import Config
from expertax.convert import hf_deepseek
from expertax.convert.errors import ConversionError, require_keys
from expertax.convert.hf_qwen3 import gqa_dims

MODEL_TYPE = "glm4_moe"

# Glm4MoeConfig's values for absent fields (transformers 5; partial_rotary_factor 0.5 is set
# in its __post_init__ when absent, num_nextn_predict_layers is its num_mtp_layers).
HF_DEFAULTS: dict[str, Any] = {
    "vocab_size": 151552,
    "hidden_size": 4096,
    "intermediate_size": 10944,
    "num_hidden_layers": 46,
    "num_attention_heads": 96,
    "num_key_value_heads": 8,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "rope_theta": 10_000.0,
    "attention_bias": False,
    "moe_intermediate_size": 1408,
    "num_experts_per_tok": 8,
    "n_shared_experts": 1,
    "n_routed_experts": 128,
    "routed_scaling_factor": 1.0,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "norm_topk_prob": True,
    "use_qk_norm": False,
    "partial_rotary_factor": 0.5,
    "num_nextn_predict_layers": 1,
}
# Config keys the glm4_moe format holds that the other formats do not (hf_config._NOT_IN_HF).
HOLDS = ("attention_qkv_bias", "partial_rotary_factor")


def keys_from_hf(hf: dict) -> tuple[dict[str, Any], set[str]]:
    """(Config keys, the HF fields they account for) of a glm4_moe config.json (defaults
    applied)."""
    keys, mapped = hf_deepseek.moe_keys(hf, sigmoid=True)
    for key in ("num_mtp_layers",):  # transformers 5's name for num_nextn_predict_layers
        if hf.get(key) not in (None, keys["mtp_num_layers"]):
            raise ConversionError(
                f"HF config fields {key}={hf[key]} and num_nextn_predict_layers="
                f"{keys['mtp_num_layers']} disagree; they name the same count: keep one"
            )
    keys.update(
        gqa_dims(hf),
        model_name="glm4.5-tiny",
        attention_type="gqa",
        attention_qkv_bias=bool(hf["attention_bias"]),
        attention_qk_norm=bool(hf["use_qk_norm"]),
    )
    mapped |= {
        "num_attention_heads",
        "num_key_value_heads",
        "attention_bias",
        "use_qk_norm",
        "num_mtp_layers",
    }
    return keys, mapped


def to_hf(c: Config) -> dict[str, Any]:
    """The glm4_moe fields of config.json for `c` (config_to_hf adds the common ones)."""
    require_keys(
        c,
        "deepseek",
        {
            "routed_score_func": "sigmoid",
            "routed_bias": True,
            "routing_group_score": "top2_sum",
        },
    )
    return {
        **hf_deepseek.moe_to_hf(c),
        "architectures": ["Glm4MoeForCausalLM"],
        "model_type": MODEL_TYPE,
        "num_key_value_heads": c.base_num_kv_heads,
        "head_dim": c.head_dim,
        "attention_bias": c.attention_qkv_bias,
        "use_qk_norm": c.attention_qk_norm,
        "partial_rotary_factor": c.partial_rotary_factor,
    }
