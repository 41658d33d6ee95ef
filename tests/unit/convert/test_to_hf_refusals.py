"""to-hf refuses, naming the key, a model setting no HF format the converter writes can hold."""

import pytest

from expertax.config import load_config
from expertax.convert.hf_config import ConversionError, config_to_hf


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
