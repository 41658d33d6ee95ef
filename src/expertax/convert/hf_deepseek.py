"""DeepSeek-family config.json <-> expertax Config keys: DeepSeek-V3 (`deepseek_v3`), Kimi-K2
(`kimi_k2`: DeepSeek-V3's architecture under its own model_type) and DeepSeek-V2
(`deepseek_v2`), all MLA; and the MoE stack they share with GLM-4.5 (hf_glm.py).

The shared MoE stack (`moe_keys`): `first_k_dense_replace` dense layers, then MoE layers of
`n_routed_experts` experts (top `num_experts_per_tok`) and `n_shared_experts` shared ones, the
weights scaled by `routed_scaling_factor`, group-limited selection over `n_group` groups keeping
`topk_group`, and `num_nextn_predict_layers` multi-token-prediction layers stored after the main
stack. DeepSeek-V3, Kimi-K2 and GLM-4.5 score by sigmoid with a selection-only bias
(`e_score_correction_bias`, topk_method `noaux_tc`), a group scored by its two best experts;
DeepSeek-V2 by softmax without bias (topk_method `greedy`, or `group_limited_greedy`: a group
scored by its best expert).
"""

from __future__ import annotations

from typing import Any

from expertax.config import Config
from expertax.convert.errors import ConversionError, require

KIMI_K2 = "kimi_k2"
MODEL_TYPES = ("deepseek_v3", KIMI_K2, "deepseek_v2")

# DeepseekV3Config's values for absent fields (Kimi-K2's remote code is DeepSeek-V3's).
V3_DEFAULTS: dict[str, Any] = {
    "vocab_size": 129280,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "n_shared_experts": 1,
    "n_routed_experts": 256,
    "routed_scaling_factor": 2.5,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "qk_nope_head_dim": 128,
    "n_group": 8,
    "topk_group": 4,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 3,
    "norm_topk_prob": True,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "rope_theta": 10_000.0,
}
# DeepseekV2Config's (transformers 5; num_experts_per_tok has no default there).
V2_DEFAULTS: dict[str, Any] = {
    "vocab_size": 102400,
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "moe_intermediate_size": 1407,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "n_shared_experts": 2,
    "n_routed_experts": 64,
    "routed_scaling_factor": 1.0,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "qk_nope_head_dim": 128,
    "topk_method": "greedy",
    "first_k_dense_replace": 0,
    "norm_topk_prob": False,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "rope_theta": 10_000.0,
}
HF_DEFAULTS = {"deepseek_v3": V3_DEFAULTS, KIMI_K2: V3_DEFAULTS, "deepseek_v2": V2_DEFAULTS}

# The fields moe_keys accounts for.
_MOE_FIELDS = {
    "hidden_act",
    "moe_layer_freq",
    "n_shared_experts",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "moe_intermediate_size",
    "num_hidden_layers",
    "first_k_dense_replace",
    "n_routed_experts",
    "num_local_experts",
    "num_experts_per_tok",
    "routed_scaling_factor",
    "n_group",
    "topk_group",
    "norm_topk_prob",
}


