"""HuggingFace `config.json` <-> expertax `Config`, for DeepSeek-V3, Kimi-K2 and DeepSeek-V2
(hf_deepseek.py), GLM-4.5 (hf_glm.py), Mixtral and Qwen3-MoE (hf_qwen3.py).

Every field of the HF config is either mapped to a Config key, checked against the one value
expertax implements (anything else is refused with a `ConversionError` naming the HF field), or
listed in `_IGNORED` with the reason it does not change the model's logits. Unknown fields are
refused, so a new HF feature can never be dropped silently.

YaRN is read from `rope_scaling` (hub configs, transformers < 5) or `rope_parameters`
(transformers >= 5); `rope_theta` from the top level or from inside either dict.
"""

from __future__ import annotations

from typing import Any

from expertax.config import Config
from expertax.convert import hf_deepseek, hf_glm, hf_gpt_oss, hf_qwen3, mxfp4
from expertax.convert.errors import ConversionError, require
from expertax.preflight import build_config

SUPPORTED = (
    *hf_deepseek.MODEL_TYPES,
    hf_glm.MODEL_TYPE,
    "mixtral",
    hf_qwen3.MODEL_TYPE,
    hf_gpt_oss.MODEL_TYPE,
)

# Fields that do not affect the model's forward pass (or are handled elsewhere), with the reason.
_IGNORED: dict[str, str] = {
    "architectures": "class name; implied by model_type",
    "model_type": "selects the mapping",
    "transformers_version": "writer's version",
    "auto_map": "remote-code class names",
    "bos_token_id": "tokenizer",
    "eos_token_id": "tokenizer",
    "pad_token_id": "tokenizer",
    "use_cache": "generation only",
    "initializer_range": "initialization only",
    "output_router_logits": "HF output option",
    "max_position_embeddings": "kept in hf_config.json (YaRN uses original_max_...)",
    "torch_dtype": "mapped to weight_dtype",
    "dtype": "mapped to weight_dtype",
    "head_dim": "DeepSeek: derived (= qk_rope_head_dim); Mixtral, Qwen3-MoE: mapped",
    "qk_head_dim": "derived (qk_nope_head_dim + qk_rope_head_dim)",
    "pretraining_tp": "HF ignores it in the forward pass",
    "ep_size": "DeepSeek reference code's expert-parallel degree; a layout, not the model",
    "aux_loss_alpha": "DeepSeek's sequence-wise auxiliary loss (training only; not converted)",
    "seq_aux": "DeepSeek's sequence-wise auxiliary loss (training only; not converted)",
    "rope_interleave": "handled by permuting the RoPE weight columns at conversion",
    "attn_implementation": "HF kernel choice",
    "_attn_implementation": "HF kernel choice",
    "tie_word_embeddings": "mapped to logits_via_embedding",
}
# Generic transformers PretrainedConfig fields (to_dict() writes them): not model features.
_IGNORED.update(
    dict.fromkeys(
        (
            "_name_or_path",
            "chunk_size_feed_forward",
            "id2label",
            "label2id",
            "is_encoder_decoder",
            "output_attentions",
            "output_hidden_states",
            "problem_type",
            "return_dict",
            "torchscript",
            "tokenizer_class",
            "task_specific_params",
            "finetuning_task",
        ),
        "generic transformers config field",
    )
)

# Values transformers' config classes (DeepseekV3Config, MixtralConfig, ...) use for absent
# fields, so a sparse config.json means what it means to transformers.
_HF_DEFAULTS: dict[str, dict[str, Any]] = {
    **hf_deepseek.HF_DEFAULTS,
    hf_glm.MODEL_TYPE: hf_glm.HF_DEFAULTS,
    "mixtral": {
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "max_position_embeddings": 4096 * 32,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "num_experts_per_tok": 2,
        "num_local_experts": 8,
        "router_aux_loss_coef": 0.001,
        "rope_theta": 1_000_000.0,
    },
    hf_qwen3.MODEL_TYPE: hf_qwen3.HF_DEFAULTS,
    hf_gpt_oss.MODEL_TYPE: hf_gpt_oss.HF_DEFAULTS,
}

