"""to-hf refuses, naming the key, a model setting no HF format the converter writes can hold."""

import pytest

from expertax.convert.hf_config import ConversionError, config_to_hf
from expertax.preflight import load_config


@pytest.mark.parametrize(
    "key, value",
    [
        ("attention_qkv_bias", True),
        ("attention_out_bias", True),
        ("attention_sinks", True),
        ("partial_rotary_factor", 0.5),
        ("mlp_activation", "swiglu_clamped"),
    ],
)
def test_refused_naming_the_key(key, value):
    c = load_config(overrides={"model_name": "mixtral-tiny", key: value})
    with pytest.raises(ConversionError, match=f"{key}=.*needs {key}="):
        config_to_hf(c)
    assert config_to_hf(load_config(overrides={"model_name": "mixtral-tiny"}))["model_type"]


@pytest.mark.parametrize(
    "key, value",
    [
        ("partial_rotary_factor", 0.5),
        ("router_logit_bias", False),
        ("moe_expert_bias", False),
        ("attention_sinks", False),
        ("mlp_activation", "swiglu"),
    ],
)
def test_gpt_oss_refuses_what_its_format_cannot_hold(key, value):
    """GPT-OSS's format holds biases, sinks, sliding layers and the clamped SwiGLU (written);
    what it cannot hold is refused naming the key."""
    c = load_config(overrides={"model_name": "gpt-oss-tiny", key: value})
    with pytest.raises(ConversionError, match=f"{key}="):
        config_to_hf(c)
    hf = config_to_hf(load_config(overrides={"model_name": "gpt-oss-tiny"}))
    assert hf["layer_types"] == ["sliding_attention", "full_attention"]
    assert hf["rope_scaling"]["truncate"] is False and hf["sliding_window"] == 8