def moe_keys(hf: dict, *, sigmoid: bool) -> tuple[dict[str, Any], set[str]]:
    """(Config keys, HF fields accounted for) of the DeepSeek-style MoE stack: dense layers
    first, routed and shared experts, groups, scaling, multi-token prediction; `sigmoid`: the
    sigmoid router with the selection-only bias, else softmax without one."""
    require(hf, "hidden_act", ("silu",), "silu")
    require(hf, "moe_layer_freq", (1,), 1)
    experts = hf["n_routed_experts"]
    if hf.get("num_local_experts") not in (None, experts):
        raise ConversionError(
            f"HF config fields n_routed_experts={experts} and num_local_experts="
            f"{hf['num_local_experts']} disagree; they name the same count: keep one"
        )
    mtp = hf.get("num_nextn_predict_layers") or 0
    dense = hf.get("first_k_dense_replace") or 0
    if mtp and dense >= hf["num_hidden_layers"]:
        # HF's MTP layer is an MoE layer by its index, ours is MoE when the model has MoE layers
        raise ConversionError(
            f"HF config fields num_nextn_predict_layers={mtp} with first_k_dense_replace="
            f"{dense} >= num_hidden_layers={hf['num_hidden_layers']} (no MoE layer): "
            "multi-token prediction is supported for models with MoE layers only"
        )
    keys = {
        "decoder_block": "deepseek",
        "vocab_size": hf["vocab_size"],
        "base_emb_dim": hf["hidden_size"],
        "base_mlp_dim": hf["intermediate_size"],
        "base_moe_mlp_dim": hf["moe_intermediate_size"],
        "base_num_decoder_layers": hf["num_hidden_layers"],
        "first_num_dense_layers": dense,
        "num_experts": experts,
        "num_experts_per_tok": hf["num_experts_per_tok"],
        "shared_experts": hf.get("n_shared_experts") or 0,
        "routed_score_func": "sigmoid" if sigmoid else "softmax",
        "routed_bias": sigmoid,
        "routed_scaling_factor": float(hf.get("routed_scaling_factor") or 1.0),
        "n_routing_groups": hf.get("n_group") or 1,
        "topk_routing_group": hf.get("topk_group") or 1,
        "norm_topk_prob": bool(hf.get("norm_topk_prob", True)),
        "mtp_num_layers": mtp,
    }
    return keys, set(_MOE_FIELDS)


def moe_to_hf(c: Config) -> dict[str, Any]:
    """The MoE stack's fields of config.json for `c` (inverse of `moe_keys`)."""
    if c.num_moe_layers == 0:
        raise ConversionError(
            f"decoder_block=deepseek without MoE layers (first_num_dense_layers="
            f"{c.first_num_dense_layers} of base_num_decoder_layers="
            f"{c.base_num_decoder_layers}) has no HF equivalent"
        )
    return {
        "intermediate_size": c.base_mlp_dim,
        "moe_intermediate_size": c.base_moe_mlp_dim,
        "first_k_dense_replace": c.num_dense_layers,
        "n_routed_experts": c.num_experts,
        "n_shared_experts": c.shared_experts,
        "routed_scaling_factor": c.routed_scaling_factor,
        "n_group": max(c.n_routing_groups, 1),
        "topk_group": max(c.topk_routing_group, 1),
        "norm_topk_prob": c.norm_topk_prob,
        "num_nextn_predict_layers": c.mtp_num_layers,
    }


def _mla_keys(hf: dict) -> tuple[dict[str, Any], set[str]]:
    require(hf, "attention_bias", (False,), False)
    heads = hf["num_attention_heads"]
    require(hf, "num_key_value_heads", (heads, None), heads)
    keys = {
        "attention_type": "mla",
        "base_num_query_heads": heads,
        "base_num_kv_heads": heads,
        "q_lora_rank": hf.get("q_lora_rank") or 0,
        "kv_lora_rank": hf["kv_lora_rank"],
        "qk_nope_head_dim": hf["qk_nope_head_dim"],
        "qk_rope_head_dim": hf["qk_rope_head_dim"],
        "v_head_dim": hf["v_head_dim"],
    }
    mapped = {
        "attention_bias",
        "num_attention_heads",
        "num_key_value_heads",
        "q_lora_rank",
        "kv_lora_rank",
        "qk_nope_head_dim",
        "qk_rope_head_dim",
        "v_head_dim",
    }
    return keys, mapped