_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def _rope(hf: dict) -> tuple[dict, dict[str, Any]]:
    """(the RoPE dict as given, Config keys for RoPE)."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if not isinstance(params, dict) or any(isinstance(v, dict) for v in params.values()):
        raise ConversionError(
            "HF config field rope_parameters: per-layer-type RoPE parameters are not supported"
        )
    theta = params.get("rope_theta", hf["rope_theta"])
    kind = params.get("rope_type", params.get("type", "default"))
    out: dict[str, Any] = {"rope_max_timescale": float(theta)}
    if kind == "default":
        return params, {**out, "rope_type": "default"}
    if kind != "yarn":
        raise ConversionError(
            f"HF config field rope_parameters.rope_type={kind!r} is not supported (default, yarn)"
        )
    if params.get("attention_factor") is not None:
        raise ConversionError(
            "HF config field rope_parameters.attention_factor is not supported; expertax derives "
            "the YaRN amplitude from mscale and mscale_all_dim"
        )
    orig = params.get("original_max_position_embeddings") or hf.get("max_position_embeddings")
    if not orig:
        raise ConversionError(
            "rope_scaling of type yarn needs original_max_position_embeddings (in rope_scaling) "
            "or max_position_embeddings in config.json; neither is set"
        )
    factor = params.get("factor") or hf["max_position_embeddings"] / orig
    return params, {
        **out,
        "rope_type": "yarn",
        "rope_factor": float(factor),
        "original_max_position_embeddings": int(orig),
        "beta_fast": float(params.get("beta_fast") or 32.0),
        "beta_slow": float(params.get("beta_slow") or 1.0),
        # HF uses the mscale ratio only when both are set, else mscale(factor); 0 does the same.
        "mscale": float(params.get("mscale") or 0.0),
        "mscale_all_dim": float(params.get("mscale_all_dim") or 0.0),
        "rope_yarn_truncate": bool(params.get("truncate", True)),
    }


_ROPE_FIELDS = ("rope_parameters", "rope_scaling", "rope_theta", "partial_rotary_factor")


# The formats whose multi-token-prediction layers are converted (`num_nextn_predict_layers`;
# glm4_moe also as transformers 5's `num_mtp_layers`).
_MTP: dict[str, tuple[str, ...]] = dict.fromkeys(
    ("deepseek_v3", hf_deepseek.KIMI_K2), ("num_nextn_predict_layers",)
)
_MTP[hf_glm.MODEL_TYPE] = ("num_nextn_predict_layers", "num_mtp_layers")


def _no_mtp(hf: dict, model_type: str) -> None:
    """Refuse multi-token-prediction layers outside the formats of `_MTP`."""
    for key in ("num_nextn_predict_layers", "num_mtp_layers"):
        if key in _MTP.get(model_type, ()):
            continue
        if hf.get(key):
            raise ConversionError(
                f"HF config field {key}={hf[key]!r}: multi-token-prediction layers are "
                f"converted for {', '.join(_MTP)} only, not for {model_type}"
            )


def _partial_rotary_factor(hf: dict, params: dict, rope_type: str) -> float:
    """The RoPE share of each head (top level in hub configs, in rope_parameters in
    transformers 5); other than 1 for glm4_moe with default RoPE only."""
    factor = float(params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)))
    if factor != 1.0 and (hf["model_type"] != hf_glm.MODEL_TYPE or rope_type != "default"):
        raise ConversionError(
            f"HF config field partial_rotary_factor={factor} is not supported with "
            f"model_type={hf['model_type']} and rope_type={rope_type} (supported: 1.0; "
            "glm4_moe with default RoPE: any)"
        )
    return factor


def _mixtral(hf: dict) -> tuple[dict[str, Any], set[str]]:
    require(hf, "hidden_act", ("silu",), "silu")
    require(hf, "sliding_window", (None,), None)
    require(hf, "router_jitter_noise", (0, 0.0), 0.0)
    heads = hf["num_attention_heads"]
    keys = {
        "decoder_block": "mixtral",
        "model_name": "mixtral-tiny",
        "attention_type": "gqa",
        "vocab_size": hf["vocab_size"],
        "base_emb_dim": hf["hidden_size"],
        "base_num_query_heads": heads,
        "base_num_kv_heads": hf.get("num_key_value_heads") or heads,
        "head_dim": hf.get("head_dim") or hf["hidden_size"] // heads,
        "base_mlp_dim": hf["intermediate_size"],
        "base_moe_mlp_dim": hf["intermediate_size"],
        "base_num_decoder_layers": hf["num_hidden_layers"],
        "num_experts": hf["num_local_experts"],
        "num_experts_per_tok": hf["num_experts_per_tok"],
        "routed_score_func": "softmax",
        "norm_topk_prob": True,
        "load_balance_loss_weight": float(hf.get("router_aux_loss_coef", 0.0)),
    }
    mapped = {
        "hidden_act",
        "sliding_window",
        "router_jitter_noise",
        "num_attention_heads",
        "vocab_size",
        "hidden_size",
        "num_key_value_heads",
        "intermediate_size",
        "num_hidden_layers",
        "num_local_experts",
        "num_experts_per_tok",
        "router_aux_loss_coef",
        "use_sliding_window",
        "max_window_layers",
    }
    if hf.get("use_sliding_window"):
        raise ConversionError("HF config field use_sliding_window=true is not supported")
    return keys, mapped


_FAMILIES = {
    **dict.fromkeys(hf_deepseek.MODEL_TYPES, hf_deepseek.keys_from_hf),
    hf_glm.MODEL_TYPE: hf_glm.keys_from_hf,
    "mixtral": _mixtral,
    hf_qwen3.MODEL_TYPE: hf_qwen3.keys_from_hf,
    hf_gpt_oss.MODEL_TYPE: hf_gpt_oss.keys_from_hf,
}


def defaults_taken(hf: dict) -> str:
    """The fields config.json leaves out that are read as transformers' defaults, as a clause
    for a refusal that they may explain ("" when none)."""
    kind = str(hf.get("model_type", ""))
    absent = {k: v for k, v in _HF_DEFAULTS.get(kind, {}).items() if k not in hf}
    if not absent:
        return ""
    taken = ", ".join(f"{k} (taken as {v!r})" for k, v in list(absent.items())[:6])
    more = f" and {len(absent) - 6} more" if len(absent) > 6 else ""
    return (
        f"; config.json lacks {taken}{more}, read as transformers' defaults: give the "
        "checkpoint's own values in config.json"
    )


def config_from_hf(hf: dict) -> Config:
    """The expertax Config of an HF config.json dict; refuses what it cannot represent."""
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED:
        raise ConversionError(
            f"HF config field model_type={model_type!r} is not supported ({', '.join(SUPPORTED)})"
        )
    hf = {**_HF_DEFAULTS[model_type], **hf}
    if mxfp4.quantization_format(hf.get("quantization_config")) == mxfp4.QUANT_METHOD and (
        model_type != hf_gpt_oss.MODEL_TYPE
    ):
        raise ConversionError(
            f"HF config field quantization_config.quant_method='mxfp4' with model_type="
            f"{model_type!r}: MXFP4 experts are read for gpt_oss only"
        )
    require(hf, "attention_dropout", (0, 0.0, None), 0.0)
    _no_mtp(hf, model_type)
    keys, mapped = _FAMILIES[model_type](hf)
    params, rope_keys = _rope(hf)
    factor = _partial_rotary_factor(hf, params, rope_keys["rope_type"])
    if keys["attention_type"] == "gqa":  # MLA rotates its own qk_rope_head_dim
        keys["partial_rotary_factor"] = factor
    if model_type == "mixtral" and rope_keys["rope_type"] != "default":
        raise ConversionError("HF config field rope_parameters: Mixtral supports default RoPE only")
    if keys["num_experts_per_tok"] == 1 and keys["norm_topk_prob"]:
        raise ConversionError(
            "HF config fields num_experts_per_tok=1 with norm_topk_prob=true: HF normalizes a "
            "single weight to 1, expertax keeps the raw score; not supported"
        )
    unknown = sorted(
        set(hf)
        - mapped
        - set(_IGNORED)
        - set(_ROPE_FIELDS)
        - {"quantization_config", "attention_dropout", "rms_norm_eps"}
        - {"num_nextn_predict_layers", "num_mtp_layers"}
    )
    if unknown:
        raise ConversionError(
            f"HF config fields {', '.join(unknown)} are not known to the {model_type} converter; "
            "refusing rather than ignoring them"
        )
    dtype = hf.get("dtype") or hf.get("torch_dtype") or "float32"
    if dtype not in _DTYPES:
        raise ConversionError(f"HF config field dtype={dtype!r} is not supported")
    keys.update(rope_keys)
    keys.update(
        normalization_layer_epsilon=float(hf.get("rms_norm_eps", 1e-6)),
        logits_via_embedding=bool(hf.get("tie_word_embeddings", False)),
        weight_dtype=_DTYPES[dtype],
        dtype=_DTYPES[dtype],
    )
    return build_config(keys)


def _rope_to_hf(c: Config) -> dict[str, Any]:
    if c.rope_type == "default":
        return {"rope_theta": c.rope_max_timescale, "rope_scaling": None}
    scaling: dict[str, Any] = {
        "type": "yarn",
        "factor": c.rope_factor,
        "original_max_position_embeddings": c.original_max_position_embeddings,
        "beta_fast": c.beta_fast,
        "beta_slow": c.beta_slow,
    }
    if c.mscale:
        scaling["mscale"] = c.mscale
    if c.mscale_all_dim:
        scaling["mscale_all_dim"] = c.mscale_all_dim
    if not c.rope_yarn_truncate:  # GPT-OSS's (the other families' configs refuse it)
        scaling["truncate"] = False
    return {"rope_theta": c.rope_max_timescale, "rope_scaling": scaling}


def _max_positions(c: Config) -> int:
    if c.rope_type == "yarn":
        return int(c.original_max_position_embeddings * c.rope_factor)
    return c.max_target_length


# Keys no HF format the converter writes can hold: key -> (the value it can, what the formats do).
_NOT_IN_HF: dict[str, tuple[Any, str]] = {
    "attention_qkv_bias": (False, "no attention biases"),
    "attention_out_bias": (False, "no attention biases"),
    "attention_sinks": (False, "no attention sinks"),
    "partial_rotary_factor": (1.0, "RoPE over whole heads"),
    "mlp_activation": ("swiglu", "silu(gate) * up"),
    "rope_yarn_truncate": (True, "YaRN's whole-dim correction range"),
    "attention_layer_pattern": ("", "one attention kind for every layer"),
    "sliding_window_size": (0, "no sliding-window layers"),
    "router_logit_bias": (False, "no trained router bias"),
    "moe_expert_bias": (False, "no expert biases"),
}


def config_to_hf(c: Config, base: dict | None = None) -> dict[str, Any]:
    """An HF config.json dict for `c`; `base` (the original HF config) supplies non-model fields.

    Written in the hub's style (`rope_theta` + `rope_scaling`), which transformers 4 and 5 read.
    """
    if c.mtp_num_layers and c.decoder_block != "deepseek":
        raise ConversionError(
            f"mtp_num_layers={c.mtp_num_layers} with decoder_block={c.decoder_block!r}: HF's "
            "formats have multi-token-prediction layers for DeepSeek-V3 and GLM-4.5 only "
            "(num_nextn_predict_layers); this model's MTP modules have no place in it"
        )
    glm = c.decoder_block == "deepseek" and c.attention_type == "gqa"
    gpt_oss = c.decoder_block == "gpt_oss"
    for key, (plain, what) in _NOT_IN_HF.items():
        held = (glm and key in hf_glm.HOLDS) or (gpt_oss and key in hf_gpt_oss.WRITTEN)
        if getattr(c, key) != plain and not held:
            holders = (("glm4_moe", hf_glm.HOLDS), ("gpt_oss", hf_gpt_oss.WRITTEN))
            only = [f for f, keys in holders if key in keys]
            has = f" ({' and '.join(only)} hold it)" if only else ""
            raise ConversionError(
                f"{key}={getattr(c, key)!r}: the HF formats the converter writes for "
                f"decoder_block={c.decoder_block!r} have {what}{has}; needs {key}={plain!r}"
            )
    if c.decoder_block == "deepseek" and c.attention_type == "mla":
        hf = hf_deepseek.to_hf(c, dict(base or {}))
    elif glm:
        hf = hf_glm.to_hf(c)
    elif c.decoder_block == "mixtral" and c.attention_type == "gqa" and c.num_dense_layers == 0:
        hf = _mixtral_to_hf(c)
    elif c.decoder_block == "qwen3":
        hf = hf_qwen3.to_hf(c)
    elif gpt_oss:
        hf = hf_gpt_oss.to_hf(c)
    else:
        raise ConversionError(
            f"decoder_block={c.decoder_block!r} with attention_type={c.attention_type!r} has no "
            "HF equivalent in the converter (deepseek + mla or gqa, mixtral + gqa, qwen3 + gqa, "
            "gpt_oss + gqa)"
        )
    hf.update(_rope_to_hf(c))
    hf.update(
        vocab_size=c.vocab_size,
        hidden_size=c.base_emb_dim,
        num_hidden_layers=c.base_num_decoder_layers,
        num_attention_heads=c.base_num_query_heads,
        num_experts_per_tok=c.num_experts_per_tok,
        rms_norm_eps=c.normalization_layer_epsilon,
        tie_word_embeddings=c.logits_via_embedding,
        hidden_act="silu",
        attention_dropout=0.0,
        torch_dtype=c.weight_dtype,
    )
    base = dict(base or {})
    hf.setdefault("max_position_embeddings", base.get("max_position_embeddings", _max_positions(c)))
    for key in ("bos_token_id", "eos_token_id", "pad_token_id", "initializer_range"):
        if key in base:
            hf[key] = base[key]
    return hf


def _mixtral_to_hf(c: Config) -> dict[str, Any]:
    if (
        c.routed_score_func != "softmax"
        or not c.norm_topk_prob
        or c.shared_experts
        or c.attention_qk_norm
    ):
        raise ConversionError(
            "decoder_block=mixtral needs routed_score_func=softmax, norm_topk_prob=true, "
            "shared_experts=0 and attention_qk_norm=false for HF"
        )
    return {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "intermediate_size": c.base_moe_mlp_dim,
        "num_key_value_heads": c.base_num_kv_heads,
        "head_dim": c.head_dim,
        "num_local_experts": c.num_experts,
        "router_aux_loss_coef": c.load_balance_loss_weight,
        "router_jitter_noise": 0.0,
        "sliding_window": None,
    }