def keys_from_hf(hf: dict) -> tuple[dict[str, Any], set[str]]:
    """(Config keys, HF fields accounted for) of a deepseek_v3, kimi_k2 or deepseek_v2
    config.json (defaults applied)."""
    v2 = hf["model_type"] == "deepseek_v2"
    if v2:
        require(hf, "scoring_func", ("softmax",), "softmax")
        require(hf, "topk_method", ("greedy", "group_limited_greedy"), "greedy")
        require(hf, "mlp_bias", (False,), False)
        require(hf, "rope_interleave", (True,), True)  # transformers' V2 always interleaves
        if hf.get("norm_topk_prob") and hf["num_experts_per_tok"] > 1:
            raise ConversionError(
                "HF config field norm_topk_prob=True with model_type=deepseek_v2 is not "
                "supported: transformers' DeepseekV2 ignores it, DeepSeek's reference code "
                "normalizes; supported: False"
            )
    else:
        require(hf, "scoring_func", ("sigmoid",), "sigmoid")
        require(hf, "topk_method", ("noaux_tc",), "noaux_tc")
    keys, mapped = moe_keys(hf, sigmoid=not v2)
    mla, mla_fields = _mla_keys(hf)
    keys.update(mla, model_name="deepseek3-tiny")
    if v2:
        greedy = hf.get("topk_method") == "greedy"
        keys.update(norm_topk_prob=False)
        if greedy:  # n_group and topk_group unused (and None in DeepSeek-V2-Lite's config)
            keys.update(n_routing_groups=1, topk_routing_group=1)
        else:  # group_limited_greedy scores a group by its best expert
            keys.update(routing_group_score="max")
    return keys, mapped | mla_fields | {"scoring_func", "topk_method", "mlp_bias"}


def to_hf(c: Config, base: dict) -> dict[str, Any]:
    """The fields of config.json for an MLA `c`: deepseek_v2 for softmax routing without a
    bias, else deepseek_v3 (kimi_k2 when `base`, the source config, says so)."""
    hf = {
        **moe_to_hf(c),
        "num_key_value_heads": c.base_num_query_heads,
        "q_lora_rank": c.q_lora_rank or None,
        "kv_lora_rank": c.kv_lora_rank,
        "qk_nope_head_dim": c.qk_nope_head_dim,
        "qk_rope_head_dim": c.qk_rope_head_dim,
        "v_head_dim": c.v_head_dim,
        "attention_bias": False,
    }
    if c.routed_score_func == "softmax" and not c.routed_bias:
        hf.pop("num_nextn_predict_layers")
        return {**hf, **_v2_to_hf(c)}
    if c.routed_score_func != "sigmoid" or not c.routed_bias or c.routing_group_score != "top2_sum":
        raise ConversionError(
            "decoder_block=deepseek with MLA needs routed_score_func=sigmoid, routed_bias=true "
            "and routing_group_score=top2_sum (DeepSeek-V3), or routed_score_func=softmax and "
            f"routed_bias=false (DeepSeek-V2); got routed_score_func={c.routed_score_func!r}, "
            f"routed_bias={c.routed_bias}, routing_group_score={c.routing_group_score!r}"
        )
    kimi = base.get("model_type") == KIMI_K2
    hf.update(
        architectures=["DeepseekV3ForCausalLM"],
        model_type=KIMI_K2 if kimi else "deepseek_v3",
        scoring_func="sigmoid",
        topk_method="noaux_tc",
        rope_interleave=True,  # hf_write sets the layout the weights are written in
    )
    if kimi and "auto_map" in base:  # the hub's Kimi-K2 loads through its remote code
        hf["auto_map"] = base["auto_map"]
    return hf


def _v2_to_hf(c: Config) -> dict[str, Any]:
    if c.norm_topk_prob and c.num_experts_per_tok > 1:
        raise ConversionError(
            "norm_topk_prob=true with routed_score_func=softmax in decoder_block=deepseek "
            "(DeepSeek-V2): transformers' DeepseekV2 does not normalize; needs false"
        )
    if c.mtp_num_layers:
        raise ConversionError(
            f"mtp_num_layers={c.mtp_num_layers}: DeepSeek-V2 (softmax routing) has no "
            "multi-token-prediction layers in HF's format; needs 0"
        )
    grouped = c.uses_routing_groups
    if grouped and c.routing_group_score != "max":
        raise ConversionError(
            f"routing_group_score={c.routing_group_score!r} with routed_score_func=softmax: "
            "DeepSeek-V2's group_limited_greedy scores a group by its best expert; needs 'max'"
        )
    return {
        "architectures": ["DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v2",
        "scoring_func": "softmax",
        "topk_method": "group_limited_greedy" if grouped else "greedy",
        "norm_topk_prob": False,
    }
